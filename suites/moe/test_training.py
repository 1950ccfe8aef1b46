"""Training a Mixture-of-Experts policy is invariant to the expert layout: loss, grad norm (every
expert's gradient in it) and the updated weights of every expert equal the single-process HF ground
truth's, whether the experts sit on one rank, are split over ranks (ep), or split their own width
(etp). CI runs the two expert-parallel layouts; the nightly run the others too."""
from __future__ import annotations

import pytest

from suites.training.test_policy import _check

MODEL = "tiny-qwen3-moe"
EXPERT_PARALLEL = ["dp2ep2", "tp2ep2etp1-sp"]


@pytest.mark.layouts(cpu=EXPERT_PARALLEL, cuda=["tp1"])
def test_moe_policy_steps_match_ground_truth(policy, device, layout, report):
    _check(policy, layout, report, model=MODEL)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "pp2", "tp2-sp"])
def test_moe_policy_steps_match_ground_truth_without_expert_parallelism(policy, device, layout, report):
    _check(policy, layout, report, model=MODEL)
