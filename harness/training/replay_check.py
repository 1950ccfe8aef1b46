"""The routing-replay invariants as one check (suites/moe/test_routing_replay.py, `mrh repro` of the
routing-replay variants).

An engine (the HF engine, or vLLM: `engine="vllm"`, on the model's vLLM twin) generates from the
checkpoint's weights and records its routes (harness.rollout.routing); a fresh policy at the same
weights then
  (a) replays routes that share no expert with its own routing in that step (`drifted_everywhere`:
      the case where replay matters most) for a training step: every router's weight gets a
      finite gradient, all zero in no layer (ISEEKYAN/Megatron-LM#79 reads exact zeros there), and
      equal to the gradient of the single-process HF model forced to the same routes within the
      training suite's fp32 bound;
  (b) replays the engine's routes for a training step: the routers route every routed token (all
      real ones but each row's last, which no engine feeds) of every layer exactly as the engine did
      (agreement 1.0; verl #5037 replays another stage's).
`disagreement` measures the trainer's own routing against the engine's without replay (RFC #4168's
figure) and the train-inference logprob mismatch without and with replay (the R3 paper's comparison),
plain measurements, and the agreement with replay on the same weights (exact).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from harness.report import Row
from harness.rollout.engine import Sampling
from harness.tolerance import CheckResult, Judged, Tolerance
from harness.training.tolerances import TABLE as TRAINING

MODEL = "tiny-qwen3-moe"
CONFIG = dict(lr=1e-3, micro_batches=2, routing_replay=True)
SAMPLING = Sampling(n=2, max_tokens=5, seed=3)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

BOUNDS = {
    "routing_agreement": Tolerance("routing_agreement", "any", 1.0, kind="min", ideal=1.0, rationale=(
        "exact: with replay every (real token, layer) top-k set of the trainer is the engine's")),
    "router_grad_zero_layers": Tolerance("router_grad_zero_layers", "any", 0.0, rationale=(
        "exact: no layer's router weight gradient is all zero under a drifted replay")),
    "drifted_shared_experts": Tolerance("drifted_shared_experts", "any", 0.0, rationale=(
        "exact: the drifted replay shares no expert with the router's own pick in the step (the "
        "premise of the router-gradient check)")),
    # The policy's router gradients against the HF model forced to the same routes: the training
    # suite's fp32 bound on a gradient against the same ground truth (its grad norm's). Measured
    # here: 7.4e-7 at tp1, dp2ep2 and pp2, 1.3e-6 at tp2ep2etp1-sp (CPU, stack A).
    "router_grad_rel_diff": TRAINING.get("grad_norm_rel_diff", "fp32"),
    "router_grad_nonfinite": Tolerance("router_grad_nonfinite", "any", 0.0, rationale=(
        "exact: every router weight gradient element is finite")),
}


@dataclass
class ReplayResult(Judged):
    layout: str
    dtype: str
    device: str
    variant: str | None
    model: str
    engine: str = "hf"
    checks: list[CheckResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    router_grad_norm: float = 0.0

    def check(self, metric: str, value: float, detail: str = "") -> None:
        self.judge(metric, value, BOUNDS[metric], f"{metric}={value:g}" + (f" ({detail})" if detail else ""))

    def rows(self, **fields: Any) -> list[Row]:
        return self.check_rows(self.layout, self.model, **fields, variant=self.variant, engine=self.engine)

    def summary(self) -> str:
        what = (f"{self.model} {self.layout} {self.dtype} engine={self.engine}"
                + (f" variant={self.variant}" if self.variant else ""))
        return f"{what}: " + ("; ".join(self.failures) if self.failures else
                              f"replays the engine's routes exactly; router grad norm {self.router_grad_norm:.3g}")


def prompts(vocab_size: int, count: int = 4, seed: int = 7) -> list[list[int]]:
    """`count` prompts of 3..8 random token ids (never 0, the pad id): rows of unequal length, so the
    left padding the trainer moves right is exercised."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (count,), generator=g)
    return [torch.randint(1, vocab_size, (int(n),), generator=g).tolist() for n in lengths]


def rollout_batch(rollouts, seed: int = 0):
    """The rollouts as a training batch: random advantages on the response tokens (what replay must
    get right does not depend on them), the engine's logprobs as the behaviour policy's."""
    from harness.training.rl_data import RLTrainBatch

    batch = rollouts.batch
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randn(batch.batch_size, 1, generator=g).expand(batch.input_ids.shape)
    mask = batch.response_mask & batch.logprob_mask()
    return RLTrainBatch(batch, torch.where(mask, advantages, 0.0), rollouts.logprobs, rollouts.logprobs)


