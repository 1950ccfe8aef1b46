"""Rollout routing replay (R3): the HF engine records every token's top-k experts per global layer
while it generates; the policy's routers replay them through megatron-core's RouterReplay
(`moe_enable_routing_replay`) on whatever tokens and layers each rank holds (harness.training.
routing_replay). With replay the trainer routes every real token of every layer exactly as the engine
did (agreement 1.0), and a replay that drifts from the trainer's own routing still gives every router
a finite, non-zero gradient (harness.training.replay_check). Without replay the trainer's own routing
is measured against the engine's (RFC #4168's figure). The catalog's routing-replay variants
(ISEEKYAN/Megatron-LM#79, verl #5037) fail the same check at pp2 with the fixed path passing:
suites/sensitivity (CI). The GRPO loop runs with replay on (`mrh loop --routing-replay`).

CI runs the loop at dp2ep2 (and the sensitivity cases at pp2); the check at the other layouts and
the disagreement measurement run nightly.
"""
from __future__ import annotations

import pytest

from harness.training.replay_check import MODEL, disagreement, replay_check


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "dp2ep2", "pp2", "pp2vpp2", "tp2ep2etp1-sp"], cuda=["tp1", "dp2ep2", "pp2"])
def test_replay_routes_as_the_engine_did_and_routers_get_gradients(policy, device, layout, report):
    result = replay_check(policy, layout, "fp32", device=device)
    report.extend(result.rows())
    assert result.passed, result.summary()


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["dp2ep2"], cuda=["tp1"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_without_replay_the_trainer_routes_otherwise_and_replay_closes_it(policy, device, layout, dtype, report):
    """The disagreement without replay is a measurement (a row, no bound); replay on the same
    weights and tokens must bring the agreement to exactly 1.0."""
    figures = disagreement(policy, layout, dtype, device=device)
    for metric in ("routing_disagreement", "tokens_routed_differently"):
        report.add(metric, figures[metric], tolerance=None, passed=True, claim="observed", layout=layout,
                   model=MODEL, dtype=dtype, pairs=figures["routed_pairs"])
    agreement = figures["routing_agreement"]
    report.add("routing_agreement", agreement, tolerance=1.0, passed=agreement == 1.0, claim="exact", layout=layout,
               model=MODEL, dtype=dtype, tolerance_kind="min")
    assert agreement == 1.0, figures


@pytest.mark.layouts(cpu=["dp2ep2"], cuda=["tp1", "dp2ep2"])
def test_the_rl_loop_runs_with_routing_replay(rl_loop, device, layout, report):
    loop = rl_loop(layout, MODEL, iterations=2, routing_replay=True)
    history = loop.run()
    loop.close()
    for h in history:
        report.add("routing_agreement", h.routing_agreement, tolerance=1.0, passed=h.routing_agreement == 1.0,
                   claim="exact", layout=layout, model=MODEL, iteration=h.iteration, tolerance_kind="min")
    assert [h.routing_agreement for h in history] == [1.0, 1.0]
    assert all(h.grad_norm > 0 for h in history)


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny-qwen3"], "needs a Mixture-of-Experts model: tiny-qwen3 is dense"),
    (["--model", MODEL, "--engine", "vllm"], "the HF engine records them"),
])
def test_routing_replay_with_what_cannot_replay_is_one_error_before_any_rank(args, message, capsys, tmp_path):
    from harness.cli import main

    assert main(["loop", "--device", "cpu", "--routing-replay", "--out", str(tmp_path / "r"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
