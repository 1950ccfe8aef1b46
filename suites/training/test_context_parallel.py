"""Context parallelism everywhere past the forward (issue 36, item 3): reshard-resume between a CP
layout and the others, weight sync from a CP layout, the offload round trip and the RL loop at cp2,
and a MoE model with experts over the DP x CP ranks. Each runs the suite's own check (the same code
as its layouts sweep) on both CP attentions: TE's on CUDA in bf16 (its only CP dtype), and the local
spec's gathered-kv attention (harness.parallel.cp_attention) on the CPU tier in fp32, held to the fp32
bounds. Parity and the training step against the ground truth at CP are
suites/parity/test_context_parallel.py and suites/training/test_policy.py.
"""
from __future__ import annotations

import pytest

NIGHTLY = pytest.mark.nightly


def _dtype(spec: str) -> str:
    """TE's CP attention is fp16/bf16 only; the local spec's runs fp32 (the sharper check)."""
    return "bf16" if spec == "te" else "fp32"


@pytest.mark.layout_pairs(cpu=[("cp2", "tp2"), ("pp2", "cp2"), pytest.param("cp2", "dp2", marks=NIGHTLY),
                            pytest.param("dp2", "cp2", marks=NIGHTLY)],
                       cuda=[("cp2", "dp2"), ("dp2", "cp2"), ("cp2", "tp2"), ("pp2", "cp2"),  # 4 GPUs:
                             ("cp2tp2", "tp2pp2"), ("tp2pp2", "cp2tp2"), ("cp4", "dp4"), ("cp2dp2", "cp4")])
def test_a_cp_checkpoint_resumes_at_another_layout_and_back(policy, device, spec, source, target, tmp_path, report):
    """A CP rank holds whole weights, as a DP rank does: the checkpoint reshards as between any two
    layouts, and the next step equals the uninterrupted one's within the resume bounds of its dtype."""
    from harness.checkpoint.resume_check import resume_and_compare, train_and_save

    src = train_and_save(policy, source, tmp_path / "ckpt", dtype=_dtype(spec))
    result = resume_and_compare(policy, src, target)
    report.extend(result.rows())
    assert result.passed, result.summary()
    assert (result.load["steps_done"], result.load["consumed_samples"]) == (2, 16)


@pytest.mark.layouts(cpu=["cp2"], cuda=["cp2", "cp2tp2", "cp4"])
def test_a_synced_engine_equals_the_policy_trained_under_cp(policy, device, spec, layout, report):
    from harness.rollout.check import sync_check

    result = sync_check(policy, layout, _dtype(spec), device=device)
    report.extend(result.rows())
    assert result.passed, result.summary()


@pytest.mark.layouts(cpu=["cp2"], cuda=["cp2", "cp2dp2"])
def test_offload_round_trip_under_cp(policy, device, spec, layout, report):
    from harness.offload.check import round_trip

    result = round_trip(policy, layout, _dtype(spec), device=device)
    report.extend(result.rows())
    assert result.passed, result.summary()


@pytest.mark.layouts(cpu=[pytest.param("cp2", marks=NIGHTLY)], cuda=["cp2"])
def test_the_rl_loop_runs_under_cp_and_follows_dp2(rl_loop, device, spec, layout, report):
    """The loop at cp2 samples the same first rollouts as at dp2 (the same weights) and trains: the
    engine's tokens of iteration 0 are equal; after that bf16 steps may part the trajectories."""
    runs = {}
    for name in ("dp2", layout):
        loop = rl_loop(name, "tiny-qwen3", iterations=2, dtype=_dtype(spec))
        runs[name] = loop.run()
        loop.close()
        for h in runs[name]:
            report.add("grad_norm", h.grad_norm, tolerance=None, passed=True, claim="observed", layout=name,
                       model="tiny-qwen3", dtype=_dtype(spec), iteration=h.iteration)
    assert runs[layout][0].tokens == runs["dp2"][0].tokens
    assert all(h.grad_norm > 0 for h in runs[layout])


