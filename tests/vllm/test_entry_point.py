"""The vllm.general_plugins entry point, loaded by vLLM's own plugin loader in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.cli import clean_env

from mla_sm120_plugin.integration.vllm.names import BACKEND_PATH

PROBE = """
import json, logging
logging.basicConfig(level=logging.WARNING)
{pre}
from vllm.plugins import load_general_plugins
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
load_general_plugins()
load_general_plugins()  # vLLM may call it again; must stay a no-op
{post}
import sys
imported = sorted(m for m in sys.modules if m.startswith(("vllm.models.deepseek_v4", "vllm.models.deepseek_v41")))
import vllm.models.deepseek_v4.nvidia.model as v4, vllm.models.deepseek_v41.nvidia.model as v41
print(json.dumps({{"overridden": E.CUSTOM.is_overridden(),
                   "path": E.CUSTOM.get_path() if E.CUSTOM.is_overridden() else None,
                   "dsv4_imported_by_plugins": imported,
                   "dsv4_selector_wrapped": [getattr(m._select_dsv4_attn_cls, "_mla_sm120", False) for m in (v4, v41)]}}))
"""


REPEAT = "from mla_sm120_plugin.integration.vllm import register\nregister()  # direct repeat calls too"


def _run(env_extra: dict[str, str], pre: str = "", post: str = REPEAT) -> tuple[dict, str]:
    env = clean_env(VLLM_LOGGING_LEVEL="WARNING", **env_extra)
    res = subprocess.run([sys.executable, "-c", PROBE.format(pre=pre, post=post)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def test_load_general_plugins_registers_custom():
    """And wraps DeepSeek-V4's class choice in V4 and V4.1 when vLLM imports them, importing neither itself."""
    out, _ = _run({})
    assert out == {"overridden": True, "path": BACKEND_PATH, "dsv4_imported_by_plugins": [],
                   "dsv4_selector_wrapped": [True, True]}


def test_vllm_plugins_excluding_us_leaves_custom_unregistered():
    out, _ = _run({"VLLM_PLUGINS": "some_other_plugin"}, post="")
    assert out == {"overridden": False, "path": None, "dsv4_imported_by_plugins": [],
                   "dsv4_selector_wrapped": [False, False]}


def test_foreign_custom_owner_is_left_alone_and_logged_once():
    pre = ("from vllm.v1.attention.backends.registry import AttentionBackendEnum as E, register_backend\n"
           "register_backend(E.CUSTOM, 'someone.else.Backend')")
    out, err = _run({}, pre=pre)
    assert out == {"overridden": True, "path": "someone.else.Backend", "dsv4_imported_by_plugins": [],
                   "dsv4_selector_wrapped": [False, False]}
    assert err.count("already belongs to someone.else.Backend") == 1
    assert BACKEND_PATH in err


def test_backend_class_path_resolves():
    from vllm.utils.import_utils import resolve_obj_by_qualname

    cls = resolve_obj_by_qualname(BACKEND_PATH)
    assert cls.get_name() == "MLA_SM120_SPARSE" and cls.is_sparse() and cls.is_mla()


def test_a_faulty_third_party_hook_does_not_break_vllms_plugin_loading(demo_plugin_path):
    # The demo distribution's mla_sm120_select raises: vLLM still starts its plugins (register()
    # loads no mla_sm120 plugin); the fault surfaces, named, only when the backend decides.
    from support.cli import demo_plugins_except

    post = REPEAT + ("\nfrom mla_sm120_plugin.device import parse_device\n"
                     "from mla_sm120_plugin.selection import select\n"
                     "from mla_sm120_plugin.types import SelectionContext\n"
                     "try:\n"
                     "    select(SelectionContext('GlmMoeDsaForCausalLM', 'fp8_ds_mla', 8, 2048,"
                     " parse_device('12.0', source='--sm')))\n"
                     "except Exception as exc:\n"
                     "    print(type(exc).__name__, str(exc).splitlines()[0])\n")
    env = clean_env(VLLM_LOGGING_LEVEL="WARNING", **demo_plugins_except("demo_select_raises"))
    env["PYTHONPATH"] = os.pathsep.join([str(demo_plugin_path), env["PYTHONPATH"]])
    res = subprocess.run([sys.executable, "-c", PROBE.format(pre="", post=post)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    *before, last = res.stdout.strip().splitlines()
    assert json.loads(last) == {"overridden": True, "path": BACKEND_PATH, "dsv4_imported_by_plugins": [],
                                "dsv4_selector_wrapped": [True, True]}
    assert any(line.startswith("PluginError given: plugin mla-sm120-demo 0.1.0") and "mla_sm120_select" in line
               for line in before), res.stdout


def test_an_unsupported_vllm_release_is_refused_at_register_with_nothing_applied(tmp_path):
    """A vLLM whose metadata says 0.32.0 (a dist-info ahead of the real one on sys.path: what
    importlib.metadata, and so the plugin, reads as the installed release): register() logs given /
    supported / fix once and neither registers CUSTOM nor wraps DeepSeek-V4's class choice."""
    meta = tmp_path / "vllm-0.32.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out, err = _run(env)
    assert out == {"overridden": False, "path": None, "dsv4_imported_by_plugins": [],
                   "dsv4_selector_wrapped": [False, False]}
    assert err.count("not registering the CUSTOM attention backend: given: vLLM 0.32.0; supported: vLLM 0.33.0 or "
                     "0.34.0") == 1, err[-2000:]
    assert 'fix: pip install "mla-sm120-plugin[vllm]" (vLLM 0.33.0); or pip install "mla-sm120-plugin[vllm034]"' in err
