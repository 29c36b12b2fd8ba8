"""The plugin's settings on vLLM's Ray actors: :func:`carry_settings_to_ray`.

The settings travel in the environment (``MLA_SM120_CONFIG``, ``MLA_SM120_SELF_CHECK``, ...). vLLM's
Ray paths (0.33 and 0.34 alike) copy to the actors they start only variables they know (``vllm/ray/ray_env.py``:
``get_env_vars_to_copy``, used for Ray data-parallel engine cores) plus the prefixes a user adds to
:data:`~.names.RAY_EXTRA_PREFIXES_ENV`. mp and external-launcher workers inherit the environment anyway.
"""

from __future__ import annotations

import os

from .names import RAY_EXTRA_PREFIXES_ENV, SETTINGS_PREFIX


def carry_settings_to_ray() -> None:
    """Add :data:`~.names.SETTINGS_PREFIX` to vLLM's extra Ray prefixes when a plugin setting is set here.

    vLLM loads plugins in the API server before it starts engine cores or workers, so the
    variable is in place when its Ray launchers read it. Never raises.
    """
    if not any(name.startswith(SETTINGS_PREFIX) for name in os.environ):
        return
    prefixes = [p.strip() for p in os.environ.get(RAY_EXTRA_PREFIXES_ENV, "").split(",") if p.strip()]
    if SETTINGS_PREFIX not in prefixes:
        os.environ[RAY_EXTRA_PREFIXES_ENV] = ",".join([*prefixes, SETTINGS_PREFIX])
