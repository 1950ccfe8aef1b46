"""Context parallelism everywhere past the forward (issue 36, item 3): reshard-resume between a CP
layout and the others, weight sync from a CP layout, the offload round trip and the RL loop at cp2,
and a MoE model with experts over the DP x CP ranks. Each runs the suite's own check (the same code
as its layouts sweep), in bf16 on CUDA with TE's spec: the only place CP runs
(harness.parallel.layout.check_backend). Parity and the training step against the ground truth at CP
are suites/parity/test_context_parallel.py and suites/training/test_policy.py.
"""
from __future__ import annotations

import pytest

from harness.parallel.layout import CP_BACKEND


def _te(spec: str) -> None:
    if spec != "te":
        pytest.skip(CP_BACKEND)


@pytest.mark.layout_pairs(cuda=[("cp2", "dp2"), ("dp2", "cp2"), ("cp2", "tp2"), ("pp2", "cp2")])
def test_a_cp_checkpoint_resumes_at_another_layout_and_back(policy, device, spec, source, target, tmp_path, report):
    """A CP rank holds whole weights, as a DP rank does: the checkpoint reshards as between any two
    layouts, and the next step equals the uninterrupted one's within the bf16 resume bounds."""
    from harness.checkpoint.resume_check import resume_and_compare, train_and_save

    _te(spec)
    src = train_and_save(policy, source, tmp_path / "ckpt", dtype="bf16")
    result = resume_and_compare(policy, src, target)
    report.extend(result.rows())
    assert result.passed, result.summary()
    assert (result.load["steps_done"], result.load["consumed_samples"]) == (2, 16)


@pytest.mark.layouts(cuda=["cp2"])
def test_a_synced_engine_equals_the_policy_trained_under_cp(policy, device, spec, layout, report):
    from harness.rollout.check import sync_check

    _te(spec)
    result = sync_check(policy, layout, "bf16", device=device)
    report.extend(result.rows())
    assert result.passed, result.summary()


@pytest.mark.layouts(cuda=["cp2"])
def test_offload_round_trip_under_cp(policy, device, spec, layout, report):
    from harness.offload.check import round_trip

    _te(spec)
    result = round_trip(policy, layout, "bf16", device=device)
    report.extend(result.rows())
    assert result.passed, result.summary()


@pytest.mark.layouts(cuda=["cp2"])
def test_the_rl_loop_runs_under_cp_and_follows_dp2(rl_loop, device, spec, layout, report):
    """The loop at cp2 samples the same first rollouts as at dp2 (the same weights) and trains: the
    engine's tokens of iteration 0 are equal; after that bf16 steps may part the trajectories."""
    _te(spec)
    runs = {}
    for name in ("dp2", layout):
        loop = rl_loop(name, "tiny-qwen3", iterations=2, dtype="bf16")
        runs[name] = loop.run()
        loop.close()
        for h in runs[name]:
            report.add("grad_norm", h.grad_norm, tolerance=None, passed=True, claim="observed", layout=name,
                       model="tiny-qwen3", dtype="bf16", iteration=h.iteration)
    assert runs[layout][0].tokens == runs["dp2"][0].tokens
    assert all(h.grad_norm > 0 for h in runs[layout])


@pytest.mark.layouts(cuda=["cp2ep2"])
def test_a_moe_policy_steps_under_cp_with_experts_over_dp_x_cp(policy, device, spec, layout, report):
    """ep carved out of DP x CP (Megatron's expert layout: the two CP ranks hold one expert each and
    exchange their tokens): both steps equal the ground truth's within the bf16 training bounds.
    Open (2x H200, f893bdc): the first step's grad norm is within 0.9%, the second's 18% off, while
    dp2ep2 in bf16 is within 0.024% at the second step and dense cp2 passes both: not explained yet."""
    from suites.training.test_policy import _check

    _te(spec)
    _check(policy, layout, report, model="tiny-qwen3-moe", dtype="bf16")


@pytest.mark.layouts(cpu=["cp2"], cuda=["cp2"])
def test_a_cp_policy_is_refused_before_any_rank_builds_it_where_cp_cannot_run(policy, device, spec, layout):
    """The CPU tier and the local spec have no CP attention; TE on CUDA has none in fp32: the policy
    (and the reference) refuse in one line, before any rank builds anything."""
    from harness.parallel.layout import CP_FP32, LayoutError

    expected = CP_FP32 if (device, spec) == ("cuda", "te") else CP_BACKEND
    with pytest.raises(LayoutError, match="context parallelism") as caught:
        policy(layout, "tiny-qwen3", dtype="fp32")
    assert expected in str(caught.value)
