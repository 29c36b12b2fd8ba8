"""The constraint matrix: the seed's two rules, envelopes, probes, hooks and the CLI.

From "a kernel's envelope, at its edges" on, documented behaviour pinned from both sides: each test
names the promise it pins (the docstrings of ``types.KernelSpec`` and ``mla_sm120_plugin/selection.py``),
and an envelope test sits on both sides of each bound, so an off-by-one fails.
"""

from __future__ import annotations

import json
import re

import pytest

from support.cli import assert_three_parts, decision_of, run_cli
from support.decisions import _edge_ctx, _edge_reasons, _edge_registry, _refusal
from mla_sm120_plugin.device import parse_device
from mla_sm120_plugin.errors import PluginError, UnsupportedConfiguration
from mla_sm120_plugin.hooks import hookimpl
from mla_sm120_plugin.hooks.manager import build_registry
from mla_sm120_plugin.dispatch.catalog import FLASHINFER, TORCH, TRITON
from mla_sm120_plugin.report import explain
from mla_sm120_plugin.selection import select
from mla_sm120_plugin.types import ENGINE_NATIVE_IMPLS, DeviceInfo, SelectionContext

GLM = GLM_ARCH = "GlmMoeDsaForCausalLM"
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
    assert "is not a sparse-MLA model this plugin serves" in msg and GLM in msg and DSV in msg


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
    data = decision_of(json.loads(res.stdout))
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
                                             ("pcp", "prefill context parallelism"),
                                             ("index_kpool", "an engine feature this plugin does not know"),
                                             ("something_new", "an engine feature this plugin does not know")])
def test_engine_features_the_kernels_cannot_read_are_refused(reg, feature, needle):
    # index_kpool is no feature any more: both engines hand the kernels token slots for a pooled
    # indexer (GLM-5.3-Flash, tests/unit/test_plan_glm53.py); a caller that still names it gets
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
    data = decision_of(json.loads(res.stdout))
    assert (data["kv_cache_dtype"], data["scale_format"]) == ("fp8_ds_mla", "arbitrary")
    res = run_cli("check", "--model", "deepseek-v3.2", "--sm", "12.0", "--tp", "8", "--json")
    assert decision_of(json.loads(res.stdout))["scale_format"] == "pow2"
    # vLLM's fp8_e4m3 is a plain fp8 cache: refused, pointing SGLang users at --engine sglang.
    res = run_cli("check", "--model", "deepseek-v3.2", "--sm", "12.0", "--kv-cache-dtype", "fp8_e4m3")
    assert res.returncode == 2 and "--engine sglang" in res.stderr


# --- a kernel's envelope, at its edges (types.KernelSpec, selection.envelope_reasons) ----------------


def test_a_kernels_head_range_is_inclusive_at_both_ends():
    """types.KernelSpec: ``heads`` is the "inclusive (min, max) heads per rank"."""
    from mla_sm120_plugin.selection import select

    reg = _edge_registry(heads=(8, 32))
    for heads in (8, 32):
        assert select(_edge_ctx(heads=heads), registry=reg).decode == "edge"
    for heads in (4, 64):
        d = select(_edge_ctx(heads=heads), registry=reg)
        assert d.decode != "edge" and _edge_reasons(d) == (f"heads per rank {heads} outside [8, 32]",)


def test_a_kernels_top_k_bounds_are_exact():
    """types.KernelSpec: "topk_min: smallest index top-k"; "top-k must be a multiple of" topk_multiple."""
    from mla_sm120_plugin.selection import select

    reg = _edge_registry(topk_min=512, topk_multiple=256)
    for topk in (512, 768, 2048):
        assert select(_edge_ctx(topk=topk), registry=reg).decode == "edge"
    assert _edge_reasons(select(_edge_ctx(topk=256), registry=reg)) == ("index_topk 256 < 512",)
    assert _edge_reasons(select(_edge_ctx(topk=640), registry=reg)) == ("index_topk 640 not a multiple of 256",)
    assert _edge_reasons(select(_edge_ctx(topk=300), registry=reg)) == \
        ("index_topk 300 < 512", "index_topk 300 not a multiple of 256")


