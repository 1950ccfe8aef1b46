"""Context parallelism (CP): which positions of a micro-batch each CP rank feeds, and how its
per-position values come back in sequence order.

Megatron (`get_batch_on_this_cp_rank`) and Transformer Engine split every sequence into 2 x cp
chunks and give CP rank r the chunks r and 2cp-1-r (load balancing under the causal mask: an early
chunk attends to little, a late one to much). Megatron's RoPE takes the same two chunks of its
position table (`get_pos_emb_on_this_cp_rank`); with packed THD sequences TE splits each sequence
(its `cu_seqlens` slot) the same way (`thd_get_partitioned_indices`). So the harness feeds each CP rank
exactly those positions of the tokens, the labels rolled on the whole sequence *before* the split
(a label rolled inside a rank's chunks would be the wrong token at every chunk boundary), and
gathers every rank's per-position logprobs back into sequence order over the CP group.

The gather is differentiable the way the loss needs: every CP rank then holds the whole sequence's
logprobs and computes the same loss; the backward hands each rank the gradient at its own positions
only (no sum over the CP ranks: each holds the same full gradient already). Each rank's parameter
gradients are then those of its own positions, and Megatron's DDP sums them over DP x CP.

Pure tensor code except `cp_group`/`gather_positions` (which need Megatron's parallel state).
"""
from __future__ import annotations

import math

import torch


def chunk_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions 0..length-1 that CP rank `rank` of `cp` holds: chunks rank and 2cp-1-rank of 2cp."""
    if cp == 1:
        return torch.arange(length)
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} positions does not split into 2 x cp = {2 * cp} chunks")
    chunk = length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def thd_positions(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """The packed row's positions CP rank `rank` holds: each slot [cu[i], cu[i+1]) split as
    `chunk_positions`, slot after slot (TE's `thd_get_partitioned_indices`)."""
    cu = [int(c) for c in cu_seqlens]
    parts = [start + chunk_positions(end - start, cp, rank) for start, end in zip(cu[:-1], cu[1:])]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def rank_positions(length: int, cu_seqlens: torch.Tensor | None, cp: int, rank: int) -> torch.Tensor:
    """What a micro-batch of `length` columns (thd: its slots `cu_seqlens`) feeds CP rank `rank`."""
    if cu_seqlens is None:
        return chunk_positions(length, cp, rank)
    if int(cu_seqlens[-1]) != length:
        raise ValueError(f"cu_seqlens end at {int(cu_seqlens[-1])}, the packed row has {length} positions")
    return thd_positions(cu_seqlens, cp, rank)


def contiguous_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """The variant `cp-chunks-contiguous` (radixark/miles PR 885's class): rank r's share read
    as the r-th contiguous 1/cp of the sequence instead of the zig-zag chunks r and 2cp-1-r."""
    share = length // cp
    return torch.arange(rank * share, (rank + 1) * share)


def length_multiple(cp: int, tp: int, sequence_parallel: bool) -> int:
    """What a micro-batch's length (each thd slot's too) must divide by: 2 x cp chunks, and under
    sequence parallelism each CP rank's share (length / cp) split over the TP ranks."""
    tp_part = tp if sequence_parallel else 1
    return tp_part if cp == 1 else math.lcm(2 * cp, cp * tp_part)


def slot_multiple(cp: int) -> int:
    """What each packed (thd) sequence's slot must divide by: 2 x cp chunks (1 without CP)."""
    return 1 if cp == 1 else 2 * cp


def labels_for(tokens: torch.Tensor, fill: int) -> torch.Tensor:
    """[b, s] -> the token each position predicts (position t: token t+1), rolled on the whole
    sequence; the last position predicts nothing (`fill`)."""
    labels = torch.full_like(tokens, fill)
    labels[:, :-1] = tokens[:, 1:]
    return labels


class _GatherInOrder(torch.autograd.Function):
    """All-gather each CP rank's [b, n] values into [b, length] at the ranks' positions."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, positions: list[torch.Tensor], rank: int, group, length: int,
                sum_grads: bool = False):
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in positions]
        dist.all_gather(parts, local.contiguous(), group=group)
        full = local.new_zeros((local.shape[0], length, *local.shape[2:]))
        for index, part in zip(positions, parts):
            full[:, index.to(local.device)] = part
        ctx.mine, ctx.group, ctx.sum_grads = positions[rank], group, sum_grads
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every CP rank computed the same loss from the same gathered values: its gradient at its
        # own positions is the whole gradient there (summing over the ranks would multiply it by cp).
        if ctx.sum_grads:  # the variant cp-grads-summed-over-cp: an all-gather's usual backward
            import torch.distributed as dist

            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return grad[:, ctx.mine.to(grad.device)], None, None, None, None, None


def gather_positions(local: torch.Tensor, length: int, cu_seqlens: torch.Tensor | None,
                     variant: str | None = None) -> torch.Tensor:
    """This CP rank's per-position values [b, n, ...] -> the whole micro-batch's [b, length, ...],
    in sequence order, on every CP rank (differentiable; the identity without CP)."""
    cp, rank, group = cp_group()
    if cp == 1:
        return local
    if variant == "cp-chunks-contiguous":
        positions = [contiguous_positions(length, cp, r) for r in range(cp)]
    else:
        positions = [rank_positions(length, cu_seqlens, cp, r) for r in range(cp)]
    return _GatherInOrder.apply(local, positions, rank, group, length, variant == "cp-grads-summed-over-cp")


def cp_group() -> tuple[int, int, object]:
    """(size, rank, group) of this rank's context-parallel group (1, 0, None without Megatron state)."""
    from megatron.core import parallel_state as ps

    size = ps.get_context_parallel_world_size()
    if size == 1:
        return 1, 0, None
    return size, ps.get_context_parallel_rank(), ps.get_context_parallel_group()
