"""Weight sync from expert-parallel layouts: after a training step and a sync the HF engine holds the
MoE policy's exported weights bit for bit, its logprobs of its own samples match the trainer's, and a
second sync changes nothing (harness.rollout.check) - with buckets small enough that a layer's experts
of one projection (an expert group, what a grouped export fuses) straddle bucket boundaries. A grouped
export that drops such a group (SkyRL PR 1471) is the catalog's `sync-expert-group-split`, caught in
suites/sensitivity."""
from __future__ import annotations

from collections import defaultdict

import pytest

from harness.rollout.check import sync_check
from harness.rollout.sync import expert_group
from harness.pytest_plugin.worlds import skip_unless_converted
from suites.rollout.test_sync import _record

MODEL = "tiny-qwen3-moe"


def straddling_groups(report) -> list[str]:
    """The expert groups whose tensors went out in more than one bucket."""
    where, start = defaultdict(set), 0
    for index, count in enumerate(report.bucket_tensors):
        for name in report.names[start:start + count]:
            if expert_group(name):
                where[expert_group(name)].add(index)
        start += count
    return sorted(group for group, buckets in where.items() if len(buckets) > 1)


@pytest.mark.layouts(cpu=["tp2ep2etp1-sp"], cuda=["tp1", "tp2ep2etp1-sp"])
def test_a_synced_engine_equals_the_trained_moe_policy(policy, device, layout, report):
    result = sync_check(policy, layout, "fp32", device=device, model=MODEL)
    _record(report, result)
    assert result.passed, result.summary()
    assert straddling_groups(result.report), "no expert group straddles a bucket boundary: buckets too large"


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["dp2ep2", "tp2-sp", "pp2"])
def test_a_synced_engine_equals_the_trained_moe_policy_elsewhere(policy, device, layout, report):
    test_a_synced_engine_equals_the_trained_moe_policy(policy, device, layout, report)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp2ep2etp1-sp"])
def test_a_synced_engine_equals_the_trained_qwen2_moe_policy(policy, device, layout, report):
    """Qwen2-MoE (stack A only): the shared expert and its gate sync with the routed experts."""
    skip_unless_converted("tiny-qwen2-moe")
    result = sync_check(policy, layout, "fp32", device=device, model="tiny-qwen2-moe")
    _record(report, result)
    assert result.passed, result.summary()
    assert straddling_groups(result.report), "no expert group straddles a bucket boundary: buckets too large"


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp2ep2etp1-sp", "pp2"])
def test_a_synced_engine_equals_the_trained_glm4_moe_policy(policy, device, layout, report):
    """GLM-4.5-MoE (stack A only): the dense first layer, the shared expert and the routers' expert bias (a
    buffer, which mbridge exports from the state dict) sync with the routed experts."""
    skip_unless_converted("tiny-glm4-moe")
    result = sync_check(policy, layout, "fp32", device=device, model="tiny-glm4-moe")
    _record(report, result)
    assert result.passed, result.summary()
    assert any(name.endswith("e_score_correction_bias") for name in result.report.names), \
        "the routers' expert bias was never sent"
    assert straddling_groups(result.report), "no expert group straddles a bucket boundary: buckets too large"


@pytest.mark.layouts(cpu=["tp2ep2etp1-sp"])
def test_a_synced_engine_equals_the_trained_gpt_oss_policy(policy, device, layout, report):
    """gpt-oss (stack B only): the sinks, the expert biases and the fused HF expert tensors (one tensor per
    layer and projection, exported from the experts of every EP rank) sync with the rest."""
    skip_unless_converted("tiny-gpt-oss")
    result = sync_check(policy, layout, "fp32", device=device, model="tiny-gpt-oss")
    _record(report, result)
    assert result.passed, result.summary()


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp2ep2etp1-sp"])
def test_a_synced_engine_equals_the_trained_deepseek_v3_policy(policy, device, layout, report):
    """DeepSeek-V3 (both stacks): MLA, the dense first layer, the expert bias and the shared experts sync
    into the HF engine with the routed experts."""
    skip_unless_converted("tiny-deepseek-v3")
    result = sync_check(policy, layout, "fp32", device=device, model="tiny-deepseek-v3")
    _record(report, result)
    assert result.passed, result.summary()
