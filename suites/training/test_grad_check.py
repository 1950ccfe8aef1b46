"""harness.training.grad_check without a world: the ratio it judges, and the layouts it refuses."""
from __future__ import annotations

import pytest

from harness.training.grad_check import FP32_ROUNDOFF, GradientComparison, bound, policy_gradients


def test_the_ratio_floors_hfs_own_distance_at_fp32s_roundoff():
    result = GradientComparison("tp1", "m", policy_error={"a": 3e-6, "b": 1e-7}, hf_fp32_error={"a": 1e-6, "b": 0.0})
    assert result.ratio("a") == pytest.approx(3.0)
    assert result.ratio("b") == pytest.approx(1e-7 / FP32_ROUNDOFF)  # HF exact there: judged against one rounding
    assert result.worst == "a" and result.passed == bound().passes(3.0)
    result.policy_error["a"] = 2 * bound().limit * 1e-6
    assert not result.passed and "a policy" in result.summary()


class _Handle:
    def __init__(self, layout):
        from harness.parallel import parse_layout

        self.layout = parse_layout(layout)

    def begin_step(self, _):
        raise AssertionError("a refused layout must not start a step")


@pytest.mark.parametrize("layout", ["dp2", "dp2ep2", "tp2etp1-sp"])
def test_a_layout_whose_gradients_are_sharded_over_data_parallel_ranks_is_refused(layout):
    with pytest.raises(ValueError, match="data parallel 1 and expert data parallel 1"):
        policy_gradients(_Handle(layout), None)


def test_a_model_with_zero_centered_norms_is_refused_before_any_work():
    from harness.training.grad_check import compare_gradients_to_float64

    with pytest.raises(ValueError, match="zero-centered"):
        compare_gradients_to_float64(_Handle("tp1"), "tiny-gemma3")