def drifted_everywhere(policy, batch, num_experts: int, variant: str | None = None) -> torch.Tensor:
    """Routes that share no expert with what the policy's router would pick by itself, in every
    layer of the forward that replays them (with `variant`'s arithmetic). Built a layer at a time (a
    replayed layer changes what the later ones see): pass l replays the routes so far and drifts
    layer l from its own pick; the micro-batches are the training step's (`CONFIG`)."""
    from harness.rollout.routing import drifted
    from harness.training.routing_replay import logprobs_with_routes

    def own(routes):
        return logprobs_with_routes(policy, batch, routes, variant, micro_batches=CONFIG["micro_batches"])[2]

    routes = drifted(own(None), num_experts)
    for layer in range(1, routes.shape[2]):
        routes = torch.cat([routes[:, :, :layer], drifted(own(routes), num_experts)[:, :, layer:]], dim=2)
    return routes


def shared_experts(routes: torch.Tensor, own: torch.Tensor, real: torch.Tensor) -> float:
    """The fraction of (real token, MoE layer) pairs whose replayed top-k shares an expert with the
    router's own pick (a dense layer's PAD rows match each other and mean nothing)."""
    from harness.rollout.routing import routed_layers

    overlap = (routes.unsqueeze(-1) == own.unsqueeze(-2)).any(-1).any(-1)  # [B, S, L]
    return float(overlap[real][:, routed_layers(routes, own)].float().mean())


def ground_truth_router_grads(model: str, train_batch, routes: torch.Tensor) -> dict[int, torch.Tensor]:
    """The router weight gradients of the same loss on the single-process HF model (fp32, one row at a
    time as harness.training.ground_truth runs it) with its routers forced to `routes`."""
    from harness.models import build_hf_model, resolve_model
    from harness.rollout.routing import forced_routes, hf_routers
    from harness.training.ground_truth import policy_logprobs
    from harness.training.loss import loss_counts, rl_loss

    hf = build_hf_model(resolve_model(model))
    tokens, seqs = loss_counts(train_batch)
    for row, part in enumerate(train_batch.split(train_batch.batch_size)):
        with forced_routes(hf, routes[row]):
            logprobs = policy_logprobs(hf, part)
        loss, _ = rl_loss(logprobs, part, global_token_count=tokens, global_seq_count=seqs)
        loss.backward()
    return {layer: router.weight.grad.detach().clone() for layer, router in hf_routers(hf).items()}


def relative_difference(grads: dict[int, torch.Tensor], truth: dict[int, torch.Tensor]) -> float:
    """||grads - truth|| / ||truth|| over every layer's router gradient together."""
    if sorted(grads) != sorted(truth):
        raise ValueError(f"router grads of layers {sorted(grads)} against {sorted(truth)}")
    diff = torch.cat([(grads[k].double() - truth[k].double()).flatten() for k in truth])
    return float(diff.norm() / torch.cat([t.double().flatten() for t in truth.values()]).norm())


def engine_model(engine: str, model: str) -> str:
    """The model an engine runs the check on: vLLM on CPU takes no head_dim below 32, so a tiny model
    runs as its vLLM twin (harness.rollout.vllm_engine.VLLM_TWINS); the policy is built on the same."""
    from harness.rollout.vllm_engine import VLLM_TWINS

    return VLLM_TWINS.get(model, model) if engine == "vllm" else model


def open_routing_engine(engine: str, model: str, dtype: str, device: str):
    """An engine (harness.rollout.engines: vLLM's is shared, reset to the checkpoint) at the checkpoint's
    weights that records routes."""
    from harness.rollout.engines import open_engine

    return open_engine(engine, model, dtype=DTYPES[dtype], device="cuda" if device == "cuda" else "cpu", routing=True)


