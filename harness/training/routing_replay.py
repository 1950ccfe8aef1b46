"""Rollout routing replay (R3), the trainer's side: megatron-core's own RouterReplay
(`moe_enable_routing_replay`, megatron/core/transformer/moe/router_replay.py, Megatron-LM #2101)
fed the engine's routes (harness.rollout.routing), and what the trainer's routers actually chose.

Each rank feeds each of its routers the routes of the router's GLOBAL layer (``layer_number - 1``:
megatron-core numbers layers across pipeline stages and virtual chunks) for the tokens the router
sees: the micro-batches the policy feeds, in its sequence layout (left padding moved right,
`MicroBatch.unmap` read backwards), sequence-first as the router flattens them ([s, b] -> s * b + b),
this tensor-parallel rank's slice of the sequence under sequence parallelism, this context-parallel
rank's chunks under CP (the positions the feed gives it; what the routers took is gathered back over the
CP group). Pad positions replay experts 0..K-1 (a valid dummy route; the loss never sees them).

We drive each RouterReplay instance of this rank's model directly, not megatron-core's class-level
`RouterReplay.set_replay_data`: that one indexes `global_router_replay_instances`, a process-wide
list every model built with replay appends to (the persistent worlds build many), in construction
order, which is the stage-local order the #5037 class gets wrong.

Variants of this component (the catalog's "routing-replay" entries):
  replay-from-zeroed-probs   ISEEKYAN/Megatron-LM#79: the replayed experts' scores gathered from the
                             trainer's own post-top-k probabilities (zero off its own top-k), so a
                             replayed expert the trainer did not pick reads an exact 0: no router grad.
  replay-local-layer-index   verl #5037: routes indexed by the stage-local layer under PP, so the
                             second stage replays the first stage's routes.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from harness.rollout.routing import PAD, last_tokens

IMPLEMENTED = ("replay-from-zeroed-probs", "replay-local-layer-index")


@dataclass
class _Router:
    module: Any  # megatron-core's TopKRouter
    layer: int  # global, 0-based
    local: int  # this rank's own count (across its virtual chunks)
    captured: list = field(default_factory=list)  # per forward: [tokens, K] the experts it routed to
    own: list = field(default_factory=list)  # per forward: [tokens, K] its own top-k (even when replaying)


def routers(models) -> list[_Router]:
    """This rank's MoE routers, in its layer order, with their global layer index."""
    from megatron.core.transformer.moe.router import TopKRouter

    from harness.bridge import unwrap_model

    found = [m for chunk in unwrap_model(list(models)) for m in chunk.modules() if isinstance(m, TopKRouter)]
    return [_Router(m, int(m.layer_number) - 1, i) for i, m in enumerate(found)]


def fed_routes(micro, routes: torch.Tensor) -> torch.Tensor:
    """The routes [b, s, L, K] of a micro-batch as fed (its rows' routes [B, S, L, K] moved where
    `micro.unmap` says each fed token came from); experts 0..K-1 at fed positions of no row token
    and at each row's last token, which no engine routes (it is never fed; its output predicts past
    the row, so nothing the loss sees depends on its route: harness.rollout.routing). A dense layer's
    rows stay PAD (no router reads them); a router's own layer is checked where it is queued."""
    b, s = micro.tokens.shape
    fed_number = torch.arange(1, b * s + 1, dtype=torch.float64).view(b, s)
    source = micro.unmap(fed_number).long()  # rows layout: which fed position (1-based) each token went to
    real = source > 0
    layers, k = routes.shape[-2:]
    unrouted = last_tokens(real)[:, :, None, None] & (routes < 0)
    routes = torch.where(unrouted, torch.arange(k).expand_as(routes), routes)
    out = torch.arange(k).expand(b * s, layers, k).clone()
    out[source[real] - 1] = routes[real]
    return out.view(b, s, layers, k)  # PAD left only in a dense layer's rows, or where a route is missing


