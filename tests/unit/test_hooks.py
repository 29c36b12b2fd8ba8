"""The hooks (``hooks/manager.py``, ``hooks/specs.py``): built-ins and a pip-installed third-party
plugin, loaded alike, and each hook spec typed, documented and asked as documented."""

from __future__ import annotations

import json

import pytest

from mla_sm120_plugin.errors import PluginError
from mla_sm120_plugin.hooks import hookimpl
from mla_sm120_plugin.hooks.manager import BUILTIN_PLUGINS, DISABLE_ENV, build_registry
from mla_sm120_plugin.dispatch.catalog import BUILTIN_KERNELS, TORCH
from mla_sm120_plugin.types import KernelSpec, ModelProfile

from support.cli import DEMO_BROKEN as BROKEN
from support.cli import DEMO_FAULTY_HOOKS as FAULTY_HOOKS
from support.cli import demo_plugins_except as _block_except
from support.cli import decision_of, run_cli
from support.decisions import _edge_ctx


def test_builtins_register_through_the_hooks():
    reg = build_registry(load_entry_points=False)
    assert list(reg.kernels) == list(BUILTIN_KERNELS)
    assert {"glm-5", "deepseek-v3.2"} <= set(reg.profiles)
    for arch in ("GlmMoeDsaForCausalLM", "GlmMoeDsaForCausalLMNextN", "DeepseekV32ForCausalLM"):
        assert arch in reg.by_arch
    assert set(BUILTIN_PLUGINS) <= set(reg.plugins)
    assert reg.profiles["glm-5"].kv_scale_format == "arbitrary"
    assert reg.profiles["deepseek-v3.2"].kv_scale_format == "pow2"


def test_builtin_plugin_can_be_blocked(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "mla_sm120.kernels")
    reg = build_registry(load_entry_points=False)
    assert reg.kernels == {}
    assert reg.blocked == ("mla_sm120.kernels",)


class _WrongType:
    @hookimpl
    def mla_sm120_model_profiles(self):
        return ["not a profile"]


class _Raises:
    @hookimpl
    def mla_sm120_kernels(self):
        raise RuntimeError("boom")


class _Dup:
    @hookimpl
    def mla_sm120_model_profiles(self):
        yield ModelProfile(
            name="glm-again", architectures=("GlmMoeDsaForCausalLM",), model_type="x",
            num_heads=8, index_topk=64, kv_scale_format="pow2",
        )


@pytest.mark.parametrize(
    "plugin, needles",
    [
        (_WrongType(), ["wrongtype", "mla_sm120_model_profiles", "returned str", "ModelProfile"]),
        (_Raises(), ["raises", "mla_sm120_kernels", "RuntimeError: boom"]),
        (_Dup(), ["GlmMoeDsaForCausalLM", "registered twice", "builtin (mla_sm120_plugin.profiles)", "dup"]),
    ],
)
def test_broken_plugins_give_one_named_error(plugin, needles):
    name = type(plugin).__name__.strip("_").lower()
    with pytest.raises(PluginError) as err:
        build_registry(load_entry_points=False, extra_plugins={name: plugin})
    for needle in needles:
        assert needle in str(err.value)


def test_plugin_objects_validate_themselves():
    with pytest.raises(PluginError, match="kv_cache_dtypes"):
        KernelSpec(name="k", phases={"decode"}, kv_cache_dtypes={"fp8"}, vendors={"nvidia"}, priority=1, entry="a:b")
    with pytest.raises(PluginError, match="phases"):
        KernelSpec(name="k", phases="decode", kv_cache_dtypes={"bf16"}, vendors={"nvidia"}, priority=1, entry="a:b")
    with pytest.raises(PluginError, match="entry"):
        KernelSpec(name="k", phases={"decode"}, kv_cache_dtypes={"bf16"}, vendors={"nvidia"}, priority=1, entry="a.b")
    with pytest.raises(PluginError, match="kv_scale_format"):
        ModelProfile(name="m", architectures=("A",), model_type="m", num_heads=1, index_topk=1, kv_scale_format="e8m0")


