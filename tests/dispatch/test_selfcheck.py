"""The self-check: built-in kernels pass on this device; wrong or failing kernels are caught."""

from __future__ import annotations

import pytest

from support.cli import demo_plugins_except
from support.kernel_checks import DEVICE
from mla_sm120_plugin.errors import UnsupportedConfiguration
from mla_sm120_plugin.hooks.manager import get_registry, reset_registry
from mla_sm120_plugin.kernels.dsa import layout
from mla_sm120_plugin.dispatch import selfcheck, selfcheck_dsa
from mla_sm120_plugin.dispatch.binding import bind
from mla_sm120_plugin.dispatch.catalog import TORCH, TRITON

CASES = [(layout.FP8_DS_MLA, layout.SCALE_ARBITRARY), (layout.FP8_DS_MLA, layout.SCALE_POW2), (layout.BF16, layout.SCALE_ARBITRARY),
         # GLM-5.3-Flash's rope-less rows: SGLang's packed fp8 (pow2-written here) and bf16
         ("fp8_nope", layout.SCALE_POW2), ("bf16_nope", layout.SCALE_ARBITRARY)]


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("kv_layout, scale_format", CASES)
@pytest.mark.parametrize("kernel", [TRITON])  # not the torch reference: it is the check's own ground truth
def test_builtin_kernels_pass_here(kernel, kv_layout, scale_format, phase):
    result = selfcheck.check(bind(kernel), phase=phase, kv_layout=kv_layout, scale_format=scale_format,
                             num_heads=5, topk=100, device=DEVICE)
    assert result.passed, result
    assert result.ran and result.max_error <= get_registry().kernels[kernel].tolerance
    again = selfcheck.check(bind(kernel), phase=phase, kv_layout=kv_layout, scale_format=scale_format,
                            num_heads=5, topk=100, device=DEVICE)
    assert again is result, "one check per key and process"


@pytest.mark.parametrize("kv_layout", layout.KV_LAYOUTS)
def test_the_case_is_the_layouts_own_and_ignores_the_engines_defaults(kv_layout):
    """Built inside what vLLM builds the impl under (a default device and dtype: meta and bf16 here),
    the case is the same CPU tensors: q as wide as the layout's head_dim, rows of its width and dtype
    with its reserved bytes zero, 64-row pages, the adversarial lead of token 0."""
    import torch

    from mla_sm120_plugin.kernels.dsa import pack

    key = selfcheck.CheckKey(TRITON, "decode", kv_layout, 5, "cpu", "bf16", "arbitrary", "pow2", 100)
    plain = selfcheck_dsa.build(key, torch.device("cpu"))
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            inside = selfcheck_dsa.build(key, torch.device("cpu"))
    finally:
        torch.set_default_dtype(dtype)
    lay = layout.get(kv_layout)
    num_slots = selfcheck_dsa.NUM_PAGES * layout.PAGE_SIZE
    assert inside["q"].shape == (2, 5, lay.head_dim) and inside["q"].dtype == torch.bfloat16
    assert inside["kv_cache"].shape == (selfcheck_dsa.NUM_PAGES, layout.PAGE_SIZE, lay.row)
    assert inside["kv_cache"].dtype == pack.cache_dtype(kv_layout)
    assert inside["sm_scale"] == lay.head_dim**-0.5
    assert inside["indices"][0, :4].tolist() == list(selfcheck_dsa.adversarial_ids(num_slots))
    for name in ("q", "kv_cache", "indices", "topk_length"):
        assert inside[name].device.type == "cpu" and torch.equal(inside[name], plain[name]), name
    if lay.fp8 and lay.row > lay.used:
        assert torch.all(inside["kv_cache"][..., lay.used:] == 0)


@pytest.mark.parametrize("scale_format", layout.SCALE_FORMATS)
def test_a_kernel_that_ignores_the_scales_is_caught(noscale_plugin_path, monkeypatch, scale_format):
    monkeypatch.syspath_prepend(str(noscale_plugin_path))
    reset_registry()
    result = selfcheck.check(bind("noscale_sparse_mla"), phase="decode", kv_layout=layout.FP8_DS_MLA,
                             scale_format=scale_format, num_heads=5, topk=100, device=DEVICE)
    assert result.ran and not result.passed
    assert result.max_error > 0.1 and "tolerance" in result.error, result


def test_a_kernel_that_raises_is_reported_not_raised(demo_plugin_path, monkeypatch):
    monkeypatch.syspath_prepend(str(demo_plugin_path))
    for name, value in demo_plugins_except().items():
        monkeypatch.setenv(name, value)
    reset_registry()
    result = selfcheck.check(bind("demo_sparse_mla"), phase="decode", kv_layout=layout.FP8_DS_MLA,
                             scale_format=layout.SCALE_POW2, num_heads=4, topk=64, device=DEVICE)
    assert not result.ran and result.max_error is None
    assert result.error.startswith("NotImplementedError: demo kernel"), result.error