@pytest.mark.layouts(cpu=["cp2ep2"], cuda=["cp2ep2"])
@pytest.mark.parametrize("clip", ["ratio-clip", pytest.param("unclipped", marks=NIGHTLY)])
def test_a_moe_policy_steps_under_cp_with_experts_over_dp_x_cp(policy, device, spec, layout, clip, report):
    """ep carved out of DP x CP (Megatron's expert layout: the two CP ranks hold one expert each and
    exchange their tokens): both steps equal the ground truth's within the bounds of the dtype.
    On the CPU tier in fp32 (gathered-kv attention) both steps are within 1e-6 (grad norm 8e-7): the
    CP x EP path itself (the feed, the dispatch across CP ranks, the loss, the reductions) is exact.
    In bf16 (TE, CUDA) the ratio clip makes step 2 a cliff, not a bound: the ground truth's step 2 clips 71
    of 95 loss tokens, and one token whose bf16 ratio lands on the other side of the clip boundary takes its
    whole share of the gradient with it (4x H100, stack A, da99309: clip fraction 0.7579 vs 0.7474, one
    token, grad norm 17.7% off; stack B 17.1%; CPU bf16: one token, 3-5%). So bf16 runs `unclipped` (the
    same steps with the ratio clip out of reach, harness.training.invariance.UNCLIPPED, against a ground
    truth trained so): rounding alone, which passes on CUDA (same run). docs/context-parallel.md."""
    from harness.training.invariance import LOSS, UNCLIPPED
    from suites.training.test_policy import _check

    if clip == "ratio-clip" and _dtype(spec) == "bf16":
        pytest.skip("bf16 with the ratio clip: one token across the clip boundary moves step 2's grad norm by "
                    "its whole share (17.7%, 4x H100, da99309); bf16 is held by the unclipped case")
    _check(policy, layout, report, model="tiny-qwen3-moe", dtype=_dtype(spec),
           loss=UNCLIPPED if clip == "unclipped" else LOSS)


@pytest.mark.layouts(cpu=["cp2ep2"], cuda=["cp2ep2"])
def test_a_moe_step_under_cp_replaying_the_ground_truths_routes_tracks_it(policy, device, spec, layout, report):
    """Routing replay (R3) under CP, the way an RL trainer replays the rollout engine's routes: the first
    step routes by itself, the second replays the routes the ground truth's routers took for its second
    step. Both steps' loss and grad norm within the bounds of the dtype, and the replay taken exactly.
    The routes the policy would have picked by itself at the second step are a row (how far its own
    routing drifted from the ground truth's after one update in this dtype). In bf16 the steps run without
    the ratio clip (UNCLIPPED: the previous test says why; stack A on TE with the clip: 16.1% at step 2
    though every replayed route was taken), in fp32 with it."""
    from harness.rollout.routing import routing_agreement
    from harness.tolerance import CheckResult
    from harness.training.invariance import LOSS, UNCLIPPED, ground_truth, ground_truth_routes, policy_config
    from harness.training.routing_replay import train_with_routes
    from harness.training.tolerances import training_tolerance

    model, dtype = "tiny-qwen3-moe", _dtype(spec)
    loss = UNCLIPPED if dtype == "bf16" else LOSS
    batches, expected, _ = ground_truth(model, loss)
    truth = ground_truth_routes(model, 1)  # step 1's update clips nothing (its ratios are within 2%): either loss
    worker = policy(layout, model, **policy_config(micro_batches=2, dtype=dtype, loss=loss), routing_replay=True)
    first = train_with_routes(worker, batches[0], None)["stats"]
    second = train_with_routes(worker, batches[1], truth)
    real = batches[1].batch.attention_mask.bool()
    own = routing_agreement(truth, second["own"], real)
    report.add("own_routing_agreement_step_1", own, tolerance=None, passed=True, claim="observed", layout=str(layout),
               model=model, dtype=dtype)
    taken = routing_agreement(truth, second["routes"], real)
    report.add("replayed_routing_agreement", taken, tolerance=1.0, passed=taken == 1.0, claim="exact", layout=str(layout),
               model=model, dtype=dtype)
    assert taken == 1.0, f"the routers took {taken:.4f} of the replayed routes"
    for step, (got, want) in enumerate(zip((first, second["stats"]), expected)):
        for key in ("loss", "grad_norm"):
            value = abs(got[key] - want[key]) / max(abs(want[key]), 1.0)
            check = CheckResult.judge(f"{key}_rel_diff", value, training_tolerance(f"{key}_rel_diff", dtype))
            report.add(check.metric, value, tolerance=check.tolerance.limit, passed=check.passed, claim=check.claim,
                       layout=str(layout), model=model, dtype=dtype, step=step)
            assert check.passed, f"step {step} {key}: {got[key]!r} vs ground truth {want[key]!r}"


@pytest.mark.layouts(cuda=["cp2"])
def test_a_cp_policy_is_refused_before_any_rank_builds_it_where_cp_cannot_run(policy, device, spec, layout):
    """TE on CUDA has no CP attention in fp32: the policy (and the reference) refuse in one line,
    before any rank builds anything. (The local spec runs CP in every dtype.)"""
    from harness.parallel.layout import CP_FP32, LayoutError

    if spec != "te":
        pytest.skip("the local spec runs CP in fp32 (test_a_moe_policy_steps_under_cp...)")
    with pytest.raises(LayoutError, match="context parallelism") as caught:
        policy(layout, "tiny-qwen3", dtype="fp32")
    assert CP_FP32 in str(caught.value)