def replay_check(make_policy: Callable[..., Any], layout: str, dtype: str = "fp32", *, variant: str | None = None,
                 device: str = "cpu", model: str = MODEL, engine: str = "hf") -> ReplayResult:
    """(a) and (b) on a fresh policy and an engine (`engine`: "hf" or "vllm") at the checkpoint's
    weights; closes the policy."""
    from harness.bridge.preflight import num_experts
    from harness.models import load_hf_config
    from harness.parallel.layout import parse_layout
    from harness.rollout.routing import routing_agreement
    from harness.training.routing_replay import train_with_routes
    from harness.variants import require

    if dtype != "fp32":
        raise ValueError(f"the routing-replay check runs in fp32 (its router-gradient ground truth is the fp32 "
                         f"HF model), not {dtype}")
    from harness.rl.loop import require_experts

    model = engine_model(engine, model)
    config = load_hf_config(model)
    require_experts(model, config)  # one error for what cannot replay (a dense model, a family the bridge refuses)
    require(variant, check="routing-replay", layout=parse_layout(str(layout)), config=config)
    result = ReplayResult(str(layout), dtype, device, variant, model, engine)
    rollouts = open_routing_engine(engine, model, dtype, device).generate(prompts(config.vocab_size), SAMPLING,
                                                                          routing=True)
    real = rollouts.batch.attention_mask
    train_batch = rollout_batch(rollouts)
    policy = make_policy(layout, model, **CONFIG, dtype=dtype)
    try:
        away = drifted_everywhere(policy, rollouts.batch, num_experts(config), variant)
        step = train_with_routes(policy, train_batch, away, variant)
        result.check("drifted_shared_experts", shared_experts(away, step["own"], real))
        grads = step["grads"]
        result.router_grad_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
        zero = [layer for layer, g in grads.items() if not bool(g.ne(0).any())]
        result.check("router_grad_zero_layers", len(zero), f"layers {zero}" if zero else "")
        result.check("router_grad_nonfinite", int(sum((~torch.isfinite(g)).sum() for g in grads.values())))
        truth = ground_truth_router_grads(model, train_batch, away)
        result.check("router_grad_rel_diff", relative_difference(grads, truth))
        replayed = train_with_routes(policy, train_batch, rollouts.routing, variant)["routes"]
        result.check("routing_agreement", routing_agreement(rollouts.routing, replayed, real))
    finally:
        policy.close()
    return result


def disagreement(make_policy: Callable[..., Any], layout: str, dtype: str, *, model: str = MODEL,
                 device: str = "cpu", engine: str = "hf") -> dict[str, Any]:
    """Engine (`engine`: "hf" or "vllm") and trainer at the checkpoint's weights in `dtype`, the
    trainer's logprob forward on the engine's rollouts: without replay, the fraction of (routed
    token, layer) top-k sets where its own routing differs from the engine's, and of routed tokens
    routed differently in at least one layer (RFC #4168's two figures); with replay, the agreement
    (1.0 when replay works). `mismatch` and `mismatch_r3`: the engine's logprobs of its samples
    against the trainer's without and with replay (harness.rollout.mismatch.mismatch_metrics)."""
    from harness.models import load_hf_config
    from harness.rollout.mismatch import mismatch_metrics
    from harness.rollout.routing import routed_layers, routed_positions, routing_agreement
    from harness.training.routing_replay import logprobs_with_routes

    model = engine_model(engine, model)
    config = load_hf_config(model)
    rollouts = open_routing_engine(engine, model, dtype, device).generate(prompts(config.vocab_size, count=8),
                                                                          SAMPLING, routing=True)
    policy = make_policy(layout, model, dtype=dtype, routing_replay=True)
    try:
        own_logprobs, mine, _ = logprobs_with_routes(policy, rollouts.batch, None)
        replayed_logprobs, replayed, _ = logprobs_with_routes(policy, rollouts.batch, rollouts.routing)
    finally:
        policy.close()
    real = rollouts.batch.attention_mask
    routed = routed_positions(real)
    differs = (rollouts.routing.sort(-1).values != mine.sort(-1).values).any(-1)  # [B, S, L]
    differs = differs[:, :, routed_layers(rollouts.routing, mine)]  # MoE layers only
    sampled = rollouts.batch.response_mask
    engine_logprobs = rollouts.logprobs.cpu()
    return {"model": model, "routing_disagreement": float(differs[routed].float().mean()),
            "tokens_routed_differently": float(differs.any(-1)[routed].float().mean()),
            "routed_pairs": int(differs[routed].numel()),
            "routing_agreement": routing_agreement(rollouts.routing, replayed, real),
            "mismatch": mismatch_metrics(engine_logprobs, own_logprobs.cpu(), sampled),
            "mismatch_r3": mismatch_metrics(engine_logprobs, replayed_logprobs.cpu(), sampled)}
