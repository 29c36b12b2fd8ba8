"""Every environment variable the plugin reads or sets, named once, with what it does.

A user-facing setting is documented here (README's settings table is this table: a test compares
them); the variables an engine adapter exports for its own child processes are listed too, so no
module spells a name of its own. Pure Python: importing this module reads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "MLA_SM120_"  # every variable below starts with it (vLLM's Ray launcher is told to copy the prefix)

CONFIG = "MLA_SM120_CONFIG"
SELF_CHECK = "MLA_SM120_SELF_CHECK"
DISABLE_PLUGINS = "MLA_SM120_DISABLE_PLUGINS"
DEVICE = "MLA_SM120_DEVICE"
SGLANG = "MLA_SM120_SGLANG"
SGLANG_CONFIG = "MLA_SM120_SGLANG_CONFIG"
SGLANG_PLAN = "MLA_SM120_SGLANG_PLAN"
SPLITS = "MLA_SM120_SPLITS"


@dataclass(frozen=True)
class Variable:
    """One environment variable.

    :param name: the variable.
    :param values: what it takes.
    :param effect: what it does.
    :param user: a user sets it (False: the plugin sets it for its own child processes).
    """

    name: str
    values: str
    effect: str
    user: bool = True


VARIABLES = (
    Variable(CONFIG, "a TOML file's path", "the plugin config file (per-model sections), read where each worker runs; "
             "an inline config's config_file wins"),
    Variable(SELF_CHECK, "on (default), off, strict", "the init self-check: off skips it (logged), strict refuses "
             "instead of falling back to the decision's next kernel"),
    Variable(DISABLE_PLUGINS, "plugin names, comma-separated", "plugins (entry points or built-ins) not to load"),
    Variable(DEVICE, "sm_120, 12.1, sm_90, cpu, rocm, ...", "decide for this device instead of this machine's GPU "
             "(what mla-sm120 check --sm does)"),
    Variable(SGLANG, "1 / true / yes / on", "SGLang's opt-in for the Python API (what --mla-sm120 sets for the "
             "scheduler processes)"),
    Variable(SGLANG_CONFIG, "a JSON object of plugin settings", "SGLang's inline plugin config (what "
             "--mla-sm120-config sets for the scheduler processes)"),
    Variable(SPLITS, "a positive integer", "run triton_dsv4 with this many candidate ranges a (token, head block) "
             "instead of its launch plan's (tests and hold-outs run the split path on any machine; the math is the same)"),
    Variable(SGLANG_PLAN, "set by the plugin", "the SGLang launcher's plan (each layer kind's selection context) for "
             "its scheduler processes", user=False),
)


def markdown_table() -> str:
    """The user-facing variables as README's settings table (``python -m mla_sm120_plugin.envs``)."""
    rows = ["| variable | values | what it does |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.values} | {v.effect} |" for v in VARIABLES if v.user]
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover
    print(markdown_table())
