"""The metrics every kernel is measured and bounded in (mla_sm120_plugin.kernels.accuracy)."""

from __future__ import annotations

import math

import pytest
import torch
from support.cli import assert_three_parts

from mla_sm120_plugin.errors import KernelInputError, PluginError
from mla_sm120_plugin.kernels.accuracy import EXACT_COS_DIFF, EXACT_REL_RMS, Accuracy, AccuracyBound, measure


def test_the_metrics_by_hand():
    ref = torch.tensor([[3.0, 4.0]], dtype=torch.float64)  # |ref| = 5
    out = torch.tensor([[3.0, 4.5]])
    got = measure(out, ref)
    assert got.rel_rms == pytest.approx(0.5 / 5)
    assert got.max_rel == pytest.approx(0.5 / 4)
    # 1 - 2 <a, b> / (|a|^2 + |b|^2) = 1 - 2 * 27 / (29.25 + 25)
    assert got.cos_diff == pytest.approx(1 - 54 / 54.25)
    assert measure(ref, ref) == Accuracy(0.0, 0.0, 0.0)


def test_cos_diff_is_about_half_rel_rms_squared_for_small_noise():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(4096, generator=gen, dtype=torch.float64)
    got = measure(ref + 1e-3 * torch.randn(4096, generator=gen, dtype=torch.float64), ref)
    assert got.cos_diff == pytest.approx(got.rel_rms**2 / 2, rel=0.05)


def test_non_finite_output_and_all_zero_references():
    ref = torch.ones(3, dtype=torch.float64)
    for bad in (float("nan"), float("inf")):
        assert measure(torch.tensor([1.0, bad, 1.0]), ref) == Accuracy(math.inf, math.inf, math.inf)
    zeros = torch.zeros(3, dtype=torch.float64)
    assert measure(torch.zeros(3), zeros) == Accuracy(0.0, 0.0, 0.0)
    assert measure(torch.tensor([0.0, 1e-3, 0.0]), zeros) == Accuracy(math.inf, math.inf, math.inf)


def test_shapes_must_match():
    with pytest.raises(KernelInputError) as err:
        measure(torch.zeros(2, 3), torch.zeros(3, 2))
    assert_three_parts(str(err.value))
    assert "given: measure(out (2, 3), ref (3, 2))" in str(err.value)


def test_a_bound_names_each_metric_over_it():
    bound = AccuracyBound(cos_diff=EXACT_COS_DIFF, rel_rms=EXACT_REL_RMS, max_rel=1e-2)
    assert bound.exact_class
    assert bound.violations(Accuracy(EXACT_COS_DIFF, EXACT_REL_RMS, 1e-2)) == []  # the bound itself is within
    over = bound.violations(Accuracy(6e-6, 0.004, 0.02))
    assert over == ["cos_diff 6.00e-06 > 5e-06", "relRMS 0.400% > 0.30%", "max 2.000% > 1.00%"]
    assert bound.violations(Accuracy(math.nan, 0.0, 0.0)) == ["cos_diff nan > 5e-06"]  # NaN is never within
    assert not AccuracyBound(cos_diff=1e-3, rel_rms=EXACT_REL_RMS, max_rel=1e-2).exact_class
    assert not AccuracyBound(cos_diff=EXACT_COS_DIFF, rel_rms=0.01, max_rel=1e-2).exact_class


@pytest.mark.parametrize("value", [0, -1e-3, math.inf, math.nan, True, "1e-3", None])
def test_a_bound_validates_itself(value):
    with pytest.raises(PluginError, match=r"given: AccuracyBound\.rel_rms=.*\nsupported: a finite number > 0") as err:
        AccuracyBound(cos_diff=1e-6, rel_rms=value, max_rel=1e-2)
    assert_three_parts(str(err.value))