# --- a third-party distribution, pip-installed into its own directory -----------------


def test_third_party_kernel_is_selected_where_its_envelope_fits(demo_plugin_path):
    # TP16 puts 4 GLM-5 heads on each GPU: the demo kernel's only shape, so it wins decode.
    res = run_cli("check", "--model", "glm-5", "--sm", "12.0", "--tp", "16", "--json",
                  env=_block_except(), pythonpath=demo_plugin_path)
    assert res.returncode == 0, res.stderr
    data = decision_of(json.loads(res.stdout))
    assert data["kernels"]["decode"] == "demo_sparse_mla"
    assert data["kernels"]["prefill"] != "demo_sparse_mla"  # decode-only kernel
    # TP1: 64 heads, outside its envelope; it is rejected with the reason.
    res = run_cli("check", "--model", "glm-5", "--sm", "12.0", "--json", env=_block_except(), pythonpath=demo_plugin_path)
    data = decision_of(json.loads(res.stdout))
    assert data["kernels"]["decode"] != "demo_sparse_mla"
    reasons = [r["reasons"] for r in data["rejected"] if r["kernel"] == "demo_sparse_mla" and r["phase"] == "decode"]
    assert reasons == [["heads per rank 64 outside [4, 4]"]]


def test_third_party_profile_is_served(demo_plugin_path):
    res = run_cli("check", "--model", "demo-dsa", "--sm", "12.1", "--json", env=_block_except(), pythonpath=demo_plugin_path)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["model_arch"] == "DemoDsaForCausalLM" and data["family"] == "dsa"
    assert decision_of(data)["index_topk"] == 512 and decision_of(data)["scale_format"] == "pow2"


def test_doctor_lists_the_third_party_plugin(demo_plugin_path):
    res = run_cli("doctor", "--json", env=_block_except(), pythonpath=demo_plugin_path)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert "mla-sm120-demo 0.1.0" in data["plugins"]["demo"]
    kernels = {k["name"]: k for k in data["kernels"]}
    assert "mla-sm120-demo" in kernels["demo_sparse_mla"]["provider"]
    assert "demo-dsa" in [p["name"] for p in data["model_profiles"]]
    assert sorted(data["blocked_plugins"]) == sorted(BROKEN)


@pytest.mark.parametrize(
    "broken, needles",
    [
        ("demo_broken_import", ["mla-sm120-demo 0.1.0", "demo_broken_import", "failed to import", "ModuleNotFoundError"]),
        ("demo_wrong_type", ["mla-sm120-demo 0.1.0", "mla_sm120_kernels", "returned dict", "KernelSpec"]),
        ("demo_duplicate", ["triton_sparse_mla", "registered twice", "builtin", "mla-sm120-demo 0.1.0"]),
    ],
)
def test_broken_third_party_plugin_yields_named_error(demo_plugin_path, broken, needles):
    res = run_cli("check", "--model", "glm-5", "--sm", "12.0", env=_block_except(broken), pythonpath=demo_plugin_path)
    assert res.returncode == 2
    assert "PluginError" in res.stderr
    for needle in needles:
        assert needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("broken", list(FAULTY_HOOKS) + ["demo_exits_on_import"])
def test_faulty_hook_is_one_error_naming_distribution_and_hook(demo_plugin_path, broken):
    needles = FAULTY_HOOKS.get(broken, ["failed to import: SystemExit: 3"])
    res = run_cli("check", "--model", "glm-5", "--sm", "12.0", env=_block_except(broken), pythonpath=demo_plugin_path)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "PluginError" in res.stderr and "Traceback" not in res.stderr
    for needle in [*needles, "mla-sm120-demo 0.1.0", f"{DISABLE_ENV}={broken}"]:
        assert needle in res.stderr, res.stderr
    # doctor finds the same fault by calling the hooks once, and exits 2.
    res = run_cli("doctor", "--json", env=_block_except(broken), pythonpath=demo_plugin_path)
    assert res.returncode == 2, res.stderr
    faults = json.loads(res.stdout)["faults"]
    assert len(faults) == 1 and needles[0] in faults[0], faults


