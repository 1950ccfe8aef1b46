"""Micro-batches as fed to a Megatron model, and how to map its outputs back to the batch's rows.

Pure tensor code (no Megatron). Left padding is removed before Megatron sees a row (every row
shifted so its real tokens start at column 0): Megatron's RoPE uses positions 0..s-1 whatever
`position_ids` says, and with the pads at the end the causal mask alone keeps them out of every
real token's view. Shared by the logprob forward and the policy's training step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from harness.data.packing import pack, unpack
from harness.data.rl_batch import RLBatch

PACKINGS = ("right", "packed", "thd", "none")


@dataclass
class MicroBatch:
    """One micro-batch as fed to the model, and how to map its outputs back to the batch."""

    rows: RLBatch  # the micro-batch's rows, original layout
    tokens: torch.Tensor  # [b, s] as fed
    attention_mask: torch.Tensor | None  # Megatron convention: True = masked out
    unmap: Callable[[torch.Tensor], torch.Tensor]  # [b, s] token-aligned values -> rows' layout
    cu_seqlens: torch.Tensor | None = None  # thd: int32 sequence boundaries of the one packed row
    max_seqlen: int = 0  # thd: the longest sequence

    def cp_positions(self, cp: int, rank: int) -> torch.Tensor:
        """The columns CP rank `rank` of `cp` is fed (harness.logprobs.context_parallel)."""
        from harness.logprobs.context_parallel import rank_positions

        return rank_positions(self.tokens.shape[1], self.cu_seqlens, cp, rank)


def shift_to_tokens(per_position: torch.Tensor, fill: float | int) -> torch.Tensor:
    """[b, s-1] values computed at position t for token t+1 -> [b, s] aligned with the tokens
    (`fill` at column 0, which no prediction targets)."""
    out = per_position.new_full((per_position.shape[0], per_position.shape[1] + 1), fill)
    out[:, 1:] = per_position
    return out


def right_padded(rows: RLBatch) -> MicroBatch:
    """The rows with their left padding moved to the right (the default path)."""
    fed, index = rows.to_right_padded()
    return MicroBatch(rows, fed.input_ids, None, lambda values: rows.restore(values, index))


def as_is(rows: RLBatch) -> MicroBatch:
    """The rows exactly as they are (a negative control: left pads then shift positions)."""
    return MicroBatch(rows, rows.input_ids, None, lambda values: values)


def packed(rows: RLBatch, length: int) -> MicroBatch:
    """All real tokens of the micro-batch in one row, a block-diagonal causal mask between the
    sequences. RoPE scores depend only on q-k position differences, and no token attends across a
    sequence boundary, so the absolute offset of each packed sequence cancels out."""
    packed_rows = pack(rows)
    pad = length - packed_rows.total_tokens
    tokens = F.pad(packed_rows.input_ids, (0, pad), value=rows.pad_id)
    # Segment id per packed position; the tail padding gets a segment of its own.
    segment = torch.searchsorted(packed_rows.cu_seqlens[1:].long(), torch.arange(length), right=True)
    same = segment.unsqueeze(0) == segment.unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = ~(same & causal)  # True = masked, Megatron's convention
    return MicroBatch(rows, tokens, mask.view(1, 1, length, length),
                      lambda values: unpack(values[:, : packed_rows.total_tokens], packed_rows, rows))


def thd(rows: RLBatch, length: int, slot_multiple: int = 1) -> MicroBatch:
    """`packed`'s row fed the way verl and NeMo-RL feed Transformer Engine (remove-padding): no mask,
    the sequence boundaries as cu_seqlens through TE's attention (qkv_format "thd"); Megatron's RoPE
    restarts the positions at every boundary. The tail padding is a sequence of its own. Each
    sequence's slot is padded (after its tokens) to a multiple of `slot_multiple` (context parallelism
    splits every sequence into 2 x cp chunks)."""
    packed_rows = pack(rows, slot_multiple)
    pad = length - packed_rows.total_tokens
    tokens = F.pad(packed_rows.input_ids, (0, pad), value=rows.pad_id)
    cu = packed_rows.cu_seqlens.to(torch.int32)
    if pad:
        cu = torch.cat([cu, torch.tensor([length], dtype=torch.int32)])
    return MicroBatch(rows, tokens, None, lambda values: unpack(values[:, : packed_rows.total_tokens], packed_rows, rows),
                      cu_seqlens=cu, max_seqlen=int((cu[1:] - cu[:-1]).max()))


def pad_columns(micro: MicroBatch, multiple: int) -> MicroBatch:
    """Extra pad columns on the right so the length divides by `multiple` (sequence parallelism
    splits the sequence over TP ranks); causal attention keeps them out of every real token."""
    length = micro.tokens.shape[1]
    extra = -length % multiple
    if extra == 0:
        return micro
    tokens = F.pad(micro.tokens, (0, extra), value=micro.rows.pad_id)
    return MicroBatch(micro.rows, tokens, None, lambda values: micro.unmap(values[:, :length]))


def split_micro_batches(local: RLBatch, count: int, packing: str = "right",
                        length_multiple: int = 1, slot_multiple: int = 1) -> list[MicroBatch]:
    """`local` (one data-parallel rank's rows) as `count` micro-batches fed the `packing` way.
    `length_multiple`: every micro-batch's length divides by it; `slot_multiple`: with "thd" every
    sequence's slot does too (context parallelism: `harness.logprobs.context_parallel.length_multiple`)."""
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    if count < 1 or local.batch_size % count:
        raise ValueError(f"{local.batch_size} rows per data-parallel rank do not split into "
                         f"{count} micro-batches")
    parts = local.split(count)
    if packing in ("right", "none"):
        micros = [(right_padded if packing == "right" else as_is)(p) for p in parts]
        return [pad_columns(m, length_multiple) for m in micros]
    # Pipeline stages exchange fixed-shape activations: every packed row gets the same length.
    slot = slot_multiple if packing == "thd" else 1
    longest = max(int((-(-p.lengths // slot) * slot).sum()) for p in parts)
    length = -(-longest // length_multiple) * length_multiple
    if packing == "thd":
        return [thd(p, length, slot) for p in parts]
    return [packed(p, length) for p in parts]
