"""The constraint matrix: the seed's two rules, envelopes, probes, hooks and the CLI."""

from __future__ import annotations

import json
import re

import pytest

from helpers import assert_three_parts, run_cli
from mla_sm120_plugin.device import parse_device
from mla_sm120_plugin.errors import PluginError, UnsupportedConfiguration
from mla_sm120_plugin.hooks import hookimpl
from mla_sm120_plugin.hooks.manager import build_registry
from mla_sm120_plugin.dispatch.catalog import FLASHINFER, TORCH, TRITON
from mla_sm120_plugin.report import explain
from mla_sm120_plugin.selection import select
from mla_sm120_plugin.types import ENGINE_NATIVE_IMPLS, DeviceInfo, SelectionContext

GLM = "GlmMoeDsaForCausalLM"
DSV = "DeepseekV32ForCausalLM"


def ctx(arch=GLM, sm="12.0", kv="fp8_ds_mla", heads=64, topk=2048, **kw):
    return SelectionContext(arch, kv, heads, topk, parse_device(sm, source="--sm"), **kw)


@pytest.fixture
def reg():
    return build_registry(load_entry_points=False)


def _combination_named(msg: str, sm: str, kv: str, prefill: str, decode: str, arch: str = GLM) -> None:
    for part in (f"model_arch={arch}", f"sm={sm}", f"kv_cache_dtype={kv}", f"prefill_impl={prefill}", f"decode_impl={decode}"):
        assert part in msg, (part, msg)
    assert "supported:" in msg and "fix:" in msg


# --- rule 1: forcing flashinfer_sparse_mla where it cannot run -------------------------


@pytest.mark.parametrize(
    "arch, sm, kv, reason",
    [
        (GLM, "9.0", "fp8_ds_mla", "device sm_90: this plugin serves SM12x only"),
        (GLM, "10.0", "fp8_ds_mla", "device sm_100: this plugin serves SM12x only"),
        (GLM, "rocm", "fp8_ds_mla", "device a ROCm GPU: this plugin serves NVIDIA SM12x GPUs only"),
        (GLM, "12.0", "bf16", "reads kv_cache_dtype ['fp8_ds_mla', 'fp8_ds_mla_nope', 'fp8_nope'], not bf16"),
        (DSV, "8.9", "fp8_ds_mla", "device sm_89: this plugin serves SM12x only"),
    ],
)
def test_forced_flashinfer_outside_envelope_names_the_combination(reg, arch, sm, kv, reason):
    with pytest.raises(UnsupportedConfiguration) as err:
        select(ctx(arch, sm, kv, decode_kernel=FLASHINFER), registry=reg)
    msg = str(err.value)
    _combination_named(msg, parse_device(sm, source="x").sm, kv, "auto", FLASHINFER, arch)
    assert reason in msg


@pytest.mark.parametrize("sm", ["9.0", "10.0", "8.9"])
def test_other_nvidia_families_are_left_to_the_engine(reg, sm):
    # The policy, not an envelope: even auto (where Triton could run) is refused, naming the
    # engine's own backends; check, doctor and every engine adapter share this text.
    with pytest.raises(UnsupportedConfiguration) as err:
        select(ctx(sm=sm), registry=reg)
    msg = str(err.value)
    assert_three_parts(msg, "model_arch=")
    assert "FLASHMLA_SPARSE" in msg or "own attention backends" in msg
    assert "drop --attention-backend CUSTOM" in msg


def test_non_dsa_model_is_refused_with_the_combination(reg):
    with pytest.raises(UnsupportedConfiguration) as err:
        select(ctx("LlamaForCausalLM", prefill_kernel=FLASHINFER, decode_kernel=FLASHINFER), registry=reg)
    msg = str(err.value)
    _combination_named(msg, "12.0", "fp8_ds_mla", FLASHINFER, FLASHINFER, "LlamaForCausalLM")
    assert "not a DeepSeek-Sparse-Attention model" in msg and GLM in msg and DSV in msg


def test_plain_fp8_gets_the_exact_flag_to_pass(reg):
    with pytest.raises(UnsupportedConfiguration) as err:
        select(ctx(kv="fp8"), registry=reg)
    assert "--kv-cache-dtype fp8_ds_mla" in str(err.value)


# --- rule 2: on SM12x + fp8_ds_mla, a forced impl that cannot run lists those that can --