def test_a_kernels_token_limit_takes_calls_up_to_it_and_never_unbounded_ones():
    """types.KernelSpec: "max_tokens: most query tokens one call takes"; context.EngineLimits: a
    bound of None means "unbounded or unknown", which such a kernel cannot take (as FlashInfer's own
    envelope reads it)."""
    from mla_sm120_plugin.selection import select

    reg = _edge_registry(max_tokens=64)
    d = select(_edge_ctx(max_decode_tokens=64, max_prefill_tokens=65), registry=reg)
    assert d.decode == "edge" and d.prefill != "edge"
    assert _edge_reasons(d, "prefill") == ("prefill may see 65 tokens a call, kernel takes <= 64",)
    d = select(_edge_ctx(max_decode_tokens=None, max_prefill_tokens=64), registry=reg)
    assert d.prefill == "edge" and d.decode != "edge"
    assert _edge_reasons(d) == ("decode may see calls of any length (no bound given), kernel takes <= 64",)


def test_a_kernels_own_envelope_check_sees_the_phase_and_profile_and_only_runs_within_the_static_one():
    """types.KernelSpec: ``envelope`` adds per-phase checks to the static envelope; selection: a
    check that raises is a reason, never a crash."""
    from mla_sm120_plugin.selection import select

    calls = []

    def envelope(ctx, phase, profile):
        calls.append((phase, ctx.num_heads))
        return [f"{phase} refused for {profile.name}"] if phase == "decode" else []

    reg = _edge_registry(heads=(8, 32), envelope=envelope)
    d = select(_edge_ctx(), registry=reg)
    assert d.prefill == "edge" and d.decode != "edge"
    assert _edge_reasons(d) == ("decode refused for glm-5",)
    calls.clear()
    select(_edge_ctx(heads=64), registry=reg)  # outside the static envelope: not asked
    assert calls == []

    def broken(ctx, phase, profile):
        raise ValueError("table missing")

    d = select(_edge_ctx(), registry=_edge_registry(envelope=broken))
    assert _edge_reasons(d) == ("envelope check failed: ValueError: table missing",)


def test_a_probe_decides_on_a_present_device_and_a_crashing_probe_is_a_reason():
    """selection.probe_reasons: a kernel's probe runs for the device this machine has (not for a
    planned one), its reasons reject the kernel, and a probe that raises is a reason too."""
    from mla_sm120_plugin.selection import clear_probe_cache, select
    from mla_sm120_plugin.types import DeviceInfo

    seen = []

    def probe(device):
        seen.append(device.sm)
        return ["needs the edge toolkit"]

    present = DeviceInfo("nvidia", 12, 0, name="test", source="vllm")
    d = select(_edge_ctx(device=present, cuda_graphs=False), registry=_edge_registry(probe=probe))
    assert d.decode != "edge" and _edge_reasons(d) == ("needs the edge toolkit",) and seen == ["12.0"]
    seen.clear()
    assert select(_edge_ctx(), registry=_edge_registry(probe=probe)).decode == "edge"  # planned: not probed
    assert seen == []

    def crash(device):
        raise RuntimeError("driver gone")

    clear_probe_cache()  # probe results are cached per kernel and device
    d = select(_edge_ctx(device=present, cuda_graphs=False), registry=_edge_registry(probe=crash))
    assert _edge_reasons(d) == ("probe failed: RuntimeError: driver gone",)


def test_the_sm_family_envelope_applies_to_nvidia_only(monkeypatch):
    """selection.envelope_reasons: ``sm_families`` restricts NVIDIA devices; tensors on the CPU
    (``sparse_mla_forward(kernel="auto")``) are not held to it."""
    from mla_sm120_plugin.selection import choose_kernel_for_shape

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's probe: the interpreter runs it on the CPU
    assert choose_kernel_for_shape(kv_layout="bf16", num_heads=8, topk=64, num_tokens=4, device_type="cpu") == TRITON


# --- a refusal's parts: the supported line and the fixes that apply -------------------------------------