def test_doctor_reports_import_time_and_flags_a_slow_plugin(demo_plugin_path):
    res = run_cli("doctor", "--json", env=_block_except("demo_slow_import"), pythonpath=demo_plugin_path)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["slow_plugins"] == ["demo_slow_import"]
    assert data["plugin_import_seconds"]["demo_slow_import"] >= 1.0
    assert data["plugin_import_seconds"]["demo"] < 1.0 and data["faults"] == []
    res = run_cli("doctor", env=_block_except("demo_slow_import"), pythonpath=demo_plugin_path)
    assert "SLOW" in next(line for line in res.stdout.splitlines() if "demo_slow_import" in line)


def test_every_hookspec_is_typed_and_documented():
    import inspect

    from mla_sm120_plugin.hooks import specs

    names = [n for n in dir(specs) if n.startswith("mla_sm120_")]
    assert sorted(names) == ["mla_sm120_kernels", "mla_sm120_model_profiles", "mla_sm120_select", "mla_sm120_validate"]
    for name in names:
        fn = getattr(specs, name)
        doc = inspect.getdoc(fn) or ""
        sig = inspect.signature(fn)
        assert sig.return_annotation is not inspect.Signature.empty, name
        assert ":returns:" in doc, name
        for param in sig.parameters:
            assert f":param {param}:" in doc, (name, param)
            assert sig.parameters[param].annotation is not inspect.Parameter.empty, (name, param)
        firstresult = fn.mla_sm120_spec["firstresult"]
        assert ("Stops at the first non-None result" in doc) == firstresult, name


# --- a hook as its spec documents it ------------------------------------------------------------------


def test_a_select_hook_sees_the_context_and_the_phase():
    """hooks/specs.py ``mla_sm120_select(ctx, phase, candidates)``: the policy override is asked with
    the real context and phase."""
    from mla_sm120_plugin.hooks import hookimpl
    from mla_sm120_plugin.hooks.manager import build_registry
    from mla_sm120_plugin.selection import select

    class TorchDecodesAt16Heads:
        @hookimpl
        def mla_sm120_select(self, ctx, phase, candidates):
            return TORCH if phase == "decode" and ctx.num_heads == 16 and TORCH in candidates else None

    reg = build_registry(load_entry_points=False, extra_plugins={"torch16": TorchDecodesAt16Heads()})
    d = select(_edge_ctx(heads=16, cuda_graphs=False), registry=reg)
    assert d.decode == TORCH and d.prefill != TORCH
    assert select(_edge_ctx(heads=32, cuda_graphs=False), registry=reg).decode != TORCH


def test_doctor_runs_a_third_party_hook_on_every_familys_contexts():
    """doctor plans every profile as its family shapes it, so a plugin's validate and select hooks see
    DeepSeek-V4's layer kinds as well as DSA's one context; a hook that breaks on one kind is a fault."""
    from mla_sm120_plugin import cli

    seen: dict[str, set] = {"validate": set(), "select": set()}
    broken = []

    class Spy:
        @hookimpl
        def mla_sm120_validate(self, ctx):
            seen["validate"].add((ctx.family, ctx.call.kind if ctx.call is not None else None))
            return []

        @hookimpl
        def mla_sm120_select(self, ctx, phase, candidates):
            seen["select"].add(ctx.family)
            if broken and ctx.call is not None and ctx.call.kind == "c128a":
                raise RuntimeError("spy cannot rank c128a")
            return None

    reg = build_registry(load_entry_points=False, extra_plugins={"spy": Spy()})
    assert cli._hook_faults(reg) == []
    assert {("dsa", None), ("dsv4", "c4a"), ("dsv4", "c128a"), ("dsv4", "window")} <= seen["validate"]
    assert seen["select"] == {"dsa", "dsv4"}
    broken.append(True)
    faults = cli._hook_faults(reg)
    assert len(faults) == 1 and "hook mla_sm120_select raised RuntimeError: spy cannot rank c128a" in faults[0]
