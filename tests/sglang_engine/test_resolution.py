"""SGLang's DSA backend resolution with the plugin: decided in the launcher, before any weight loads."""

from __future__ import annotations

import logging

import pytest
from support.cli import run_cli
from support.model_configs import write_model
from support.sglang_launch import launch, resolve, server_args
from sglang.srt.arg_groups import overrides

from mla_sm120_plugin.context import context_from_json
from mla_sm120_plugin.errors import MlaSm120Error, UnsupportedConfiguration
from mla_sm120_plugin.integration import sglang as plugin
from mla_sm120_plugin.integration.sglang import dsa, dsv4, flags, hooks, install, names, translate  # noqa: F401
from mla_sm120_plugin.dispatch.catalog import FLASHINFER, TORCH, TRITON, TRITON_FAST


def SGLANG_ALONE(view):  # noqa: N802 - reads as the name of SGLang's own pass
    """SGLang's own pass, unwrapped from the hook (installed by the session's load_plugins())."""
    return overrides._dsa_split_backend_resolution.__wrapped__(view)


def _alone(model_dir: str, **kw) -> dict:
    sa = server_args(model_dir, **kw)
    return SGLANG_ALONE(overrides.ResolvedView(sa, overlay=overrides._declaration_overlay(sa)))


def test_sglangs_call_site_runs_the_hooked_pass():
    from sglang.srt.arg_groups import model_hook

    assert model_hook._dsa_split_backend_resolution is overrides._dsa_split_backend_resolution
    assert hooks.missing(install.engine_targets()) == []


@pytest.mark.parametrize("cap", [(12, 0), (12, 1)])
def test_glm5_on_sm12x_fp8_is_decided_by_the_plugin(tmp_path, capability, caplog, monkeypatch, cap):
    capability(*cap)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    caplog.set_level(logging.WARNING, logger="mla_sm120_plugin")
    assert resolve(write_model(tmp_path, "glm"), kv_cache_dtype="fp8_e4m3") == (dsa.ROUTE, dsa.ROUTE)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mla_sm120: model=")]
    assert f"sm_{cap[0]}{cap[1]}" in line
    from support.kernel_checks import flashinfer_refusal_here

    refusal = flashinfer_refusal_here()
    if refusal is not None:  # FlashInfer's probe runs on this machine's GPU (or lack of one)
        assert f"prefill={TRITON_FAST} decode={TRITON_FAST}" in line
        assert f"{FLASHINFER}/decode: " in line and refusal in line.split(f"{FLASHINFER}/decode: ")[1]
    ctx = translate.imported("plan", "a test")[dsa.KIND]
    assert (ctx.kv_cache_dtype, ctx.num_heads, ctx.kv_scale_format, ctx.device.source) == (
        "fp8_ds_mla", 64, "arbitrary", "sglang")


def test_sm90_is_refused_with_the_text_check_prints(tmp_path, capability):
    capability(9, 0)
    model = write_model(tmp_path, "glm")
    with pytest.raises(UnsupportedConfiguration) as err:
        resolve(model, kv_cache_dtype="fp8_e4m3")
    res = run_cli("check", "--engine", "sglang", "--model", model, "--sm", "9.0", "--kv-cache-dtype", "fp8_e4m3")
    assert res.returncode == 2
    cli_message = res.stderr.split("UnsupportedConfiguration: ", 1)[1].rstrip("\n")
    assert cli_message == str(err.value)
    # In SGLang's words: its spelling of the cache, its opt-in flag, its own backends.
    assert "kv_cache_dtype=fp8_e4m3 (fp8_ds_mla layout)" in cli_message.splitlines()[0]
    assert "device sm_90: this plugin serves SM12x only" in cli_message
    assert "drop --mla-sm120;" in cli_message and "--attention-backend" not in cli_message
    assert "flashmla_sparse" in cli_message and "FLASHMLA_SPARSE" not in cli_message