def test_the_supported_line_lists_every_kernel_best_first():
    """selection: a refusal's "supported" part lists each kernel, highest priority first, with its
    devices, cache layouts and head range."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import select

    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(decode_kernel="trtllm"), registry=_edge_registry(heads=(8, 32)))
    supported = next(line for line in str(err.value).splitlines() if line.startswith("supported: "))
    assert supported.startswith("supported: for glm-5: edge (cpu/nvidia SM12x, kv bf16/fp8_ds_mla, heads 8-32), ")
    fi, torch_ref = "flashinfer_sparse_mla (nvidia SM12x, kv ", "torch_sparse_mla (amd/cpu/nvidia, kv "
    assert fi in supported and torch_ref in supported and supported.index(fi) < supported.index(torch_ref)
    assert supported.endswith(", heads 1-128)")


def _fix_line(err) -> str:
    return next(line for line in str(err.value).splitlines() if line.startswith("fix: "))


def test_the_fix_names_only_the_fixes_that_apply(monkeypatch):
    """selection: "the fixes that apply to this refusal only": the override fix only when a kernel is
    forced, the fp8 flag only for a cache the rejected kernels cannot read, installing only for a
    probe that says pip install; else the generic advice."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import select
    from mla_sm120_plugin.types import DeviceInfo

    monkeypatch.setenv("MLA_SM120_DISABLE_PLUGINS", "mla_sm120.kernels")  # only the edge kernel
    reg = _edge_registry(heads=(8, 32))
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(heads=4), registry=reg)
    assert _fix_line(err) == ("fix: change the combination to one a kernel above supports (each rejection says what "
                              "it needs)")
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(heads=4, prefill_kernel="edge"), registry=reg)
    assert _fix_line(err).startswith("fix: remove the kernel override (") and "change the combination" not in str(err.value)
    fp8_only = _edge_registry(kv_cache_dtypes=frozenset({"fp8_ds_mla"}))
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(heads=4).__class__(GLM_ARCH, "bf16", 16, 2048, _edge_ctx().device, decode_kernel="edge"),
               registry=fp8_only)
    assert _fix_line(err) == ("fix: remove the kernel override (config) or set it to one listed as able to run; "
                              "use --kv-cache-dtype fp8_ds_mla for the kernels that read only the fp8 cache")
    present = DeviceInfo("nvidia", 12, 0, name="test", source="vllm")
    missing = _edge_registry(probe=lambda device: ["pip install edge-kernels"])
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(device=present, cuda_graphs=False), registry=missing)
    assert _fix_line(err) == "fix: install what a probe above reports missing"


def test_the_fp8_flag_fix_is_only_for_cache_reasons_and_sm_families_are_listed():
    """selection: a bf16 cache refused for another reason gets no fp8 advice; the supported line
    lists a kernel's SM families as SM9x/12x."""
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import select
    from mla_sm120_plugin.types import SelectionContext

    with pytest.raises(UnsupportedConfiguration) as err:
        select(SelectionContext(GLM_ARCH, "bf16", 4, 2048, parse_device("12.0", source="--sm"), decode_kernel="edge"),
               registry=_edge_registry(heads=(8, 32), topk_min=4096, sm_families=frozenset({9, 12})))
    msg = str(err.value)
    assert "--kv-cache-dtype fp8_ds_mla" not in msg.split("\nfix: ")[1]
    assert "cannot run: heads per rank 4 outside [8, 32]; index_topk 2048 < 4096; decode can run: " in msg
    assert "edge (cpu/nvidia SM9x/12x, kv bf16/fp8_ds_mla, heads 8-32)" in msg


