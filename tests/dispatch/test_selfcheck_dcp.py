"""The init self-check proves what a decode-context-parallel engine reads (issue 50): a kernel whose LSE is
wrong in one way (tests/support/faulty_lse_kernels.py: base 2 asked e, the sink always in, NaN for an empty row,
topk_length ignored), registered through the plugin's hook for third-party kernels at the highest priority, is
fallen back from (or, strict, refused) at init under DCP, naming why, and is served where no LSE is read
(vLLM without DCP, whose call passes no lengths).

The plan is made as vLLM's adapter makes it (HY V4, learned sinks, fp8_ds_mla, TP 2, its DCP size), the
kernels are checked by the runner every engine binding calls (:func:`selfcheck.verify`), on the CPU. The
built-in kernels are blocked so that the alternate is the plugin's honest reference (all in torch: seconds).
"""

from __future__ import annotations

import pytest
from support.faulty_lse_kernels import FAULTY
from support.model_configs import write_model

from mla_sm120_plugin.dispatch import selfcheck
from mla_sm120_plugin.errors import UnsupportedConfiguration
from mla_sm120_plugin.hooks import hookimpl, manager
from mla_sm120_plugin.kernels.accuracy import EXACT_CLASS_BOUND
from mla_sm120_plugin.types import DECODE, PREFILL, KernelSpec

# What each fault's refusal names (the self-check's words).
CAUGHT = {
    "lse_in_base_2": "max |error|",
    "sink_always_in_lse": "sink-free: max |error|",
    "nan_for_an_empty_row": "NaN",
    "ignores_topk_length": "against float64",
}


def _spec(name: str, priority: int) -> KernelSpec:
    return KernelSpec(name=name, phases=frozenset({PREFILL, DECODE}), kv_cache_dtypes=frozenset({"fp8_ds_mla"}),
                      vendors=frozenset({"nvidia", "cpu"}), entry=f"support.faulty_lse_kernels:{name}", priority=priority,
                      sinks=True, returns_lse=True, accuracy=EXACT_CLASS_BOUND,
                      tolerance=EXACT_CLASS_BOUND.max_rel)


@pytest.fixture
def registry(monkeypatch):
    """A registry of the built-ins but their kernels, with the fault under test and the honest alternate."""

    def make(fault: str):
        class Faulty:
            @hookimpl
            def mla_sm120_kernels(self):
                yield _spec(fault, 10_000)
                yield _spec("honest", 1)

        monkeypatch.setenv(manager.DISABLE_ENV, "mla_sm120.kernels")
        reg = manager.build_registry(load_entry_points=False, extra_plugins={"faulty": Faulty()})
        monkeypatch.setattr(manager, "get_registry", lambda: reg)
        selfcheck.clear_cache()
        return reg

    yield make
    selfcheck.clear_cache()


def _decision(reg, model: str, dcp: int):
    from mla_sm120_plugin.config import Settings
    from mla_sm120_plugin.context import EngineLimits
    from mla_sm120_plugin.device import parse_device
    from mla_sm120_plugin.modelinfo import resolve_model
    from mla_sm120_plugin.plan import plan

    limits = EngineLimits(engine="vllm", tensor_parallel_size=2, decode_context_parallel_size=dcp)
    return plan(resolve_model(model, registry=reg), Settings(), parse_device("12.0", source="--sm"), "fp8_ds_mla",
                limits, registry=reg).decision


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 3 heads a rank (odd), the smallest top-k vLLM's DCP top-k merge ranks
    return write_model(tmp_path_factory.mktemp("hyv4"), "hyv4", index_topk=512, heads=6,
                       layer_types=["deepseek_sparse_attention"] * 2)


@pytest.mark.parametrize("fault", FAULTY)
def test_a_wrong_lse_is_caught_at_init_under_dcp_and_served_without(registry, model, fault):
    reg = registry(fault)
    served = _decision(reg, model, dcp=1)
    assert served.decode == served.prefill == fault
    chosen, line = selfcheck.verify(served, device="cpu", strict=False)
    assert chosen == {DECODE: fault, PREFILL: fault}, line  # no LSE read, no lengths passed: served

    under_dcp = _decision(reg, model, dcp=2)
    assert under_dcp.decode == fault and under_dcp.alternates[DECODE] == ("honest",)
    chosen, line = selfcheck.verify(under_dcp, device="cpu", strict=False)
    assert chosen == {DECODE: "honest", PREFILL: "honest"}, line
    assert f"decode={fault} FAILED" in line and "falling back to honest ok" in line, line
    assert CAUGHT[fault] in line, line
    assert "(base e) <= 0.001" in line  # the LSE the alternate was held to: vLLM's merge base, the exact bound
    with pytest.raises(UnsupportedConfiguration, match=rf"(?s)given: .*dcp=2.*decode kernel {fault} failed its "
                                                       r"self-check.*supported: .*fix: "):
        selfcheck.verify(under_dcp, device="cpu", strict=True)


@pytest.mark.parametrize("size,rank", [(2, 0), (2, 1), (4, 2)])
def test_the_one_sink_rule_puts_a_ranks_own_sinks_on_its_own_heads(size, rank):
    """A call's heads are the DCP group's in rank order: rank r counts the sinks of heads r*H .. r*H+H-1 (its
    own parameter's values), every other head's sink is -inf (another rank counts it)."""
    import torch

    from mla_sm120_plugin.dispatch.dcp import DcpRank, call_sinks
    from mla_sm120_plugin.errors import KernelInputError

    own = torch.tensor([0.5, -1.0, 30.0])
    got = call_sinks(own, DcpRank(size, rank, "e"), 3 * size)
    want = [float("-inf")] * (3 * size)
    want[3 * rank:3 * rank + 3] = [0.5, -1.0, 30.0]
    assert got.tolist() == want and got.dtype == torch.float32
    assert call_sinks(None, DcpRank(size, rank, "e"), 3 * size) is None
    with pytest.raises(KernelInputError, match=r"sinks of shape \(3,\) for a call of 7 heads"):
        call_sinks(own, DcpRank(size, rank, "e"), 7)
