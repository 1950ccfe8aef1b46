"""Rollout routing replay (R3): which experts each token went to, recorded by the engine, compared.

A MoE model's routing over a batch is an int64 tensor ``[B, S, L, K]`` aligned with the batch's rows:
for row b, column s and GLOBAL layer l (0-based, the HF checkpoint's ``model.layers.{l}``), the K
experts the router chose for that token, in the router's order; ``PAD`` (-1) where column s is a pad.
Global layer indices are what keeps the trainer aligned under pipeline parallelism (verl #5037: a
stage that reads the routes by its own local layer index replays another stage's routes).

The HF engine records while it generates (`RoutingRecorder`): the prefill routes the prompt, each
decode step the token it feeds, and one more step the last sampled token, which generation never
feeds back. The trainer's side (megatron-core's RouterReplay fed these routes) is
`harness.training.routing_replay`.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

import torch

PAD = -1
_GATE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


def hf_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Every MoE layer's router of an HF model (transformers 5: ``model.layers.{l}.mlp.gate``, a
    module returning ``(logits, weights, indices)``), by global layer index."""
    found = {int(m.group(1)): module for name, module in model.named_modules() if (m := _GATE.search(name))}
    if not found:
        raise ValueError(f"{type(model).__name__} has no MoE routers (model.layers.N.mlp.gate): routing is "
                         "recorded and replayed for Mixture-of-Experts models only")
    return dict(sorted(found.items()))


class RoutingRecorder:
    """Forward hooks on an HF model's routers for the duration of a `with`: every call's top-k
    indices per layer, in call order. `routes(batch_size, real)` assembles them along the sequence."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = hf_routers(model)
        self.calls: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.routers}
        self._hooks: list = []

    def __enter__(self) -> "RoutingRecorder":
        for layer, router in self.routers.items():
            self._hooks.append(router.register_forward_hook(self._keep(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _keep(self, layer: int):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3 and not output[2].is_floating_point()):
                raise TypeError(f"layer {layer}'s router returned {type(output).__name__}, not (logits, "
                                "weights, indices): this transformers version routes differently")
            self.calls[layer].append(output[2].detach().to("cpu", torch.int64))

        return hook

    def routes(self, batch_size: int, real: torch.Tensor) -> torch.Tensor:
        """[B, S, L, K]: each call's [B * s, K] indices (HF flattens batch-major) along the
        sequence; PAD where `real` ([B, S] bool) is False."""
        per_layer = [torch.cat([c.view(batch_size, -1, c.shape[-1]) for c in calls], dim=1)
                     for calls in self.calls.values()]
        routes = torch.stack(per_layer, dim=2)
        if routes.shape[1] != real.shape[1]:
            raise RuntimeError(f"recorded {routes.shape[1]} routed positions for {real.shape[1]} columns")
        return torch.where(real[:, :, None, None], routes, torch.full_like(routes, PAD))


def routing_agreement(engine: torch.Tensor, trainer: torch.Tensor, real: torch.Tensor) -> float:
    """The fraction of (real token, layer) pairs whose top-k expert SETS are equal (the order within
    a top-k is the router's and means nothing). A token the trainer did not route counts as a
    disagreement. 1.0 is what replay must give; RFC #4168 reports ~0.9 without it."""
    if engine.shape != trainer.shape:
        raise ValueError(f"routes of shape {tuple(engine.shape)} and {tuple(trainer.shape)}")
    same = (engine.sort(-1).values == trainer.sort(-1).values).all(-1)  # [B, S, L]
    same &= (trainer >= 0).all(-1)
    return float(same[real].float().mean())


def drifted(routes: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes that share no expert with `routes`: per token and layer, the K lowest-numbered experts
    outside its top-k (needs num_experts >= 2K). The most drifted replay there is: every replayed
    expert is one the trainer's own router did not pick (the case ISEEKYAN/Megatron-LM#79 is about)."""
    k = routes.shape[-1]
    if num_experts < 2 * k:
        raise ValueError(f"{num_experts} experts have no top-{k} disjoint from another top-{k}")
    chosen = torch.zeros(*routes.shape[:-1], num_experts, dtype=torch.long)
    chosen.scatter_(-1, routes.clamp(min=0), 1)
    rank = chosen * num_experts + torch.arange(num_experts)  # the unchosen first, lowest number first
    out = rank.argsort(-1)[..., :k]
    return torch.where(routes[..., :1] >= 0, out, torch.full_like(out, PAD))


@contextmanager
def forced_routes(model: torch.nn.Module, routes: torch.Tensor) -> Iterator[None]:
    """An HF model's routers made to pick `routes` ([tokens, L, K] of what the model is fed in one
    call, HF's flattening; PAD: experts 0..K-1) inside the `with`, each token's weights computed by
    HF's own formula at those experts: the softmax over every expert gathered there, renormalised
    where the router renormalises (norm_topk_prob). The ground truth of a replayed routing."""
    hooks = []
    k = routes.shape[-1]
    for layer, router in hf_routers(model).items():
        chosen = torch.where(routes[:, layer] >= 0, routes[:, layer], torch.arange(k))

        def force(module, args, output, chosen=chosen):
            logits = output[0]
            index = chosen.to(logits.device)
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, index)
            if getattr(module, "norm_topk_prob", True):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), index

        hooks.append(router.register_forward_hook(force))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