def test_a_plugin_refusal_without_supported_or_fix_still_gets_both_parts_and_every_refusal_is_listed():
    """selection: validate refusals are listed one per line, a third party's marked "(refused by
    plugin ...)"; their supported and fix parts joined once each, with a fallback when none says."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.hooks import hookimpl
    from mla_sm120_plugin.hooks.manager import build_registry
    from mla_sm120_plugin.rules import SERVED_DEVICE
    from mla_sm120_plugin.selection import select

    class Site:
        @hookimpl
        def mla_sm120_validate(self, ctx):
            return ["not validated on this site"]

    reg = build_registry(load_entry_points=False, extra_plugins={"site": Site()})
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(), registry=reg)
    lines = str(err.value).splitlines()
    assert lines[1].startswith("  - not validated on this site (refused by plugin ") and lines[1].endswith(")")
    assert lines[2:] == ["supported: what those plugins allow", "fix: see the reasons above"]
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.types import SelectionContext

    with pytest.raises(UnsupportedConfiguration) as err:
        select(SelectionContext(GLM_ARCH, "fp8", 64, 2048, parse_device("9.0", source="--sm"),
                                features=frozenset({"hisparse", "pcp"})), registry=_edge_registry())
    lines = str(err.value).splitlines()
    for line, start in zip(lines[1:5], ["  - device sm_90: this plugin serves SM12x only",
                                        "  - kv_cache_dtype fp8: no kernel reads that layout",
                                        "  - hisparse is on: HiSparse", "  - pcp is on: prefill context parallelism"]):
        assert line.startswith(start), (line, start)
    supported = lines[5]
    assert supported.startswith(f"supported: {SERVED_DEVICE}; fp8_ds_mla (656 B a token")
    assert supported.endswith("; the standard DSA cache and top-k path") and supported.count("standard DSA") == 1
    assert lines[6].startswith("fix: on sm_90 serve without this plugin: drop --attention-backend CUSTOM; ")
    assert "; set --prefill-context-parallel-size 1, or serve without --attention-backend CUSTOM" in lines[6]


def test_a_context_with_an_unknown_scale_format_is_refused():
    """selection.select: a context built by hand (not through config.py, which refuses it first) with
    an unknown kv_scale_format is refused in three parts."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import select

    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(kv_scale_format="e8m0"))
    assert str(err.value) == ("given: kv_scale_format='e8m0'\nsupported: auto or one of ['pow2', 'arbitrary']\n"
                              "fix: fix kv_scale_format in the plugin config")


def test_a_model_no_profile_serves_is_refused_with_how_to_serve_it(tmp_path, capsys):
    """README: "Enabled for a model it cannot serve, it fails at init with the fix in the message"."""
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 32}))
    lines = _refusal(capsys, "--model", str(d), "--sm", "12.0")
    assert lines[0].endswith(": LlamaForCausalLM is not a sparse-MLA model this plugin serves (no model profile names "
                             "the architecture)")
    assert lines[-1] == ("fix: serve this model without --attention-backend CUSTOM, or install a plugin with a "
                         "profile for it")


# --- bare tensors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, phase", [(64, "decode"), (65, "prefill")])
def test_bare_tensors_up_to_64_rows_are_decoded_and_refused_with_the_reasons(monkeypatch, tokens, phase):
    """kernels/__init__.py: ``kernel="auto"`` asks ``choose_kernel_for_shape``, which treats up to 64
    query rows as a decode call (selection.DECODE_TOKENS_MAX) and refuses a shape no kernel takes."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import choose_kernel_for_shape

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton cannot run here without its interpreter
    assert choose_kernel_for_shape(kv_layout="bf16", num_heads=8, topk=64, num_tokens=tokens,
                                   device_type="cpu") == TORCH
    with pytest.raises(UnsupportedConfiguration) as err:
        choose_kernel_for_shape(kv_layout="bf16", num_heads=200, topk=64, num_tokens=tokens, device_type="cpu")
    msg = str(err.value)
    assert_three_parts(msg, "model_arch=<tensors>, sm=cpu, kv_cache_dtype=bf16, heads_per_rank=200")
    assert f": no kernel can run {phase} (" in msg and "; torch_sparse_mla: heads per rank 200 outside [1, 128]" in msg
    assert "flashinfer_sparse_mla: runs on ['nvidia'], not cpu, reads kv_cache_dtype [" in msg
    assert msg.endswith("\nsupported: see each kernel's reasons\n"
                        "fix: pass kernel= explicitly, or install what a probe reports missing")


# --- the decision itself: every problem at once, who was passed over and why, what may stand in ------------


def test_both_phases_problems_are_reported_at_once(monkeypatch):
    """selection.select: a refusal lists every phase's problem (forced kernels that cannot run, and
    phases no kernel can run, each with every kernel's reasons)."""
    from mla_sm120_plugin.errors import UnsupportedConfiguration
    from mla_sm120_plugin.selection import select

    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(prefill_kernel="flashmla_kv", decode_kernel="trtllm"), registry=_edge_registry())
    given = str(err.value).split("\nsupported: ")[0]
    assert "\n  - prefill kernel flashmla_kv (config) cannot run: flashmla_kv is another engine's impl" in given
    assert "\n  - decode kernel trtllm (config) cannot run: trtllm is another engine's impl" in given
    assert given.count("can run: edge, ") == 2
    problems = given.splitlines()[1:]
    assert len(problems) == 2 and all(p.endswith(", torch_sparse_mla") for p in problems)
    monkeypatch.setenv("MLA_SM120_DISABLE_PLUGINS", "mla_sm120.kernels")  # only the edge kernel
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(heads=4), registry=_edge_registry(heads=(8, 32), topk_min=4096))
    given = str(err.value).split("\nsupported: ")[0]
    for phase in ("prefill", "decode"):
        assert (f"\n  - no kernel can run {phase}:\n      edge: heads per rank 4 outside [8, 32]; index_topk 2048 "
                "< 4096") in given
    with pytest.raises(UnsupportedConfiguration) as err:
        select(_edge_ctx(heads=4, decode_kernel="edge"), registry=_edge_registry(heads=(8, 32)))
    assert "decode kernel edge (config) cannot run: heads per rank 4 outside [8, 32]; decode can run: nothing" in str(err.value)