@pytest.mark.parametrize("impl", ENGINE_NATIVE_IMPLS)
def test_stale_engine_impl_names_list_what_can_run(reg, impl):
    with pytest.raises(UnsupportedConfiguration) as err:
        select(ctx(sm="12.1", prefill_kernel=impl), registry=reg)
    msg = str(err.value)
    _combination_named(msg, "12.1", "fp8_ds_mla", impl, "auto")
    assert "another engine's impl" in msg
    listed = re.search(r"prefill can run: (.*)", msg).group(1)
    assert FLASHINFER in listed and TRITON in listed


def test_typo_kernel_lists_known_kernels(reg):
    with pytest.raises(UnsupportedConfiguration, match=r"not a registered kernel \(known: \["):
        select(ctx(decode_kernel="flashinfer"), registry=reg)


# --- auto selection -------------------------------------------------------------------


@pytest.mark.parametrize("sm", ["12.0", "12.1", "sm_121"])
@pytest.mark.parametrize("arch", [GLM, "GlmMoeDsaForCausalLMNextN", DSV])
def test_sm12x_family_prefers_the_native_kernel(reg, sm, arch):
    d = select(ctx(arch, sm), registry=reg)
    assert d.prefill == d.decode == FLASHINFER
    assert d.notes and "planned" in d.notes[0]  # probes are not run for a device not present


def test_scale_format_follows_the_model_unless_overridden(reg):
    assert select(ctx(GLM), registry=reg).scale_format == "arbitrary"
    assert select(ctx(DSV, heads=128), registry=reg).scale_format == "pow2"
    assert select(ctx(GLM, kv_scale_format="pow2"), registry=reg).scale_format == "pow2"


def test_bf16_falls_back_to_triton(reg):
    d = select(ctx(kv="bf16"), registry=reg)
    assert d.decode == d.prefill == TRITON
    flash = [r for r in d.rejections if r.kernel == FLASHINFER and r.phase == "decode"]
    assert flash and "reads kv_cache_dtype ['fp8_ds_mla', 'fp8_ds_mla_nope', 'fp8_nope'], not bf16" in flash[0].reasons[0]


def test_reference_never_decodes_inside_cuda_graphs_on_a_gpu(reg):
    d = select(ctx(kv="bf16", cuda_graphs=True, decode_kernel="auto"), registry=reg)
    ref = [r for r in d.rejections if r.kernel == TORCH and r.phase == "decode"]
    assert "not CUDA-graph safe" in ref[0].reasons[0]
    with pytest.raises(UnsupportedConfiguration, match="not CUDA-graph safe") as err:
        select(ctx(kv="bf16", cuda_graphs=True, decode_kernel=TORCH), registry=reg)
    assert "--enforce-eager" in str(err.value).splitlines()[-1]
    assert select(ctx(kv="bf16", cuda_graphs=False, decode_kernel=TORCH), registry=reg).decode == TORCH


def test_a_present_device_runs_probes(reg, monkeypatch):
    # An SM120 reported by the engine (not planned): probes run, and on this GPU-less machine
    # they reject FlashInfer and Triton with their reasons.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dev = DeviceInfo("nvidia", 12, 0, source="vllm")
    d = select(SelectionContext(GLM, "bf16", 5, 100, dev), registry=reg)
    if d.decode != TORCH:
        pytest.skip("a CUDA GPU is present: the Triton probe passes")
    triton = [r for r in d.rejections if r.kernel == TRITON][0]
    assert "no CUDA GPU" in triton.reasons[0]
    assert not d.notes


def test_a_cpu_is_not_a_deployment(reg):
    with pytest.raises(UnsupportedConfiguration, match="no GPU \\(CPU\\): this plugin serves NVIDIA SM12x"):
        select(SelectionContext(GLM, "bf16", 5, 100, DeviceInfo("cpu", name="test")), registry=reg)


def test_explain_renders_every_rejection(reg):
    d = select(ctx(kv="bf16", tensor_parallel_size=4, heads=16), registry=reg)
    table = explain(d)
    assert f"decode   {TRITON}" in table and "SELECTED" in table
    assert table.count("rejected:") == len(d.rejections)
    assert "16 heads per rank (tensor parallel 4)" in table


# --- hooks that shape the decision ---------------------------------------------------


class _PreferTorch:
    @hookimpl
    def mla_sm120_select(self, ctx, phase, candidates):
        return TORCH if TORCH in candidates else None


class _Refuse:
    @hookimpl
    def mla_sm120_validate(self, ctx):
        return ["heads per rank below 8 not validated on this site"] if ctx.num_heads < 8 else []


class _Rogue:
    @hookimpl
    def mla_sm120_select(self, ctx, phase, candidates):
        return "not_a_candidate"