def test_the_seeds_flashmla_kv_is_refused_before_weights_and_served_without_it(tmp_path, capability, monkeypatch):
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = write_model(tmp_path, "glm")
    # SGLang alone accepts it here and refuses only when the DSA backend is built, after weights.
    assert _alone(model, kv_cache_dtype="fp8_e4m3", dsa_decode_backend="flashmla_kv") == {
        "dsa_prefill_backend": FLASHINFER}
    with pytest.raises(UnsupportedConfiguration) as err:
        resolve(model, kv_cache_dtype="fp8_e4m3", dsa_decode_backend="flashmla_kv")
    msg = str(err.value)
    assert "flashmla_kv is another engine's impl" in msg and f"decode can run: {TRITON}" in msg
    assert resolve(model, kv_cache_dtype="fp8_e4m3") == (dsa.ROUTE, dsa.ROUTE)


def test_deepseek_v32_on_sm120_is_served(tmp_path, capability, monkeypatch):
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = write_model(tmp_path, "dsv32")
    # SGLang alone sends it to trtllm on SM120: a kernel that does not run on SM12x.
    assert _alone(model, kv_cache_dtype="fp8_e4m3") == {"dsa_prefill_backend": "trtllm", "dsa_decode_backend": "trtllm"}
    assert resolve(model, kv_cache_dtype="fp8_e4m3", tp_size=8) == (dsa.ROUTE, dsa.ROUTE)
    ctx = translate.imported("plan", "a test")[dsa.KIND]
    # SGLang writes amax/448 scales for every model: the engine's fact beats the profile's pow2.
    assert (ctx.model_arch, ctx.num_heads, ctx.kv_scale_format) == ("DeepseekV32ForCausalLM", 16, "arbitrary")


def test_bf16_cache_and_forced_kernels(tmp_path, capability, monkeypatch):
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = write_model(tmp_path, "glm", index_topk=1000)  # any top-k
    assert resolve(model, kv_cache_dtype="bfloat16") == (dsa.ROUTE, dsa.ROUTE)
    # The plugin's settings through --mla-sm120-config; SGLang's own flag names the kernel too.
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, f'{{"prefill_kernel": "{TORCH}"}}')
    monkeypatch.delenv(names.PLAN_ENV)
    assert resolve(model, kv_cache_dtype="bfloat16", dsa_decode_backend=TRITON) == (dsa.ROUTE, dsa.ROUTE)
    ctx = translate.imported("plan", "a test")[dsa.KIND]
    assert (ctx.prefill_kernel, ctx.decode_kernel, ctx.kv_cache_dtype, ctx.index_topk) == (TORCH, TRITON, "bf16", 1000)


def test_what_the_kernels_cannot_read_is_refused(tmp_path, capability, monkeypatch):
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(UnsupportedConfiguration, match="hisparse is on"):
        resolve(write_model(tmp_path, "glm"), kv_cache_dtype="fp8_e4m3", enable_hisparse=True)


def _sglang_alone(monkeypatch) -> None:
    monkeypatch.setenv(names.ENABLE_ENV, "0")
    monkeypatch.delenv(names.PLAN_ENV, raising=False)


def test_dcp_on_sm12x_resolves_to_the_plugins_kernels_not_trtllm(tmp_path, capability, monkeypatch):
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = write_model(tmp_path, "glm", heads=16)
    # SGLang's launcher: its DSA DCP override declares trtllm (SM100 kernels), then the plugin's pass decides.
    assert launch(model, tp_size=2, dcp_size=2, kv_cache_dtype="fp8_e4m3") == (dsa.ROUTE, dsa.ROUTE, "fp8_e4m3")
    ctx = translate.imported("plan", "a test")[dsa.KIND]
    assert (ctx.decode_context_parallel_size, ctx.heads_per_rank, ctx.num_heads) == (2, 8, 16)  # gathered heads
    _sglang_alone(monkeypatch)  # without the opt-in SGLang's own overrides are unchanged
    assert launch(model, tp_size=2, dcp_size=2, kv_cache_dtype="fp8_e4m3")[:2] == ("trtllm", "trtllm")