def test_the_decision_says_why_each_viable_kernel_was_passed_over_and_keeps_them_as_stand_ins():
    """selection.select: "records every rejection with reasons": a viable kernel that was not chosen
    is "lower priority than" the pick, or "not the forced kernel"; the chosen one is never listed as
    rejected; the others stay, best first, as the phase's alternates (the self-check's fallbacks)."""
    from mla_sm120_plugin.selection import select

    reg = _edge_registry()
    d = select(_edge_ctx(kv_cache_dtype_given=None), registry=reg)
    assert d.decode == "edge"
    assert ("decode", ("lower priority than edge",)) in {(r.phase, r.reasons) for r in d.rejections if r.kernel == TORCH}
    assert not [r for r in d.rejections if r.kernel == "edge"]
    assert d.alternates["decode"][0] != "edge" and TORCH in d.alternates["decode"]
    assert list(d.alternates["decode"]) == [n for n in d.alternates["decode"] if n != "edge"]
    forced = select(_edge_ctx(decode_kernel=TORCH, cuda_graphs=False), registry=reg)
    assert forced.decode == TORCH and "edge" in forced.alternates["decode"]
    assert {r.reasons for r in forced.rejections if r.kernel == "edge" and r.phase == "decode"} == \
        {("not the forced kernel",)}
    assert not [r for r in forced.rejections if r.kernel == TORCH and r.phase == "decode"]


def test_notes_say_when_probes_were_skipped_and_carry_each_kernels_table_note():
    """selection.select: a planned device's decision says its probes were not run; a kernel's
    ``envelope_note`` is added for the caches it reads (a failing note is reported, not raised)."""
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.selection import select
    from mla_sm120_plugin.types import DeviceInfo

    planned = select(_edge_ctx(device=parse_device("12.0", source="--sm")),
                     registry=_edge_registry(probe=lambda device: [], envelope_note=lambda: "from the packaged table",
                                             kv_cache_dtypes=frozenset({"fp8_ds_mla"})))
    assert ("device sm_120 is planned (--sm), not present here: kernel probes (installed packages, GPU, JIT compiler) "
            "were not run; run `mla-sm120 doctor` on that machine") in planned.notes
    assert "edge: from the packaged table" in planned.notes
    bf16 = select(_edge_ctx().__class__(GLM_ARCH, "bf16", 16, 2048, parse_device("12.0", source="--sm")),
                  registry=_edge_registry(envelope_note=lambda: "from the packaged table",
                                          kv_cache_dtypes=frozenset({"fp8_ds_mla"})))
    assert not [n for n in bf16.notes if n.startswith("edge: ")]

    def broken():
        raise KeyError("version")

    present = DeviceInfo("nvidia", 12, 0, name="test", source="vllm")
    d = select(_edge_ctx(device=present, cuda_graphs=False), registry=_edge_registry(envelope_note=broken))
    assert "edge: envelope note failed: KeyError: 'version'" in d.notes
    assert not [n for n in d.notes if "is planned" in n]


def test_select_uses_the_process_registry_by_default():
    """selection.select: ``registry`` defaults to the process-wide one (the built-ins here)."""
    from mla_sm120_plugin.selection import select

    assert select(_edge_ctx()).decode == FLASHINFER