def _router_tokens(fed: torch.Tensor, layer: int, sequence_parallel: bool,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """[tokens, K] of `layer` in the order the router flattens its input [s, b, h]: this CP rank's
    `positions` of the sequence (None: all), this TP rank's slice of them under sequence parallelism."""
    from megatron.core import parallel_state as ps

    if positions is not None:
        fed = fed[:, positions]
    tokens = fed[:, :, layer].transpose(0, 1)  # [s, b, K]
    if sequence_parallel:
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        tokens = tokens.chunk(tp, dim=0)[rank]
    return tokens.reshape(-1, tokens.shape[-1]).contiguous()


def _zeroed_probs_replay(original):
    """replay-from-zeroed-probs (ISEEKYAN/Megatron-LM#79, the replay of #49 it corrects): the trainer's
    own top-k first, its probabilities scattered into a dense tensor zeroed off that top-k, and the
    replayed experts' scores gathered from it instead of from the live scores."""
    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        dense = torch.zeros_like(scores).scatter(1, own, torch.softmax(values.float(), dim=-1).type_as(scores))
        return original(dense, topk, num_groups, group_topk, default_compute_topk)

    return get_replay_topk


@contextmanager
def routing_session(models, micros, routes: torch.Tensor | None, variant: str | None = None
                    ) -> Iterator[list[_Router]]:
    """For the micro-batches `micros` run through `models` inside the `with` (each router once per
    micro-batch, in order): replay `routes` ([B_local, S, L, K] of this data-parallel rank's rows,
    which the micro-batches split into consecutive parts; None: route freely), and capture what
    every router routed to (its `captured`)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    found = routers(models)
    if not found:
        raise ValueError("routing replay needs a Mixture-of-Experts model: this policy has no MoE router")
    hooks = []
    # Micro-batches are consecutive equal parts of the rank's rows (split_micro_batches).
    fed = None if routes is None else [fed_routes(m, r) for m, r in zip(micros, routes.chunk(len(micros)))]
    try:
        for router in found:
            hooks.append(router.module.register_forward_hook(_capture(router)))
            if fed is None:
                continue
            replay = router.module.router_replay
            if replay is None:
                raise RuntimeError("routing replay needs the policy built with routing_replay=True "
                                   "(megatron-core's moe_enable_routing_replay)")
            layer = router.local if variant == "replay-local-layer-index" else router.layer
            sp = bool(router.module.config.sequence_parallel)
            queue = [_router_tokens(f, layer, sp, _cp_positions(m)) for m, f in zip(micros, fed)]
            if any(bool((q < 0).any()) for q in queue):
                raise ValueError(f"layer {layer}'s router has a real token with no recorded route (PAD inside "
                                 "the rows' real tokens before the last, or a MoE layer's routes missing)")
            hooks.append(router.module.register_forward_pre_hook(_next_target(router, queue)))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            if variant == "replay-from-zeroed-probs":
                replay.get_replay_topk = _zeroed_probs_replay(type(replay).get_replay_topk.__get__(replay))
        yield found
    finally:
        for hook in hooks:
            hook.remove()
        for router in found:
            replay = router.module.router_replay
            if replay is not None:
                replay.clear_indices()
                replay.clear_router_replay_action()
                replay.__dict__.pop("get_replay_topk", None)


def _cp_positions(micro) -> torch.Tensor | None:
    """The columns of `micro` this CP rank feeds (None without context parallelism): its routers see
    those tokens only (harness.logprobs.context_parallel)."""
    from harness.logprobs.context_parallel import cp_group

    cp, rank, _ = cp_group()
    return micro.cp_positions(cp, rank) if cp > 1 else None


def _cp_gathered(tokens: torch.Tensor, micro, device) -> torch.Tensor:
    """[b, s_local, K] routes of this CP rank's columns -> [b, s, K] of the whole micro-batch, from
    every CP rank's (collective over the CP group; the logprobs' own gather)."""
    from harness.logprobs.context_parallel import gather_positions

    return gather_positions(tokens.to(device), micro.tokens.shape[1], micro.cu_seqlens).cpu()


def _next_target(router: _Router, queue: list[torch.Tensor]):
    def hook(module, args):
        if not queue:
            raise RuntimeError(f"layer {router.layer}'s router ran more often than there are micro-batches")
        module.router_replay.set_target_indices(queue.pop(0).to(args[0].device))

    return hook


def _capture(router: _Router):
    def hook(module, args, output):
        routing_map = output[1].detach()  # [tokens, experts] bool
        k = module.topk
        chosen = routing_map.float().topk(k, dim=1).indices.sort(dim=1).values.cpu()
        complete = routing_map.sum(dim=1).cpu() == k  # a dropped or doubled route is no top-k
        router.captured.append(torch.where(complete.unsqueeze(1), chosen, torch.full_like(chosen, PAD)))
        with torch.no_grad():  # what the router would pick by itself
            logits = module.gating(args[0]).reshape(-1, routing_map.shape[1])
            router.own.append(_own_topk(module, logits))

    return hook


def _own_topk(module, logits: torch.Tensor) -> torch.Tensor:
    """[tokens, K] sorted: the experts megatron-core's `module` picks from `logits` without replay, by
    its own routing function (not the top-k of the logits: an expert bias, as GLM-4.5-MoE's and
    DeepSeek-V3's, and a group limit change the pick)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    c = module.config
    _, routing_map = topk_routing_with_score_function(
        logits, module.topk, use_pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
        group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor,
        score_function=module.score_function, expert_bias=module.expert_bias)
    return routing_map.float().topk(module.topk, dim=1).indices.sort(dim=1).values.cpu()


def captured_rows(found: list[_Router], micros, what: str = "captured") -> dict[int, torch.Tensor]:
    """What each router routed to ("captured"; "own": what it would have picked by itself), in this
    data-parallel rank's rows' layout: global layer -> [B_local, S, K] (PAD at pads). Collective over
    the tensor-parallel group under sequence parallelism (each TP rank routed a slice) and over the
    context-parallel group under CP (each CP rank routed its chunks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    for router in found:
        per_micro = getattr(router, what)
        if len(per_micro) != len(micros):
            raise RuntimeError(f"layer {router.layer}'s router ran {len(per_micro)} times for "
                               f"{len(micros)} micro-batches")
        parts = []
        for micro, tokens in zip(micros, per_micro):
            b, s = micro.tokens.shape
            k = tokens.shape[-1]
            if router.module.config.sequence_parallel:
                group = ps.get_tensor_model_parallel_group()
                slices = [torch.empty_like(tokens) for _ in range(dist.get_world_size(group))]
                device_slices = [x.to(router.module.weight.device) for x in slices]
                dist.all_gather(device_slices, tokens.to(router.module.weight.device), group=group)
                tokens = torch.cat([x.cpu() for x in device_slices])
            fed = _cp_gathered(tokens.view(-1, b, k).transpose(0, 1), micro, router.module.weight.device)  # [b, s, K]
            rows = [micro.unmap(fed[..., j].double() + 1).long() - 1 for j in range(k)]  # pads: 0 -> PAD
            parts.append(torch.stack(rows, dim=-1))
        out[router.layer] = torch.cat(parts)
    return out


def router_grads(found: list[_Router]) -> dict[int, torch.Tensor]:
    """Each router's weight gradient as accumulated so far on this rank (DDP's main_grad, before the
    data-parallel reduction), by global layer."""
    return {r.layer: r.module.weight.main_grad.detach().float().cpu().clone() for r in found}


# ----------------------------------------------------------------------------- rank functions
def replay_step(worker, train_batch, routes: torch.Tensor | None, variant: str | None = None) -> dict[str, Any]:
    """One training step of the policy `worker` on the global `train_batch`, its routers replaying
    `routes` (the global batch's [B, S, L, K]; None: its own routing): the step's stats, what the
    routers routed to, and the router grads of this rank before the reduction."""
    from megatron.core import parallel_state as ps

    worker.begin_step(train_batch)
    micros = worker.accumulating.micros
    local = _local_rows(routes)
    with routing_session(worker.models, micros, local, variant) as found:
        worker.accumulate(range(len(micros)))
    grads = router_grads(found)
    stats = worker.finish_step()
    return {"stats": stats, "routes": captured_rows(found, micros), "own": captured_rows(found, micros, "own"),
            "grads": grads,
            "sequence_parallel": bool(found[0].module.config.sequence_parallel), **_coordinates(ps, found)}


def replay_logprobs(worker, batch, routes: torch.Tensor | None, micro_batches: int = 1,
                    variant: str | None = None) -> dict[str, Any]:
    """The policy's logprobs of `batch` (PolicyWorker.logprobs) with its routers replaying `routes`,
    and what they routed to. The micro-batches are made as `megatron_logprobs` makes them."""
    from megatron.core import parallel_state as ps

    from harness.logprobs.megatron import logprob_micro_batches

    local = batch.split(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    micros = logprob_micro_batches(local, micro_batches)
    with routing_session(worker.models, micros, _local_rows(routes), variant) as found:
        logprobs = worker.logprobs(batch, micro_batches)
    return {"logprobs": logprobs, "routes": captured_rows(found, micros), "own": captured_rows(found, micros, "own"),
            **_coordinates(ps, found)}


def _local_rows(routes: torch.Tensor | None) -> torch.Tensor | None:
    from megatron.core import parallel_state as ps

    if routes is None:
        return None
    return routes.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]


def _coordinates(ps, found: list[_Router]) -> dict[str, Any]:
    return {"dp_rank": ps.get_data_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(), "cp_rank": ps.get_context_parallel_rank(),
            **_layers(found[0].module.config)}


def _layers(config) -> dict[str, Any]:
    """The model's layer count and its MoE layers' global indices (0-based), from megatron-core's
    `moe_layer_freq` (an int N: every N-th layer from 0; a list: 1 where a layer is MoE): the layers
    the gathered routes must cover, the others being dense (GLM-4.5-MoE's, DeepSeek-V3's first ones)."""
    freq, n = config.moe_layer_freq, config.num_layers
    moe = [i for i in range(n) if i % freq == 0] if isinstance(freq, int) else [i for i, f in enumerate(freq) if f]
    return {"num_layers": n, "moe_layers": moe}


# ----------------------------------------------------------------------------- parent side
def assemble_routes(results: list[dict[str, Any]], key: str = "routes") -> torch.Tensor:
    """The global batch's [B, S, L, K] from every rank's `key` (rows by data-parallel rank, layers
    from every pipeline stage; tensor- and context-parallel ranks hold the same)."""
    by_dp: dict[int, dict[int, torch.Tensor]] = {}
    for r in results:
        if r["tp_rank"] == 0 and r.get("cp_rank", 0) == 0:
            by_dp.setdefault(r["dp_rank"], {}).update(r[key])
    layers, moe = sorted(by_dp[0]), results[0]["moe_layers"]
    if any(sorted(v) != layers for v in by_dp.values()) or layers != moe:
        raise RuntimeError(f"routes of layers {layers} gathered for MoE layers {moe}: some layer is missing or "
                           "doubled")

    def rows(d: int) -> torch.Tensor:  # every layer; a dense one PAD (harness.rollout.routing)
        dense = torch.full_like(by_dp[d][layers[0]], PAD)
        return torch.stack([by_dp[d].get(layer, dense) for layer in range(results[0]["num_layers"])], dim=2)

    return torch.cat([rows(d) for d in sorted(by_dp)])


def full_router_grads(results: list[dict[str, Any]], data_parallel: int) -> dict[int, torch.Tensor]:
    """Each router's whole weight gradient: the ranks' pre-reduction grads summed over data-parallel
    (and context-parallel: each CP rank's covers its own chunks; under sequence parallelism,
    tensor-parallel) ranks, over `data_parallel`, DDP's averaging size dp x cp (its 1 / (dp x cp)
    pre-scaling, which the policy's loss scale undoes, is applied in the reduction)."""
    total: dict[int, torch.Tensor] = {}
    for r in results:
        if r["tp_rank"] != 0 and not r["sequence_parallel"]:
            continue  # without sequence parallelism every TP rank routed every token: a replica
        for layer, grad in r["grads"].items():
            total[layer] = total.get(layer, 0) + grad
    return {layer: grad / data_parallel for layer, grad in sorted(total.items())}


def train_with_routes(policy, train_batch, routes: torch.Tensor | None, variant: str | None = None
                      ) -> dict[str, Any]:
    """One step of the PolicyHandle `policy` replaying `routes` (the global batch's [B, S, L, K];
    None: its own routing): the step's stats, the routes its routers took, the routes they would
    have picked by themselves, the whole router weight gradients by global layer."""
    from harness.training.handles import PolicyHandle

    results = policy.apply(replay_step, train_batch, routes, variant)
    return {"stats": PolicyHandle._agreed([r["stats"] for r in results]), "routes": assemble_routes(results),
            "own": assemble_routes(results, "own"), "grads": full_router_grads(results, policy.layout.dp * policy.layout.cp)}


def logprobs_with_routes(policy, batch, routes: torch.Tensor | None, variant: str | None = None, *,
                         micro_batches: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PolicyHandle's logprobs of `batch` [B, S] (as `policy.logprobs`) with its routers replaying
    `routes` (None: its own routing), the routes they took [B, S, L, K], and the routes they would
    have picked by themselves (given what the earlier layers replayed)."""
    from harness.logprobs.megatron import assemble

    micro_batches = micro_batches or policy.layout.micro_batch_multiple
    results = policy.apply(replay_logprobs, batch, routes, micro_batches, variant)
    logprobs, _ = assemble([r["logprobs"] for r in results])
    return logprobs, assemble_routes(results), assemble_routes(results, "own")

