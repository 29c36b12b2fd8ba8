"""Running ``mla-sm120`` as a user would, and reading what it says (torch-free: imports no torch).

:func:`clean_env` (a subprocess's environment), :func:`run_cli`, :func:`decision_of` (a layer kind's
decision in ``check --json``), :func:`assert_three_parts` (the plugin's given / supported / fix
message), the demo third-party plugins' names (tests/fixtures/demo_plugin), and
:func:`config_with_sections` (a plugin config with one setting in several sections).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


TESTS_DIR = Path(__file__).resolve().parent.parent  # tests/: the helpers' package sits in it
# What a subprocess test inherits from the caller: how to find programs, files and the GPU the
# caller sees; never the caller's plugin, engine or Triton settings (MLA_SM120_*, VLLM_*, SGLANG_*,
# TRITON_INTERPRET), which would make the test depend on the shell it was started from.
_BASE_ENV = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "CUDA_VISIBLE_DEVICES", "CUDA_HOME")


def clean_env(**extra: str) -> dict[str, str]:
    """A subprocess environment: :data:`_BASE_ENV` from this one, this checkout and ``tests/`` (so
    ``import support.<module>`` works there as under pytest) on ``PYTHONPATH``, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if k in _BASE_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS_DIR.parent), str(TESTS_DIR)])
    env.update(extra)
    return env


def decision_of(report: dict, kind: str = "dsa") -> dict:
    """A layer kind's decision in a ``check --json`` report (one schema for every family: a DSA model
    is one kind, ``"dsa"``)."""
    return report["layer_kinds"][kind]["decision"]


def run_cli(*args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``mla-sm120`` in a subprocess, as a user would, from :func:`clean_env` (``timeout``: a
    guard against a hang, in seconds)."""
    full_env = clean_env()
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), full_env["PYTHONPATH"]])
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "mla_sm120_plugin.cli", *args],
        capture_output=True, text=True, env=full_env, timeout=timeout,
    )


# The demo third-party distribution (tests/fixtures/demo_plugin): one good plugin, and broken ones
# that tests enable one at a time through MLA_SM120_DISABLE_PLUGINS.
DEMO_FAULTY_HOOKS = {
    "demo_select_raises": ["mla_sm120_select raised RuntimeError: demo select exploded"],
    "demo_select_exits": ["mla_sm120_select raised SystemExit: 3"],
    "demo_validate_int": ["mla_sm120_validate returned int 42"],
    "demo_validate_str": ["mla_sm120_validate returned str 'no'"],
}
DEMO_BROKEN = ("demo_broken_import", "demo_wrong_type", "demo_duplicate", "demo_exits_on_import",
               "demo_slow_import", *DEMO_FAULTY_HOOKS)


def demo_plugins_except(keep: str | None = None) -> dict[str, str]:
    """Environment that blocks every broken demo plugin but ``keep``."""
    return {"MLA_SM120_DISABLE_PLUGINS": ",".join(n for n in DEMO_BROKEN if n != keep)}


def assert_three_parts(message: str, given_prefix: str = "") -> None:
    """``message`` has the plugin's error shape: given / supported / fix, one per line."""
    lines = message.splitlines()
    assert lines[0].startswith(f"given: {given_prefix}"), message
    assert any(line.startswith("supported: ") for line in lines[1:]), message
    assert lines[-1].startswith("fix: ") or any(line.startswith("fix: ") for line in lines), message


CONFIG_SECTIONS = ("top", "arch", "glob", "exact")  # weakest first (README "Plugin config")


def config_with_sections(model: str, kinds: list[str], strong: str, weak: str) -> dict:
    """A plugin config whose ``decode_kernel`` is set in each section kind of ``kinds`` (of
    :data:`CONFIG_SECTIONS`): ``strong`` in the most specific of them, ``weak`` in every other one.
    The glob section matches ``model``'s parent directory; the architecture section is GLM-5's."""
    strongest = max(kinds, key=CONFIG_SECTIONS.index)
    value = {kind: strong if kind == strongest else weak for kind in kinds}
    data: dict = {}
    if "top" in value:
        data["decode_kernel"] = value["top"]
    if "arch" in value:
        data["architectures"] = {"GlmMoeDsaForCausalLM": {"decode_kernel": value["arch"]}}
    models = {}
    if "glob" in value:
        models[model.rsplit("/", 1)[0] + "/*"] = {"decode_kernel": value["glob"]}
    if "exact" in value:
        models[model] = {"decode_kernel": value["exact"]}
    if models:
        data["models"] = models
    return data
