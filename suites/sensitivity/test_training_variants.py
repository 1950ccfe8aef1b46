"""Every training variant of the catalog fails the training-invariance check (Megatron steps vs
the single-process ground truth, harness.training.invariance) in fp32 and in bf16, under data,
tensor and pipeline parallelism wherever it can show, by at least SENSITIVITY_MARGIN; each run's
margin is a report row ("separation")."""
from __future__ import annotations

import pytest

from harness.models import load_hf_config, resolve_model
from harness.parallel.layout import parse_layout
from harness.tolerance import SENSITIVITY_MARGIN
from harness.training.invariance import MODEL, compare_to_ground_truth, policy_config
from harness.variants import for_components, get

TRAINING_VARIANTS = [v.id for v in for_components("training")]
LAYOUTS = ["dp2", "tp2", "pp2"]


@pytest.mark.layouts(cpu=LAYOUTS, cuda=LAYOUTS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", TRAINING_VARIANTS)
def test_training_variant_fails_by_a_margin(policy, device, layout, dtype, variant, report):
    why_not = get(variant).why_not(parse_layout(layout), load_hf_config(resolve_model(MODEL)))
    if why_not:
        pytest.skip(why_not)
    worker = policy(layout, MODEL, **policy_config(dtype=dtype, variant=variant))
    result = compare_to_ground_truth(worker)
    report.extend(result.rows(MODEL))
    worst = max((c for _, c in result.checks), key=lambda c: c.margin)
    ok = result.separation >= SENSITIVITY_MARGIN
    report.add("separation", result.separation, tolerance=SENSITIVITY_MARGIN, passed=ok, layout=layout,
               model=MODEL, dtype=dtype, device=device, variant=variant, worst_metric=worst.metric,
               tolerance_kind="min")
    assert not result.passed, f"variant {variant} went unnoticed: {result.summary()}"
    assert ok, result.summary()
