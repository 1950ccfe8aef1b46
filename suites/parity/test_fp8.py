"""An FP8 forward (Transformer Engine, delayed or current scaling) moves the logprobs of the same
weights by no more than FP8's measured rounding, and FP8 is refused where it cannot run
(harness.parity.fp8). The catalog's `fp8-stale-amax` control runs in suites/sensitivity."""
from __future__ import annotations

import pytest

from harness.parity.fp8 import RECIPES, Fp8Case, Fp8Error, run_fp8

FP8_MODELS = ["tiny-qwen3", "tiny-qwen2", "tiny-llama"]


@pytest.mark.layouts(cpu=[], cuda=["tp1"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model", FP8_MODELS)
def test_fp8_logprobs_stay_within_fp8_rounding_of_bf16(world, spec, layout, model, recipe, report):
    if spec != "te":
        pytest.skip("FP8 runs on Transformer Engine's layer spec only (the local spec has no FP8 GEMMs)")
    result = run_fp8(world, Fp8Case(model, layout, recipe), test=report.test)
    report.extend(result.rows)
    assert result.passed, result.summary()


@pytest.mark.parametrize("recipe, message", [("delayed", "CUDA only"), ("mxfp8", "unknown FP8 recipe")])
def test_fp8_where_it_cannot_run_is_one_clear_error_before_any_work(world_pool, recipe, message):
    """On the CPU tier (the local spec): refused in the parent, no rank called."""
    world = world_pool.get(1, "cpu")
    calls = world.calls
    with pytest.raises(Fp8Error, match=message):
        run_fp8(world, Fp8Case("tiny-qwen3", "tp1", recipe))
    assert world.calls == calls