def test_hy_v4_under_dcp_is_served_with_the_opt_in_and_refused_by_sglang_without(tmp_path, capability, monkeypatch):
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = write_model(tmp_path, "hyv4", heads=16, layer_types=["deepseek_sparse_attention"] * 2)
    assert launch(model, tp_size=2, dcp_size=2) == (dsa.ROUTE, dsa.ROUTE, "bfloat16")  # SGLang's forced bf16
    ctx = translate.imported("plan", "a test")[dsa.KIND]
    assert ctx.sinks and ctx.decode_context_parallel_size == 2 and ctx.kv_cache_dtype == "bf16"
    _sglang_alone(monkeypatch)
    with pytest.raises(ValueError, match="does not provide single-owner semantics for learnable attention sinks"):
        launch(model, tp_size=2, dcp_size=2)


@pytest.mark.parametrize("kind", ["glm", "hyv4"])
@pytest.mark.parametrize("setting, words", [
    (dict(enable_hierarchical_cache=True), "DSA DCP does not support HiSparse or HiCache."),
    (dict(speculative_eagle_topk=2), "DSA DCP requires --speculative-eagle-topk 1."),
])
def test_sglangs_own_dcp_refusals_stand_with_the_opt_in(tmp_path, capability, monkeypatch, kind, setting, words):
    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # HY V4's too: the plugin lifts only SGLang's sink refusal and keeps its DSA DCP checks. SGLang's own
    # error, from its model overrides, before the plugin's plan (which refuses the same, in SGLang's words,
    # for `mla-sm120 check`).
    model = write_model(tmp_path, kind, heads=16, **({"layer_types": ["deepseek_sparse_attention"] * 2}
                                                       if kind == "hyv4" else {}))
    with pytest.raises(ValueError, match=words.replace(".", r"\.")) as err:
        launch(model, tp_size=2, dcp_size=2, **setting)
    assert not isinstance(err.value, MlaSm120Error)