@pytest.mark.parametrize("value, expected", [("", "on"), ("OFF", "off"), ("strict", "strict")])
def test_mode_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv(selfcheck.ENV, value)
    assert selfcheck.mode() == expected


def test_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv(selfcheck.ENV, "sometimes")
    with pytest.raises(UnsupportedConfiguration, match=r"(?s)given: MLA_SM120_SELF_CHECK='sometimes'.*fix:"):
        selfcheck.mode()


def _doctor_checks(**kwargs):
    import json

    from support.cli import run_cli

    done = run_cli("doctor", "--self-check", "--json", **kwargs)
    return done, json.loads(done.stdout)["self_check"]


@pytest.fixture(scope="module")
def builtin_doctor():
    """One `doctor --self-check --json` run with the built-in kernels only (a fresh process, ~40 s on 2
    cores): the DSA and the DeepSeek-V4 tests below read the same run."""
    return _doctor_checks()


def test_doctor_self_check_passes_the_builtin_kernels_here(builtin_doctor):
    done, checks = builtin_doctor
    assert done.returncode == 0, done.stderr
    seen = {(c["kernel"], c["kv_layout"]) for c in checks if c["passed"]}
    for kernel in (TRITON, TORCH):
        for kv_layout in layout.KV_LAYOUTS:
            assert (kernel, kv_layout) in seen, checks
    assert all(c["ran"] and c["max_error"] <= c["tolerance"] for c in checks)
    # A kernel that returns its LSE is checked on decode as a DCP rank calls it: its LSE error is shown.
    lse_rows = [c for c in checks if c["kernel"] in (TRITON, TORCH) and c["phase"] == "decode"]
    assert lse_rows and all(c["lse"] == "e" and 0 <= c["lse_error"] <= c["lse_bound"] for c in lse_rows), lse_rows
    assert all(c["lse_error"] is None for c in checks if c["phase"] == "prefill")


def test_doctor_self_check_exits_2_on_a_wrong_third_party_kernel(noscale_plugin_path):
    done, checks = _doctor_checks(pythonpath=noscale_plugin_path)
    assert done.returncode == 2
    wrong = [c for c in checks if c["kernel"] == "noscale_sparse_mla"]
    assert wrong and not any(c["passed"] for c in wrong)
    assert all(c["passed"] for c in checks if c["kernel"] != "noscale_sparse_mla")


@pytest.mark.parametrize("tolerance", [0, -1e-3, 1.0, float("nan"), "1e-2", True])
def test_a_kernel_must_state_a_usable_tolerance(tolerance):
    from mla_sm120_plugin.errors import PluginError
    from mla_sm120_plugin.types import KernelSpec

    with pytest.raises(PluginError, match=r"(?s)tolerance=.*supported: a float in \(0, 1\)"):
        KernelSpec(name="k", phases={"decode"}, kv_cache_dtypes={"bf16"}, vendors={"cpu"}, priority=1,
                   entry="m:f", tolerance=tolerance)


def test_arbitrary_kernels_are_checked_on_pow2_written_caches_too():
    """vLLM 0.33 writes power-of-two scales even for GLM (arbitrary): verify checks both."""
    from mla_sm120_plugin.selection import select
    from mla_sm120_plugin.types import DeviceInfo, SelectionContext

    decision = select(SelectionContext(
        model_arch="GlmMoeDsaForCausalLM", kv_cache_dtype=layout.FP8_DS_MLA, num_heads=5, index_topk=100,
        device=DeviceInfo("nvidia", 12, 0, source="--sm"), decode_kernel=TRITON, prefill_kernel=TORCH))
    assert decision.scale_format == layout.SCALE_ARBITRARY
    kernels, line = selfcheck.verify(decision, q_dtype="bf16", device=DEVICE, strict=True)
    assert [kernels[phase] for phase in ("decode", "prefill")] == [TRITON, TORCH]
    written = {key.written_format for key in selfcheck._results if key.kernel == TRITON}
    assert written == {layout.SCALE_ARBITRARY, layout.SCALE_POW2}, written
    assert line.startswith("mla_sm120: self-check: decode=triton_sparse_mla ok")


# --- Sharp enough to catch a mis-lowered MMA: one wrong step or tile fails an exact-class kernel ------
# Each fault is the fast kernel with one of its jit helpers replaced (the interpreter resolves them
# from the module at call time), the kind of error a wrong `tl.dot_scaled` lowering or a scale-layout
# slip would make; two of them are small enough to hide inside the 0.15 max-error tolerance a
# single-e4m3 kernel needs.

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mla_sm120_plugin.dispatch.catalog import TRITON_FAST  # noqa: E402
from mla_sm120_plugin.kernels.dsa import triton_fast as tf  # noqa: E402


_TILE_VALUES = tf._tile_values  # the kernel's own, called by the faults with one argument wrong


