"""Rollout routing replay (R3): which experts each token went to, recorded by the engine, compared.

A MoE model's routing over a batch is an int64 tensor ``[B, S, L, K]`` aligned with the batch's rows:
for row b, column s and GLOBAL layer l (0-based, the HF checkpoint's ``model.layers.{l}``), the K
experts the router chose for that token, in the router's order; ``PAD`` (-1) where column s is a pad.
Global layer indices are what keeps the trainer aligned under pipeline parallelism (verl #5037: a
stage that reads the routes by its own local layer index replays another stage's routes). L is every
layer of the model, MoE or not: a dense layer (GLM-4.5-MoE's and DeepSeek-V3's first
`first_k_dense_replace` layers) has no router, so its rows are PAD at every token (`routed_layers`), and
a MoE layer's routes stay at its global index, where the trainer reads them (``layer_number - 1``).

An engine records the route of every token it FEEDS through the model: the prompt (prefill) and
each sampled token fed back by the next decode step. The last sampled token of a row is never fed
(generation stops after sampling it), so it has no route: PAD, in every engine. vLLM's
`routed_experts` (prompt + completion - 1 rows) and SGLang's are the same; the HF engine
(`RoutingRecorder`) follows it. The trainer replays experts 0..K-1 there, as at pads: that
position's output predicts past the end of the row, so no logprob, loss or gradient depends on its
route (`routed_positions`: where a route must be). The trainer's side (megatron-core's RouterReplay
fed these routes) is `harness.training.routing_replay`; vLLM's routes reach this format through
`from_token_routes` (harness.rollout.vllm_routes).
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

import torch

PAD = -1
# gpt-oss names its router ``mlp.router`` (GptOssTopKRouter); every other family here ``mlp.gate``
# (Qwen2-MoE's ``mlp.shared_expert_gate`` is no router, and the anchored name leaves it out).
_GATE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.(?:gate|router)$")
# Routers that take the top k of the logits, then a softmax over those k only (gpt-oss): HF computes
# it so, and a forced route's weights must be the same arithmetic to give the same bits (`forced_weights`).
TOPK_THEN_SOFTMAX = ("GptOssTopKRouter",)


def _router_names(model: torch.nn.Module) -> dict[int, str]:
    """Every MoE layer's router name (``...layers.{l}.mlp.gate``, gpt-oss's ``...mlp.router``) by global
    layer index."""
    return dict(sorted((int(m.group(1)), name) for name, _ in model.named_modules() if (m := _GATE.search(name))))


def hf_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Every MoE layer's router of an HF model (transformers 5: ``model.layers.{l}.mlp.gate``, gpt-oss's
    ``model.layers.{l}.mlp.router``, a module returning ``(logits, weights, indices)``), by global layer index."""
    found = {layer: model.get_submodule(name) for layer, name in _router_names(model).items()}
    if not found:
        raise ValueError(f"{type(model).__name__} has no MoE routers (model.layers.N.mlp.gate or .router): "
                         "routing is recorded and replayed for Mixture-of-Experts models only")
    return found


def _routed_by(model: torch.nn.Module) -> dict[int, "_RoutedBy"]:
    """Where each MoE layer picks its experts (`_RoutedBy`), by global layer index."""
    hf_routers(model)  # the error for a model without routers
    return {layer: _RoutedBy(model, name) for layer, name in _router_names(model).items()}


