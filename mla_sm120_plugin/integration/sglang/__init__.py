"""SGLang integration: the ``sglang.srt.plugins`` entry point and the ``--mla-sm120`` flag.

SGLang's ``load_plugins()`` calls :func:`register` once in every process it starts (launcher,
schedulers, detokenizer), before the launcher parses its command line. Installed but not enabled,
the plugin only adds its two flags to SGLang's parser: resolution and the kernel call stay
SGLang's own. Enabled (``--mla-sm120``, or ``MLA_SM120_SGLANG=1`` for the Python API), it hooks
SGLang's DSA backend resolution (in the launcher, before any weight loads), SGLang's SM120
validator and its ``flashinfer_sparse_mla`` call site (:mod:`.hooks`). The flag's value reaches
the scheduler processes through the environment, which SGLang's children inherit.

Every place this package depends on SGLang 0.5.23 internals is a dotted name in :mod:`.hooks`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

logger = logging.getLogger("mla_sm120_plugin")

BUILT_FOR = "0.5.23"  # the SGLang release these hooks were written and tested against
ENABLE_ENV = "MLA_SM120_SGLANG"
INLINE_CONFIG_ENV = "MLA_SM120_SGLANG_CONFIG"
FLAG = "--mla-sm120"
CONFIG_FLAG = "--mla-sm120-config"
ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
_TRUE = ("1", "true", "yes", "on")

# Set once this process has registered (SGLang's loader runs once, but a test or an embedder may
# call register() again).
_state: dict[str, Any] = {}


def enabled() -> bool:
    """The user opted in: ``--mla-sm120`` was parsed here or in the launcher, or ``MLA_SM120_SGLANG=1``."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() in _TRUE


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: cheap, idempotent, never raises into SGLang.

    Registers the parser hook always and the engine hooks only when enabled; says in the log
    when the installed SGLang is not the release the hooks were built against.
    """
    if _state:
        return
    _state["registered"] = True
    try:
        from importlib.metadata import PackageNotFoundError, version

        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        try:
            installed = version("sglang")
        except PackageNotFoundError:
            installed = "unknown"
        if installed != BUILT_FOR:
            logger.warning("mla_sm120: built for sglang %s, running on sglang %s; `mla-sm120 doctor` and the "
                           "start-up check say whether every hook applied", BUILT_FOR, installed)
        HookRegistry.register(ADD_CLI_ARGS, after_add_cli_args, HookType.AFTER)
        if enabled():
            from . import hooks

            hooks.register_engine_hooks()
    except Exception as exc:  # an exception here is logged and swallowed by SGLang: say it plainly
        _state["failed"] = f"{type(exc).__name__}: {exc}"
        logger.warning("mla_sm120: could not register with SGLang: %s", _state["failed"])


class _EnableAction(argparse._StoreTrueAction):  # noqa: SLF001 - SGLang's --config merger admits store/store_true only
    """``--mla-sm120``: exports the opt-in for the scheduler processes and hooks this process now
    (the parse runs after ``load_plugins()`` applied the hooks registered so far)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        os.environ[ENABLE_ENV] = "1"
        from . import hooks

        os.environ.pop(hooks.CONTEXT_ENV, None)  # this is the launcher: it decides afresh

        missing = hooks.register_engine_hooks(apply_now=True)
        if missing:
            parser.error(hooks.missing_hooks_message(missing))


class _ConfigAction(argparse._StoreAction):  # noqa: SLF001 - as above
    """``--mla-sm120-config '{...}'``: the plugin's settings as JSON (the keys of ``mla_sm120.toml``),
    checked as JSON here and exported for the schedulers."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            parsed = json.loads(values)
        except ValueError as exc:
            parser.error(f"{CONFIG_FLAG}: not JSON ({exc}); pass e.g. '{{\"decode_kernel\": \"triton_sparse_mla\"}}'")
        if not isinstance(parsed, dict):
            parser.error(f"{CONFIG_FLAG}: {values!r:.80} is not a JSON object; pass "
                         "'{\"decode_kernel\": \"triton_sparse_mla\"}' or another object of plugin settings")
        super().__call__(parser, namespace, values, option_string)
        os.environ[INLINE_CONFIG_ENV] = values


def add_arguments(parser: argparse.ArgumentParser) -> bool:
    """Add ``--mla-sm120`` and ``--mla-sm120-config`` to a parser that lacks them; returns whether it did."""
    if any(FLAG in action.option_strings for action in parser._actions):  # noqa: SLF001
        return False
    parser.add_argument(FLAG, action=_EnableAction, default=False,
                        help="Serve DeepSeek-Sparse-Attention models (GLM-5, DeepSeek-V3.2) with mla-sm120-plugin's "
                             "kernels on SM120/SM121: decided before the weights load, one kernel per phase "
                             f"(same as {ENABLE_ENV}=1).")
    parser.add_argument(CONFIG_FLAG, action=_ConfigAction, default=None, metavar="JSON",
                        help="mla-sm120-plugin settings as JSON: prefill_kernel, decode_kernel, kv_scale_format, "
                             "config_file, per-model sections (MLA_SM120_CONFIG=file.toml also works).")
    return True


def after_add_cli_args(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``ServerArgs.add_cli_args``: the flags join every parser SGLang builds."""
    for candidate in (*args, *kwargs.values()):
        if isinstance(candidate, argparse.ArgumentParser):
            add_arguments(candidate)
            break
    return None