def test_a_call_at_another_dcp_size_than_planned_is_refused(tmp_path, capability, monkeypatch):
    import types

    import torch

    from mla_sm120_plugin.errors import KernelInputError

    capability(12, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(names.INLINE_CONFIG_ENV, f'{{"prefill_kernel": "{TORCH}", "decode_kernel": "{TRITON}"}}')
    launch(write_model(tmp_path, "glm", heads=16), tp_size=2, dcp_size=2, kv_cache_dtype="bfloat16",
           disable_cuda_graph=True)
    q, cache = torch.zeros(1, 16, 576, dtype=torch.bfloat16), torch.zeros(64, 1, 576, dtype=torch.bfloat16)

    def call(*_args, **_kwargs):
        return dsa.around_call(None, q, cache, torch.zeros(1, 64, dtype=torch.int32), None, sm_scale=0.04)

    backend = types.SimpleNamespace(dcp_size=1, dcp_rank=0)  # SGLang's backend, built without DCP
    with pytest.raises(KernelInputError, match="a call at dcp_size=1 .* for a plan at --dcp-size 2"):
        dsa.around_forward_decode(call, backend, q, None, None, types.SimpleNamespace(layer_id=0),
                                  types.SimpleNamespace())


def test_skip_softmax_is_refused(tmp_path, capability, monkeypatch):
    capability(12, 0)
    monkeypatch.setenv("SGLANG_SKIP_SOFTMAX_DECODE_THRESHOLD_SCALE_FACTOR", "0.5")
    with pytest.raises(UnsupportedConfiguration, match="skip_softmax is on"):
        resolve(write_model(tmp_path, "glm"), kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("kind, kw", [("glm", dict(kv_cache_dtype="fp8_e4m3")), ("dsv32", dict(kv_cache_dtype="fp8_e4m3")),
                                      ("glm", dict(kv_cache_dtype="bfloat16")),
                                      ("glm", dict(kv_cache_dtype="fp8_e4m3", dsa_decode_backend="flashmla_kv"))])
@pytest.mark.parametrize("cap", [(12, 0), (9, 0)])
def test_without_the_opt_in_resolution_is_sglangs(tmp_path, capability, monkeypatch, kind, kw, cap):
    capability(*cap)
    monkeypatch.delenv(names.ENABLE_ENV)
    model = write_model(tmp_path, kind)
    sa = server_args(model, **kw)
    view = overrides.ResolvedView(sa, overlay=overrides._declaration_overlay(sa))
    assert overrides._dsa_split_backend_resolution(view) == SGLANG_ALONE(view)
    assert names.PLAN_ENV not in __import__("os").environ


def test_check_and_sglang_build_the_same_context(tmp_path, capability, monkeypatch):
    from mla_sm120_plugin.context import EngineLimits, plugin_config
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.hooks.manager import get_registry
    from mla_sm120_plugin.modelinfo import resolve_model
    from mla_sm120_plugin.plan import plan

    capability(12, 1)
    model = write_model(tmp_path, "dsv32", index_topk=1024)
    sa = server_args(model, kv_cache_dtype="fp8_e4m3", tp_size=8, chunked_prefill_size=4096,
                      max_running_requests=16, disable_cuda_graph=True)
    view = overrides.ResolvedView(sa, overlay=overrides._declaration_overlay(sa))
    from_sglang = translate.plan_from_sglang(view, overrides.model_config_of(view).hf_config, (12, 1)).decision.context
    # What `mla-sm120 check --engine sglang --model <dir> --sm 12.1 --tp 8 --kv-cache-dtype fp8_e4m3
    # --max-decode-tokens 16 --max-prefill-tokens 4096 --enforce-eager` builds.
    reg = get_registry()
    facts = resolve_model(model, registry=reg)
    from_check = plan(facts, plugin_config(None, kernel_names=reg.kernels).for_model(facts.name, facts.arch),
                      parse_device("12.1", source="--sm"), "fp8_e4m3",
                      EngineLimits(tensor_parallel_size=8, max_decode_tokens=16, max_prefill_tokens=4096,
                                   cuda_graphs=False, engine="sglang")).decision.context
    differ = {f for f in from_check.__dataclass_fields__ if getattr(from_check, f) != getattr(from_sglang, f)}
    assert differ == {"device"}, differ  # where the device came from: planned (--sm) or SGLang's GPU
    assert from_sglang.device.sm == from_check.device.sm == "12.1"
    assert (from_sglang.kv_scale_format, from_sglang.num_heads, from_sglang.index_topk) == ("arbitrary", 16, 1024)


@pytest.mark.parametrize("cap", [(8, 9), (9, 0), (10, 0), (12, 0), (12, 1)])
def test_auto_means_what_sglang_resolves_it_to(tmp_path, capability, cap):
    """SGLang turns --kv-cache-dtype auto into fp8_e4m3 (SM >= 10) or bfloat16 for DSA models before
    any hook sees it; the plugin's reading of auto (check --engine sglang) is the same."""
    from mla_sm120_plugin.engines import SGLANG

    capability(*cap)
    sa = server_args(write_model(tmp_path, "glm"), kv_cache_dtype="auto")
    view = overrides.ResolvedView(sa, overlay=overrides._declaration_overlay(sa))
    sglang_says = overrides._dsa_kv_cache_dtype_default(view).get("kv_cache_dtype", "auto")
    assert SGLANG.kv_layout("auto", cap[0]) == SGLANG.kv_layout(sglang_says, cap[0])


def test_check_plans_auto_as_sglang_does(tmp_path):
    import json

    model = write_model(tmp_path, "glm")
    for sm, layout_ in (("12.0", "fp8_ds_mla"), ("12.1", "fp8_ds_mla")):
        res = run_cli("check", "--engine", "sglang", "--model", model, "--sm", sm, "--kv-cache-dtype", "auto", "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["kv_cache"]["name"] == layout_
    # vLLM's auto with the CUSTOM backend stays the model's bf16.
    res = run_cli("check", "--model", model, "--sm", "12.0", "--kv-cache-dtype", "auto", "--json")
    assert json.loads(res.stdout)["kv_cache"]["name"] == "bf16"


def test_check_speaks_sglang_for_a_model_it_does_not_serve(tmp_path):
    res = run_cli("check", "--engine", "sglang", "--model", write_model(tmp_path, "llama"), "--sm", "12.0")
    assert res.returncode == 2
    assert "serve this model without --mla-sm120" in res.stderr and "--attention-backend" not in res.stderr
    res = run_cli("check", "--engine", "sglang", "--model", "glm-5", "--sm", "12.0", "--kv-cache-dtype", "fp8_e5m2")
    assert res.returncode == 2
    assert "kv_cache_dtype fp8_e5m2: no kernel reads" in res.stderr
    assert "fix: pass --kv-cache-dtype fp8_e4m3" in res.stderr and "fp8_ds_mla" not in res.stderr.split("fix:")[1]


SCHEDULER_PROBE = """
import multiprocessing, sys, torch


def scheduler(model_path):
    # A spawned child, as SGLang starts its schedulers: plugins loaded afresh, the launcher's
    # environment inherited, SGLang's logging configured first (run_scheduler_process).
    import torch
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.common import configure_logger
    torch.cuda.get_device_capability = lambda *a, **k: (12, 0)
    sa = ServerArgs(model_path=model_path, skip_tokenizer_init=True, kv_cache_dtype="bfloat16", disable_cuda_graph=True)
    configure_logger(sa, prefix=" TP0")
    from sglang.kernels.ops.attention import flash_mla_sm120
    flash_mla_sm120._validate_flashinfer_sparse_mla_backend(
        model_arch="GlmMoeDsaForCausalLM", device_sm_major=12, kv_cache_dtype=torch.bfloat16,
        prefill_impl="flashinfer_sparse_mla", decode_impl="flashinfer_sparse_mla")


if __name__ == "__main__":
    torch.cuda.get_device_capability = lambda *a, **k: (12, 0)  # the GPU this CPU stands in for
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.arg_groups import overrides
    from sglang.srt.server_args import ServerArgs
    sa = ServerArgs(model_path=sys.argv[1], skip_tokenizer_init=True, kv_cache_dtype="bfloat16", disable_cuda_graph=True)
    overrides.run_post_process_pass(sa, overrides._dsa_split_backend_resolution)  # the launcher decides
    child = multiprocessing.get_context("spawn").Process(target=scheduler, args=(sys.argv[1],))
    child.start()
    child.join()
    sys.exit(child.exitcode)
"""


def test_a_fresh_scheduler_shows_both_lines_with_sglangs_logging(tmp_path):
    import subprocess
    import sys

    from support.cli import clean_env

    model = write_model(tmp_path, "glm", index_topk=100, heads=5)
    probe = tmp_path / "launcher.py"  # a file: spawned children re-import their parent's main module
    probe.write_text(SCHEDULER_PROBE)
    res = subprocess.run([sys.executable, str(probe), model], capture_output=True, text=True,
                         timeout=600, env=clean_env(MLA_SM120_SGLANG="1", TRITON_INTERPRET="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    console = (res.stdout + res.stderr).splitlines()
    scheduler = [line for line in console if line.startswith("[") and " TP0]" in line]
    assert any("mla_sm120: model=" in line for line in scheduler), console[-20:]
    assert any("mla_sm120: self-check: decode=" in line for line in scheduler), console[-20:]