class _RoutedBy:
    """Where an HF MoE block picks its experts, for recording and forcing: the router's forward (the
    transformers 5 releases this harness pins: its gate returns (logits, weights, indices); gpt-oss's
    router returns the same in 5.12.1 and 5.23.0, its weights the softmax of the top-k logits), or, in
    earlier 5.x (5.12.1, stack B's venv: GLM-4.5-MoE's and DeepSeek-V3's gate returns the logits only),
    the block's `route_tokens_to_experts(logits) -> (indices, weights)`, wrapped on the instance."""

    def __init__(self, model: torch.nn.Module, name: str) -> None:
        self.router = model.get_submodule(name)
        self.block = model.get_submodule(name.rsplit(".", 1)[0])  # the MoE block (``...mlp``)
        self.in_block = hasattr(type(self.block), "route_tokens_to_experts")

    def weighing(self):
        """What `forced_weights` reads the routing constants from: the router, or (in-block routing) the
        block holding norm_topk_prob and routed_scaling_factor, with the router's expert bias."""
        if not self.in_block:
            return self.router
        from types import SimpleNamespace

        return SimpleNamespace(**{k: getattr(self.block, k) for k in ("norm_topk_prob", "routed_scaling_factor")
                                  if hasattr(self.block, k)},
                               **({"e_score_correction_bias": self.router.e_score_correction_bias}
                                  if hasattr(self.router, "e_score_correction_bias") else {}))

    def hook(self, pick):
        """Make `pick(logits, indices, weights) -> (indices, weights)` run on every routing of the block;
        returns the undo."""
        if not self.in_block:
            def forward_hook(module, args, output):
                if not (isinstance(output, tuple) and len(output) == 3 and not output[2].is_floating_point()):
                    raise TypeError(f"{type(module).__name__} returned {type(output).__name__}, not (logits, "
                                    "weights, indices): this transformers version routes differently")
                index, weights = pick(output[0], output[2], output[1])
                return output[0], weights, index

            return self.router.register_forward_hook(forward_hook).remove
        original = self.block.route_tokens_to_experts

        def routed(router_logits):
            index, weights = original(router_logits)
            return pick(router_logits, index, weights)

        self.block.route_tokens_to_experts = routed
        return lambda: vars(self.block).pop("route_tokens_to_experts", None)


class RoutingRecorder:
    """Hooks on an HF model's routing (`_RoutedBy`) for the duration of a `with`: every call's top-k
    indices per layer, in call order. `routes(batch_size, real)` assembles them along the sequence."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routed_by = _routed_by(model)
        self.num_layers = int(getattr(model.config, "num_hidden_layers", max(self.routed_by) + 1))
        self.calls: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.routed_by}
        self._hooks: list = []

    def __enter__(self) -> "RoutingRecorder":
        for layer, routed_by in self.routed_by.items():
            self._hooks.append(routed_by.hook(self._keep(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for undo in self._hooks:
            undo()
        self._hooks.clear()

    def _keep(self, layer: int):
        def pick(logits, index, weights):
            self.calls[layer].append(index.detach().to("cpu", torch.int64))
            return index, weights

        return pick

    def routes(self, batch_size: int, real: torch.Tensor) -> torch.Tensor:
        """[B, S, L, K]: each call's [B * s, K] indices (HF flattens batch-major) along the
        sequence; PAD where `real` ([B, S] bool) is False and in every row of a dense layer. Calls
        that covered S - 1 columns (a generation: the last sampled token is never fed) leave the last
        column PAD."""
        per_layer = {layer: torch.cat([c.view(batch_size, -1, c.shape[-1]) for c in calls], dim=1)
                     for layer, calls in self.calls.items()}
        some = next(iter(per_layer.values()))
        dense = torch.full_like(some, PAD)
        routes = torch.stack([per_layer.get(layer, dense) for layer in range(self.num_layers)], dim=2)
        if routes.shape[1] == real.shape[1] - 1:
            routes = torch.cat([routes, torch.full_like(routes[:, :1], PAD)], dim=1)
        if routes.shape[1] != real.shape[1]:
            raise RuntimeError(f"recorded {routes.shape[1]} routed positions for {real.shape[1]} columns")
        return torch.where(real[:, :, None, None], routes, torch.full_like(routes, PAD))


def last_tokens(real: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: each row's last real token (the last sampled one: never fed, so never routed)."""
    columns = torch.arange(real.shape[1]).expand_as(real)
    last = torch.where(real, columns, -1).amax(dim=1, keepdim=True)
    return real & (columns == last)


