"""A Megatron GPTModel (local spec) runs forward+backward inside the world at TP=1 (DP=2), TP=2
and PP=2, and every layout computes the same loss and gradient norm for the same model and batch."""
from __future__ import annotations

import math

import pytest

from harness.parallel.state import run_in_layout
from harness.probe import ProbeSpec, forward_backward

LAYOUTS = ("tp1", "tp2", "pp2")
# fp32, 4-layer model: measured agreement here is ~1e-7 relative; 1e-5 leaves room for
# reduction-order noise while a wrong shard, a missing DP average or a dropped stage shows as >1e-2.
RTOL = 1e-5


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_backward_runs_in_layout(world, device, layout, reference_runs):
    spec = ProbeSpec()
    results = run_in_layout(world, layout, forward_backward, spec, model=spec)
    first = results[0]
    assert all(r == first for r in results), "every rank must report the same global figures"
    assert math.isfinite(first["loss"]) and first["grad_norm"] > 0
    # Random weights on a 128-token vocabulary: the loss is near ln(128) ~ 4.85, far from 0.
    assert abs(first["loss"] - math.log(spec.vocab_size)) < 1.0
    reference_runs[("probe", layout)] = first


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_layouts_agree_on_loss_and_grad_norm(world, device, layout, reference_runs):
    spec = ProbeSpec()
    reference = reference_runs.get(("probe", "tp1")) or run_in_layout(world, "tp1", forward_backward, spec)[0]
    other = reference_runs.get(("probe", layout)) or run_in_layout(world, layout, forward_backward, spec)[0]
    assert other["loss"] == pytest.approx(reference["loss"], rel=RTOL)
    assert other["grad_norm"] == pytest.approx(reference["grad_norm"], rel=RTOL)


def test_probe_weights_change_the_figures(world_pool):
    """The check can fail: another weight seed must give another loss."""
    world = world_pool.get(2, "cpu")
    a = run_in_layout(world, "tp2", forward_backward, ProbeSpec(seed=0))[0]
    b = run_in_layout(world, "tp2", forward_backward, ProbeSpec(seed=1))[0]
    assert abs(a["loss"] - b["loss"]) > 1e-3


def _probe_after_another_backend(layout, value: str) -> tuple[dict, dict, dict]:
    """Leave the NVTE_* variables as an earlier model of this rank would (megatron-core sets them
    process-wide from a model's attention backend), run the probe, and report them before and after."""
    import os

    from harness.launch.facts import TE_ATTENTION_ENV

    names = TE_ATTENTION_ENV[:3]
    saved = {name: os.environ.get(name) for name in names}
    try:
        for name in names:
            os.environ[name] = value
        before = {name: os.environ.get(name) for name in names}
        result = forward_backward(layout, ProbeSpec())
        return before, {name: os.environ.get(name) for name in names}, result
    finally:
        for name, old in saved.items():
            os.environ.pop(name, None) if old is None else os.environ.__setitem__(name, old)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("value", ["1", "0"], ids=["after-an-auto-backend-model", "after-a-local-backend-model"])
def test_the_probe_runs_whatever_backend_the_ranks_last_model_had(world, device, value):
    """mbridge builds with attention backend "auto" (NVTE_*=1), Megatron-Bridge with "local" (0), and
    megatron-core refuses a model whose backend disagrees with what an earlier one set: the probe
    (local) failed after an mbridge model in the nightly run. It must run after either, and leave the
    variables as it found them (the rank's other models were built with them)."""
    for before, after, result in run_in_layout(world, "tp2", _probe_after_another_backend, value):
        assert after == before and math.isfinite(result["loss"])