def test_select_hook_overrides_the_priority_order():
    reg = build_registry(load_entry_points=False, extra_plugins={"prefer_torch": _PreferTorch()})
    d = select(ctx(kv="bf16", cuda_graphs=False), registry=reg)
    assert d.decode == TORCH
    # A forced kernel is never overridden.
    assert select(ctx(kv="bf16", decode_kernel=TRITON), registry=reg).decode == TRITON


def test_validate_hook_refuses():
    reg = build_registry(load_entry_points=False, extra_plugins={"refuse": _Refuse()})
    assert select(ctx(heads=8), registry=reg).decode == FLASHINFER
    with pytest.raises(UnsupportedConfiguration, match="not validated on this site"):
        select(ctx(heads=4), registry=reg)


def test_select_hook_must_return_a_candidate():
    reg = build_registry(load_entry_points=False, extra_plugins={"rogue": _Rogue()})
    with pytest.raises(PluginError, match="not_a_candidate"):
        select(ctx(), registry=reg)


# --- the CLI, as the must-shows state it ------------------------------------------


def test_cli_forced_flashinfer_on_sm90_exits_2_naming_everything():
    res = run_cli("check", "--model", "glm-5", "--sm", "9.0", "--kv-cache-dtype", "fp8_ds_mla",
                  "--decode-kernel", "flashinfer_sparse_mla")
    assert res.returncode == 2
    _combination_named(res.stderr, "9.0", "fp8_ds_mla", "auto", FLASHINFER)


def test_cli_trtllm_on_sm120_exits_2_listing_what_can_run():
    res = run_cli("check", "--model", "glm-5", "--sm", "12.0", "--kv-cache-dtype", "fp8_ds_mla",
                  "--decode-kernel", "trtllm")
    assert res.returncode == 2
    listed = re.search(r"decode can run: (.*)", res.stderr).group(1)
    assert FLASHINFER in listed and TRITON in listed


