"""Megatron-side per-token logprobs: forward-only through `get_forward_backward_func`.

Rank-side. Runs under any layout (TP/PP/VPP/DP/SP) with several micro-batches, the way an RL
framework computes old/reference logprobs. Left padding is removed first (every row shifted so its
real tokens start at column 0): Megatron's RoPE uses positions 0..s-1 whatever `position_ids`
says, and with the pads at the end the causal mask alone keeps them out of every real token's view.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from harness.data.packing import pack, unpack
from harness.data.rl_batch import RLBatch
from harness.logprobs.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_top1


@dataclass
class RankLogprobs:
    """What one rank computed: only last-stage ranks hold values (None elsewhere)."""

    dp_rank: int
    tp_rank: int
    last_stage: bool
    logprobs: torch.Tensor | None  # [B/DP, S] float32, the project's logprob convention
    top1: torch.Tensor | None  # [B/DP, S] int64, prediction for token t (made at t-1); -1 undefined


def _true_vocab(models: list[torch.nn.Module]) -> int:
    from harness.bridge import bridge_info

    return bridge_info(models).vocab_size


def _shift_to_tokens(per_position: torch.Tensor, fill: float | int) -> torch.Tensor:
    """[b, s-1] values computed at position t for token t+1 -> [b, s] aligned with the tokens
    (`fill` at column 0, which no prediction targets)."""
    out = per_position.new_full((per_position.shape[0], per_position.shape[1] + 1), fill)
    out[:, 1:] = per_position
    return out


PACKINGS = ("right", "packed", "none")


@dataclass
class _Micro:
    """One micro-batch as fed to the model, and how to map its outputs back to the batch."""

    rows: RLBatch  # the micro-batch's rows, original layout
    tokens: torch.Tensor  # [b, s] as fed
    attention_mask: torch.Tensor | None  # Megatron convention: True = masked out
    unmap: Callable[[torch.Tensor], torch.Tensor]  # [b, s] token-aligned values -> rows' layout


def _right_padded(rows: RLBatch) -> _Micro:
    fed, index = rows.to_right_padded()
    return _Micro(rows, fed.input_ids, None, lambda values: rows.restore(values, index))


def _as_is(rows: RLBatch) -> _Micro:
    return _Micro(rows, rows.input_ids, None, lambda values: values)


def _packed(rows: RLBatch, length: int) -> _Micro:
    """All real tokens of the micro-batch in one row, a block-diagonal causal mask between the
    sequences. RoPE scores depend only on q-k position differences, and no token attends across a
    sequence boundary, so the absolute offset of each packed sequence cancels out."""
    packed = pack(rows)
    pad = length - packed.total_tokens
    tokens = F.pad(packed.input_ids, (0, pad), value=rows.pad_id)
    # Segment id per packed position; the tail padding gets a segment of its own.
    segment = torch.searchsorted(packed.cu_seqlens[1:].long(), torch.arange(length), right=True)
    same = segment.unsqueeze(0) == segment.unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = ~(same & causal)  # True = masked, Megatron's convention
    return _Micro(rows, tokens, mask.view(1, 1, length, length),
                  lambda values: unpack(values[:, : packed.total_tokens], packed, rows))


def _pad_columns(micro: _Micro, multiple: int) -> _Micro:
    """Extra pad columns on the right so the length divides by `multiple` (sequence parallelism
    splits the sequence over TP ranks); causal attention keeps them out of every real token."""
    length = micro.tokens.shape[1]
    extra = -length % multiple
    if extra == 0:
        return micro
    tokens = F.pad(micro.tokens, (0, extra), value=micro.rows.pad_id)
    return _Micro(micro.rows, tokens, None, lambda values: micro.unmap(values[:, :length]))


def _micro_batches(local: RLBatch, count: int, packing: str, length_multiple: int) -> list[_Micro]:
    parts = local.split(count)
    if packing in ("right", "none"):
        micros = [(_right_padded if packing == "right" else _as_is)(p) for p in parts]
        return [_pad_columns(m, length_multiple) for m in micros]
    # Pipeline stages exchange fixed-shape activations: every packed row gets the same length.
    longest = max(int(p.lengths.sum()) for p in parts)
    length = -(-longest // length_multiple) * length_multiple
    return [_packed(p, length) for p in parts]


def megatron_logprobs(
    models: list[torch.nn.Module],
    batch: RLBatch,
    *,
    micro_batches: int = 1,
    packing: str = "right",
) -> RankLogprobs:
    """Logprobs of this rank's data-parallel share of `batch` (the global batch, same on all ranks).

    packing: "right" removes left padding (the default path); "packed" concatenates each
    micro-batch's sequences into one row with a block-diagonal causal mask (the remove-padding
    path of the local spec); "none" feeds the padded rows as they are (a negative control: left-padded
    rows then see pads and shifted positions).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from harness.launch import context

    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    device = context().device
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    local = batch.split(dp_size)[dp_rank]
    if micro_batches < 1 or local.batch_size % micro_batches:
        raise ValueError(f"{local.batch_size} rows per data-parallel rank do not split into {micro_batches} micro-batches")
    # Sequence parallelism shards the sequence over TP ranks: lengths must divide by TP.
    micros = _micro_batches(local, micro_batches, packing, ps.get_tensor_model_parallel_world_size())
    true_vocab = _true_vocab(models)
    logprob_parts: dict[int, torch.Tensor] = {}
    top1_parts: dict[int, torch.Tensor] = {}

    def forward_step(data_iterator, model):
        index = next(data_iterator)
        micro = micros[index]
        tokens = micro.tokens.to(device)
        positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
        mask = None if micro.attention_mask is None else micro.attention_mask.to(device)
        output = model(tokens, positions, mask)

        def collect(logits: torch.Tensor):
            per_position = vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], true_vocab).float()
            logprob_parts[index] = micro.unmap(_shift_to_tokens(per_position.cpu(), 0.0))
            top1 = vocab_parallel_top1(logits[:, :-1], true_vocab)
            top1_parts[index] = micro.unmap(_shift_to_tokens(top1.cpu(), -1))
            return torch.zeros((), device=device), {}

        return output, collect

    chunks = list(models)
    order = list(range(len(micros)))
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(order) for _ in chunks] if len(chunks) > 1 else iter(order),
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micros), seq_length=micros[0].tokens.shape[1],
        micro_batch_size=micros[0].tokens.shape[0], forward_only=True,
    )
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    result = RankLogprobs(dp_rank, ps.get_tensor_model_parallel_rank(), last, None, None)
    if last:
        valid = local.logprob_mask()
        lp = torch.cat([logprob_parts[i] for i in order])
        top = torch.cat([top1_parts[i] for i in order])
        result.logprobs = torch.where(valid, lp, torch.zeros_like(lp))
        result.top1 = torch.where(valid, top, torch.full_like(top, -1))
    return result


def assemble(results: list[RankLogprobs]) -> tuple[torch.Tensor, torch.Tensor]:
    """The global [B, S] logprobs and top-1 from every rank's results (parent-side)."""
    reporting = sorted((r for r in results if r.last_stage and r.tp_rank == 0), key=lambda r: r.dp_rank)
    if not reporting or any(r.logprobs is None for r in reporting):
        raise RuntimeError("no last-stage tensor-parallel rank 0 reported logprobs")
    return torch.cat([r.logprobs for r in reporting]), torch.cat([r.top1 for r in reporting])