@triton.jit
def _values_with_one_tile_scales_reversed(acc, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid, cols, scale,
                                          ones_v):
    """Latent tile 1's value scales applied to the step's candidates in reverse order (a transposed
    scale tile), the other tiles right."""
    scale = tl.where(tl.min(cols, axis=0) == 128, tl.flip(scale, 0), scale)
    return _TILE_VALUES(acc, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid, cols, scale, ones_v)


@triton.jit
def _values_with_p_exponent_off_by_one_in_a_ragged_step(acc, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid,
                                                        cols, scale, ones_v):
    """In a step with some invalid candidates (token 0's first: the adversarial ids), the MMA's
    p scale is one binade above the one p was quantized under."""
    ragged = tl.sum(valid.to(tl.int32), axis=0) < valid.shape[0]
    p_e8 = tl.where(ragged, p_e8 + 1, p_e8)
    return _TILE_VALUES(acc, alpha, p, p_inv, p_e8, p_lo_e8, kv_lat, row_off, valid, cols, scale, ones_v)


@triton.jit
def _scores_without_q_lo(q_hi, q_hi_e8, q_lo, q_lo_e8, kv_lat, row_off, valid, cols, scale, ones_k):
    """The scores from q's hi part alone (the lo part's MMA dropped)."""
    k_t = tl.load(kv_lat + row_off[None, :] + cols[:, None], mask=valid[None, :], other=0.0)
    return tl.dot_scaled(q_hi, q_hi_e8, "e4m3", k_t, ones_k, "e4m3") * scale[None, :]


# fault -> (the helper replaced, its replacement, whether the error hides inside a 0.15 max error)
FAULTS = {
    "value scales of one tile reversed": ("_tile_values", _values_with_one_tile_scales_reversed, True),
    "p exponent off by one in one step": ("_tile_values", _values_with_p_exponent_off_by_one_in_a_ragged_step, False),
    "q lo part dropped": ("_tile_scores", _scores_without_q_lo, True),
}
FAULT_CASE = dict(phase="decode", kv_layout=layout.FP8_DS_MLA, scale_format=layout.SCALE_ARBITRARY, num_heads=16,
                  topk=256, device=DEVICE)


@pytest.mark.skipif(DEVICE != "cpu", reason="the faults are swapped in through Triton's interpreter")
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_self_check_fails_the_fast_kernel_on_a_one_step_fault(monkeypatch, fault):
    sound = selfcheck.check(bind(TRITON_FAST), **FAULT_CASE)
    assert sound.passed and sound.bound is not None and sound.bound.exact_class, sound
    selfcheck.clear_cache()
    helper, replacement, subtle = FAULTS[fault]
    monkeypatch.setattr(tf, helper, replacement)
    broken = selfcheck.check(bind(TRITON_FAST), **FAULT_CASE)
    assert broken.ran and not broken.passed, (fault, broken)
    assert "against float64" in broken.error and ("relRMS" in broken.error or "cos_diff" in broken.error)
    if subtle:  # only the exact-class bound sees it
        assert broken.accuracy.max_rel < 0.15, broken.accuracy


@pytest.mark.skipif(DEVICE != "cpu", reason="the faults are swapped in through Triton's interpreter")
def test_a_faulty_fast_kernel_falls_back_naming_why(monkeypatch):
    from mla_sm120_plugin.selection import select
    from mla_sm120_plugin.types import DeviceInfo, SelectionContext

    decision = select(SelectionContext("GlmMoeDsaForCausalLM", layout.FP8_DS_MLA, 16, 256,
                                       DeviceInfo("nvidia", 12, 0, source="--sm"), precision="exact"))
    assert decision.decode == TRITON_FAST and decision.alternates["decode"][0] == TRITON, decision
    monkeypatch.setattr(tf, *FAULTS["q lo part dropped"][:2])
    chosen, line = selfcheck.verify(decision, phases=["decode"], q_dtype="bf16", device=DEVICE,
                                    strict=False)
    assert chosen["decode"] == TRITON, line
    assert f"decode={TRITON_FAST} FAILED" in line and "against float64" in line and f"falling back to {TRITON} ok" in line


def test_doctor_self_check_runs_the_dsv4_kernel_on_both_records(builtin_doctor):
    """`doctor --self-check` runs the DeepSeek-V4 kernels too (the engines' call on each record they read)."""
    from mla_sm120_plugin.dispatch.catalog import TRITON_DSV4
    from mla_sm120_plugin.kernels.dsv4 import layout as dsv4_layout

    done, checks = builtin_doctor
    assert done.returncode == 0, done.stderr
    rows = {c["kv_layout"]: c for c in checks if c["kernel"] == TRITON_DSV4}
    assert sorted(rows) == sorted(dsv4_layout.RECORDS)
    assert all(r["ran"] and r["passed"] and r["rel_rms"] <= r["bound"]["rel_rms"] for r in rows.values()), rows
