"""The flags: ``--mla-sm120`` and ``--mla-sm120-config`` on every parser SGLang builds.

:data:`HOOKS` puts them there (AFTER ``ServerArgs.add_cli_args``), registered in every process
whether or not the plugin is enabled. Parsing ``--mla-sm120`` refuses an SGLang release the hooks
were not read from, exports the opt-in for the scheduler
processes (SGLang's children inherit the environment) and installs the engine hooks in this process
at once (:func:`.install.engine_hooks`: the parse runs after ``load_plugins()`` applied what was
registered then); ``--mla-sm120-config`` is checked as a JSON object and exported too.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable

from ... import envs
from .names import CONFIG_FLAG, ENABLE_ENV, FLAG, INLINE_CONFIG_ENV, PLAN_ENV

ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"


class _EnableAction(argparse._StoreTrueAction):  # noqa: SLF001 - SGLang's --config merger admits store/store_true only
    """``--mla-sm120``: exports the opt-in for the scheduler processes and hooks this process now."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        os.environ[ENABLE_ENV] = "1"
        os.environ.pop(PLAN_ENV, None)  # this is the launcher: it plans afresh
        from . import hooks, install

        refusal = hooks.release_refusal()
        if refusal is not None:  # the hooks were read from other releases: nothing is hooked
            parser.error(refusal)

        missing = install.engine_hooks(apply_now=True)
        if missing:
            parser.error(hooks.missing_message(missing))


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


def _served_models() -> list[str]:
    """The ``--model`` names of the built-in profiles SGLang builds (from the profiles, not a list here)."""
    from ...engines import lookup
    from ...profiles import mla_sm120_model_profiles

    missing = lookup("sglang").missing_architectures
    return [profile.name for profile in mla_sm120_model_profiles()
            if not all(arch in missing for arch in profile.architectures)]


def add_arguments(parser: argparse.ArgumentParser) -> bool:
    """Add ``--mla-sm120`` and ``--mla-sm120-config`` to a parser that lacks them; returns whether it did."""
    try:
        parser.add_argument(FLAG, action=_EnableAction, default=False,
                            help=f"Serve sparse-MLA models ({', '.join(_served_models())}) with mla-sm120-plugin's "
                                 "kernels on SM120/SM121: decided before the weights load, one kernel per layer "
                                 f"kind and phase (same as {ENABLE_ENV}=1).")
    except argparse.ArgumentError:  # argparse's answer to an option the parser has: added before
        return False
    parser.add_argument(CONFIG_FLAG, action=_ConfigAction, default=None, metavar="JSON",
                        help="mla-sm120-plugin settings as JSON: prefill_kernel, decode_kernel, kv_scale_format, "
                             f"config_file, per-model sections ({envs.CONFIG}=file.toml also works).")
    return True


def after_add_cli_args(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``ServerArgs.add_cli_args``: the flags join every parser SGLang builds."""
    for candidate in (*args, *kwargs.values()):
        if isinstance(candidate, argparse.ArgumentParser):
            add_arguments(candidate)
            break
    return None


HOOKS: dict[str, Callable[..., Any]] = {ADD_CLI_ARGS: after_add_cli_args}  # AFTER, in every process
