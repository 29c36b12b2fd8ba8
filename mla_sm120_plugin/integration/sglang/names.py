"""The names every room of the SGLang adapter shares (a leaf: it imports only :mod:`mla_sm120_plugin.envs`).

The two flags, the environment variables the flags set for SGLang's child processes (named once, in
:mod:`mla_sm120_plugin.envs`), the logger and the opt-in test :func:`enabled`. Pure Python. The
supported SGLang release is spelled once, in :data:`mla_sm120_plugin.engines.RELEASES`.
"""

from __future__ import annotations

import os

from ... import envs

FLAG = "--mla-sm120"
CONFIG_FLAG = "--mla-sm120-config"
ENABLE_ENV = envs.SGLANG  # the opt-in, for the scheduler processes and the Python API
INLINE_CONFIG_ENV = envs.SGLANG_CONFIG  # --mla-sm120-config's JSON, for the scheduler processes
PLAN_ENV = envs.SGLANG_PLAN  # the launcher's plan (layer kind -> context JSON), for the schedulers
LOGGER = "mla_sm120_plugin"
_TRUE = ("1", "true", "yes", "on")


def enabled() -> bool:
    """The user opted in: ``--mla-sm120`` was parsed here or in the launcher, or ``MLA_SM120_SGLANG=1``."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in _TRUE