def test_cli_check_json_for_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": [DSV], "model_type": "deepseek_v32", "num_attention_heads": 128, "index_topk": 1024}
    ))
    res = run_cli("check", "--model", str(tmp_path), "--sm", "12.1", "--tp", "8", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["heads_per_rank"] == 16 and data["index_topk"] == 1024
    assert data["scale_format"] == "pow2"


def test_cli_bad_tp_and_unknown_model_exit_2():
    res = run_cli("check", "--model", "glm-5", "--sm", "12.0", "--tp", "3")
    assert res.returncode == 2 and "a divisor of 64" in res.stderr
    res = run_cli("check", "--model", "llama-3", "--sm", "12.0")
    assert res.returncode == 2 and "glm-5" in res.stderr
    res = run_cli("check", "--model", "glm-5", "--sm", "twelve")
    assert res.returncode == 2 and "sm_121" in res.stderr


def test_device_env_plans_for_another_machine():
    res = run_cli("check", "--model", "glm-5", "--json", env={"MLA_SM120_DEVICE": "sm_121"})
    data = json.loads(res.stdout)
    assert data["device"]["sm"] == "12.1" and data["device"]["source"] == "MLA_SM120_DEVICE"


# --- the built-in policy: one set of rules for check, doctor and every engine ---------------


class _WideProfile:
    @hookimpl
    def mla_sm120_model_profiles(self):
        from mla_sm120_plugin.types import ModelProfile

        yield ModelProfile(name="wide-dsa", architectures=("WideDsaForCausalLM",), model_type="wide",
                           num_heads=32, index_topk=2048, kv_scale_format="pow2", kv_lora_rank=1024)


def test_profile_geometry_must_match_what_the_kernels_read():
    reg = build_registry(load_entry_points=False, extra_plugins={"wide": _WideProfile()})
    with pytest.raises(UnsupportedConfiguration) as err:
        select(ctx("WideDsaForCausalLM", heads=32), registry=reg)
    msg = str(err.value)
    assert "profile wide-dsa has kv_lora_rank=1024, qk_rope_head_dim=64: the kernels read 512+64-wide or 512-wide caches" in msg
    assert_three_parts(msg, "model_arch=WideDsaForCausalLM")


@pytest.mark.parametrize("feature, needle", [("hisparse", "HiSparse writes the cache"),
                                             ("dcp", "decode context parallelism"),
                                             ("index_kpool", "an engine feature this plugin does not know"),
                                             ("something_new", "an engine feature this plugin does not know")])
def test_engine_features_the_kernels_cannot_read_are_refused(reg, feature, needle):
    # index_kpool is no feature any more: both engines hand the kernels token slots for a pooled
    # indexer (GLM-5.3-Flash, tests/unit/test_glm53_plan.py); a caller that still names it gets
    # the unknown-feature refusal, not silence.
    with pytest.raises(UnsupportedConfiguration, match=needle):
        select(ctx(features=frozenset({feature})), registry=reg)


def test_every_refusal_at_once_one_per_line(reg):
    with pytest.raises(UnsupportedConfiguration) as err:
        select(ctx(sm="9.0", kv="fp8_e4m3", features=frozenset({"hisparse"})), registry=reg)
    lines = str(err.value).splitlines()
    reasons = [line for line in lines if line.startswith("  - ")]
    assert len(reasons) == 3, lines
    fix = next(line for line in lines if line.startswith("fix: "))
    assert "--kv-cache-dtype fp8_ds_mla" in fix and "HiSparse" in fix and "FLASHMLA_SPARSE" in fix


def test_validate_hook_reasons_name_their_plugin():
    reg = build_registry(load_entry_points=False, extra_plugins={"refuse": _Refuse()})
    with pytest.raises(UnsupportedConfiguration) as err:
        select(ctx(heads=4), registry=reg)
    assert "  - heads per rank below 8 not validated on this site (refused by plugin refuse)" in str(err.value)


def test_fix_names_only_what_applies(reg):
    # A planned device runs no probe, so nothing is "missing": no pip line.
    with pytest.raises(UnsupportedConfiguration) as err:
        select(ctx(kv="bf16", decode_kernel=FLASHINFER), registry=reg)
    fix = str(err.value).splitlines()[-1]
    assert "pip install" not in fix and "probe" not in fix
    assert "remove the kernel override" in fix and "--kv-cache-dtype fp8_ds_mla" in fix


def test_cli_sm90_exits_2_naming_the_engines_backends():
    res = run_cli("check", "--model", "glm-5", "--sm", "9.0", "--kv-cache-dtype", "fp8_ds_mla")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "device sm_90: this plugin serves SM12x only" in res.stderr
    assert "FLASHMLA_SPARSE" in res.stderr and "drop --attention-backend CUSTOM" in res.stderr


def test_cli_without_gpu_or_plan_exits_2(monkeypatch):
    from mla_sm120_plugin import device

    monkeypatch.delenv("MLA_SM120_DEVICE", raising=False)
    device._detect_hardware.cache_clear()
    if device.detect().is_gpu:
        pytest.skip(f"check finds a GPU here ({device.detect().describe()}) and decides for it")
    res = run_cli("check", "--model", "glm-5")
    assert res.returncode == 2 and "no GPU found on this machine" in res.stderr and "--sm 12.0" in res.stderr
    assert "servable" not in res.stdout


def test_cli_version_and_help():
    from mla_sm120_plugin import __version__

    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"mla-sm120 {__version__}"
    res = run_cli("--help")
    assert res.returncode == 0 and "``" not in res.stdout


def test_cli_header_echoes_tp_and_heads():
    res = run_cli("check", "--model", "glm-5", "--sm", "12.1", "--tp", "16")
    assert res.returncode == 0, res.stderr
    assert "4 heads per rank (tensor parallel 16)" in res.stdout
    assert "--max-decode-tokens 64" in res.stdout  # the setting that lets FlashInfer decode 4 heads
    # ... and each engine's own settings that bound a decode call (SGLang's verify step is
    # requests x draft tokens, not 1 + speculative tokens as in vLLM)
    assert "vLLM: --max-num-seqs x (1 + --num-speculative-tokens)" in res.stdout
    assert "SGLang: --max-running-requests x --speculative-num-draft-tokens" in res.stdout
    assert "planned is planned" not in res.stdout


def test_cli_engine_sglang_uses_sglangs_spelling_and_scale_format():
    # SGLang writes amax/448 scales for every model: DeepSeek-V3.2 reads as "arbitrary" there.
    res = run_cli("check", "--engine", "sglang", "--model", "deepseek-v3.2", "--sm", "12.0",
                  "--kv-cache-dtype", "fp8_e4m3", "--tp", "8", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert (data["kv_cache_dtype"], data["scale_format"]) == ("fp8_ds_mla", "arbitrary")
    res = run_cli("check", "--model", "deepseek-v3.2", "--sm", "12.0", "--tp", "8", "--json")
    assert json.loads(res.stdout)["scale_format"] == "pow2"
    # vLLM's fp8_e4m3 is a plain fp8 cache: refused, pointing SGLang users at --engine sglang.
    res = run_cli("check", "--model", "deepseek-v3.2", "--sm", "12.0", "--kv-cache-dtype", "fp8_e4m3")
    assert res.returncode == 2 and "--engine sglang" in res.stderr