def routed_positions(real: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: the real tokens an engine must have a route for (all but each row's last)."""
    return real & ~last_tokens(real)


def from_token_routes(rows: list[torch.Tensor], real: torch.Tensor) -> torch.Tensor:
    """[B, S, L, K] from one [n_b, L, K] per row: the routes of the row's fed tokens in order (an
    engine's per-request form: vLLM's `CompletionOutput.routed_experts`, prompt + completion - 1
    rows), placed on the row's real columns (left padding skipped); PAD at pads and at the last
    token. A row whose count is not its real tokens less one raises: an engine that returned the
    last token's route, or lost one, would otherwise be replayed one token off. A layer may be PAD at
    every token (a dense layer: `routed_layers`); a negative id anywhere in a MoE layer raises."""
    if len(rows) != real.shape[0]:
        raise ValueError(f"routes for {len(rows)} rows, the batch has {real.shape[0]}")
    shapes = {tuple(r.shape[1:]) for r in rows}
    if len(shapes) != 1:
        raise ValueError(f"rows' routes of (layers, top-k) shapes {sorted(shapes)}: expected one")
    layers, k = shapes.pop()
    out = torch.full((*real.shape, layers, k), PAD, dtype=torch.int64)
    where = routed_positions(real)
    for b, r in enumerate(rows):
        expected = int(where[b].sum())
        if r.shape[0] != expected:
            raise ValueError(f"row {b}: routes of {r.shape[0]} tokens for {int(real[b].sum())} real tokens "
                             f"(expected {expected}: every token but the last sampled one)")
        out[b, where[b]] = r.to(torch.int64)
    fed = out[where]  # [tokens, L, K]
    dense = (fed == PAD).all(-1).all(0)  # [L]: a dense layer, PAD at every fed token
    if bool((fed[:, ~dense] < 0).any()):
        raise ValueError("an engine's route holds a negative expert id in a MoE layer")
    return out


def routed_layers(*routes: torch.Tensor) -> torch.Tensor:
    """[L] bool: the layers some of `routes` ([B, S, L, K] each) routes any token in: the MoE layers
    (a dense layer is PAD everywhere on every side, so it counts in no agreement)."""
    return torch.stack([(r >= 0).flatten(0, 1).any(0).any(-1) for r in routes]).any(0)


def routing_agreement(engine: torch.Tensor, trainer: torch.Tensor, real: torch.Tensor) -> float:
    """The fraction of (routed token, MoE layer) pairs whose top-k expert SETS are equal (the order
    within a top-k is the router's and means nothing); routed tokens: the real ones but each row's
    last (`routed_positions`); MoE layers: those either side routed any token in (`routed_layers`).
    A token the trainer did not route, or the engine did not record, counts as a disagreement. 1.0
    is what replay must give; RFC #4168 reports ~0.9 without it."""
    if engine.shape != trainer.shape:
        raise ValueError(f"routes of shape {tuple(engine.shape)} and {tuple(trainer.shape)}")
    same = (engine.sort(-1).values == trainer.sort(-1).values).all(-1)  # [B, S, L]
    same &= (trainer >= 0).all(-1) & (engine >= 0).all(-1)
    return float(same[routed_positions(real)][:, routed_layers(engine, trainer)].float().mean())


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


def forced_weights(router: torch.nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[tokens, K] float32 weights HF's `router` gives the experts `index` from its `logits`. A
    softmax router (Qwen3-MoE, Mixtral): the softmax over every expert gathered there, renormalised
    where it renormalises (norm_topk_prob). A sigmoid router with an expert bias (GLM-4.5-MoE's and
    DeepSeek-V3's TopkRouter: `e_score_correction_bias`): the bias and the group limit only CHOOSE the
    experts, so forced ones weigh their unbiased sigmoid scores, renormalised (+1e-20, as HF) where
    norm_topk_prob, times routed_scaling_factor (as megatron-core's replay, moe_utils.
    topk_routing_with_score_function, weighs them). A top-k-then-softmax router (gpt-oss's, with its
    bias inside the logits): the softmax over the forced experts' logits only, in the logits' dtype as HF
    takes it (megatron-core's replay without pre-softmax: the same softmax of the gathered logits)."""
    if type(router).__name__ in TOPK_THEN_SOFTMAX:
        return torch.softmax(logits.gather(1, index), dim=1, dtype=logits.dtype).float()
    if hasattr(router, "e_score_correction_bias"):
        weights = logits.float().sigmoid().gather(1, index)
        if router.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * router.routed_scaling_factor
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, index)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


@contextmanager
def forced_routes(model: torch.nn.Module, routes: torch.Tensor) -> Iterator[None]:
    """An HF model's routers made to pick `routes` ([tokens, L, K] of what the model is fed in one
    call, HF's flattening; PAD: experts 0..K-1) inside the `with`, each token's weights computed by
    HF's own formula at those experts (`forced_weights`). The ground truth of a replayed routing."""
    undo = []
    k = routes.shape[-1]
    for layer, routed_by in _routed_by(model).items():
        chosen = torch.where(routes[:, layer] >= 0, routes[:, layer], torch.arange(k))

        def force(logits, index, weights, chosen=chosen, constants=routed_by.weighing()):
            index = chosen.to(logits.device)
            return index, forced_weights(constants, logits, index).to(logits.dtype)

        undo.append(routed_by.hook(force))
    try:
        yield
    finally:
        for step in undo:
            step()
