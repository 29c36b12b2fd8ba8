"""Discovery through SGLang's own loader, the opt-in flag on SGLang's own parser, in fresh processes."""

from __future__ import annotations

import json
import subprocess
import sys

from support.cli import clean_env

from mla_sm120_plugin.integration import sglang as plugin
from mla_sm120_plugin.integration.sglang import dsa, dsv4, flags, hooks, install, names, translate  # noqa: F401

HOOKS_BY_PLUGIN = """
import json
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
ours = sorted(t for t, hs in HookRegistry._hooks.items() for _, _, src in hs if src and src.plugin_name == "mla_sm120")
from mla_sm120_plugin.integration.sglang import dsa, dsv4, flags, hooks, install, names, translate  # noqa: F401
print(json.dumps({"targets": ours, "missing": hooks.missing(install.engine_targets())}))
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = clean_env(**env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=600)


def _last_json(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_installed_not_enabled_adds_only_its_flags():
    out = _last_json(_run(HOOKS_BY_PLUGIN))
    assert out["targets"] == [flags.ADD_CLI_ARGS]
    assert sorted(out["missing"]) == sorted(install.engine_targets())  # SGLang's resolution and call site untouched


def test_enabled_by_environment_hooks_every_target():
    out = _last_json(_run(HOOKS_BY_PLUGIN, **{names.ENABLE_ENV: "1"}))
    assert out["targets"] == sorted([flags.ADD_CLI_ARGS, *install.engine_targets()])
    assert out["missing"] == []


def test_sglang_plugins_allowlist_leaves_it_out():
    out = _last_json(_run(HOOKS_BY_PLUGIN, SGLANG_PLUGINS="smg-servicer", **{names.ENABLE_ENV: "1"}))
    assert out["targets"] == []


PARSE = """
import argparse, json, os, sys
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs
load_plugins()
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
args = parser.parse_args(["--model-path", "m"] + sys.argv[1:])
from mla_sm120_plugin.integration.sglang import dsa, dsv4, flags, hooks, install, names, translate  # noqa: F401
print(json.dumps({"enabled": os.environ.get("MLA_SM120_SGLANG"), "config": os.environ.get("MLA_SM120_SGLANG_CONFIG"),
                  "missing": hooks.missing(install.engine_targets())}))
"""


def test_flag_on_sglangs_parser_enables_and_hooks_this_process():
    config = '{"decode_kernel": "triton_sparse_mla"}'
    out = _last_json(_run(PARSE.replace("sys.argv[1:]", repr([names.FLAG, names.CONFIG_FLAG, config]))))
    assert out == {"enabled": "1", "config": config, "missing": []}
    # Without the flag nothing is hooked and nothing exported.
    out = _last_json(_run(PARSE.replace("sys.argv[1:]", "[]")))
    assert out["enabled"] is None and sorted(out["missing"]) == sorted(install.engine_targets())


def test_config_flag_refuses_what_is_not_a_json_object():
    done = _run(PARSE.replace("sys.argv[1:]", repr([names.FLAG, names.CONFIG_FLAG, "[1, 2]"])))
    assert done.returncode == 2
    assert "--mla-sm120-config: '[1, 2]' is not a JSON object" in done.stderr
    done = _run(PARSE.replace("sys.argv[1:]", repr([names.CONFIG_FLAG, "{oops"])))
    assert done.returncode == 2 and "not JSON" in done.stderr


ANOTHER_RELEASE = ("import importlib.metadata as md, logging\n"
                   "real = md.version\n"
                   "md.version = lambda name: '0.5.99' if name == 'sglang' else real(name)\n"
                   "logging.basicConfig(level=logging.WARNING)\n")


def test_another_sglang_release_is_refused_as_vllms_is():
    """engines.release_refusal, SGLang's as vLLM's: under a release the hooks were not read from, the
    plugin logs the refusal once and hooks nothing but its flags, and ``--mla-sm120`` stops the launch."""
    from mla_sm120_plugin.engines import release_refusal

    refusal = release_refusal("sglang", "0.5.99", f"serve without {names.FLAG}")
    done = _run(ANOTHER_RELEASE + HOOKS_BY_PLUGIN, **{names.ENABLE_ENV: "1"})
    out = _last_json(done)
    assert out["targets"] == [flags.ADD_CLI_ARGS]  # the flags only, though enabled
    assert done.stderr.count("mla_sm120: not hooking SGLang: ") == 1
    assert f"mla_sm120: not hooking SGLang: {refusal.replace(chr(10), '; ')}" in done.stderr
    assert "given: SGLang 0.5.99; supported: SGLang 0.5.23" in done.stderr
    parsed = _run(ANOTHER_RELEASE + PARSE.replace("sys.argv[1:]", repr([names.FLAG])))
    assert parsed.returncode == 2 and refusal.splitlines()[0] in parsed.stderr
    assert "fix: serve without --mla-sm120; or pip install" in parsed.stderr
    # The supported release: nothing said, every hook in place.
    done = _run(HOOKS_BY_PLUGIN, **{names.ENABLE_ENV: "1"})
    assert "not hooking" not in done.stderr and _last_json(done)["missing"] == []


def test_register_is_idempotent_and_quiet():
    from sglang.srt.plugins.hook_registry import HookRegistry

    def ours() -> int:
        return sum(1 for hs in HookRegistry._hooks.values() for _, _, src in hs if src and src.plugin_name == "mla_sm120")

    before = ours()
    plugin.register()  # SGLang's loader already called it in this process
    assert ours() == before and "failed" not in plugin._state
