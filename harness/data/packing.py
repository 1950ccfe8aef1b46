"""Sequence packing for the THD / remove-padding path: the rows, pads removed, laid end to end.

Each row's real tokens occupy one slot of the packed tensor; a slot is optionally padded to a
multiple of `pad_multiple` because TE's THD attention with TP sequence parallelism or context
parallelism needs every sequence length divisible by tp * cp * 2. The slot padding sits *after* the
real tokens, so under causal attention no real token ever sees it: real-token logprobs do not
depend on it, whether or not the attention kernel is told the unpadded lengths.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from harness.data.rl_batch import RLBatch


@dataclass(frozen=True, eq=False)  # eq=False: == on tensors is elementwise
class PackedBatch:
    """A packed batch. T = sum of slot lengths.

    input_ids: [1, T] int64; slot padding holds the batch's pad_id.
    position_ids: [1, T] int64, 0, 1, ... restarting at every slot (slot padding keeps counting).
    cu_seqlens: int32 [B+1], slot boundaries (padded lengths): slot b is [cu[b], cu[b+1]). This is
        what indexes the packed tensor (Megatron's cu_seqlens_q_padded).
    cu_seqlens_unpadded: int32 [B+1], cumulative real lengths (Megatron's cu_seqlens_q).
    max_seqlen: the longest slot.
    response_mask: [1, T] bool; real_mask: [1, T] bool, False on slot padding.
    source_row, source_col: [T] int64, the batch position each packed token came from (-1 on slot
        padding); `unpack` scatters through them.
    pad_multiple: every slot length is a multiple of it.
    batch_shape: (B, S) of the batch this was packed from.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_unpadded: torch.Tensor
    max_seqlen: int
    response_mask: torch.Tensor
    real_mask: torch.Tensor
    source_row: torch.Tensor
    source_col: torch.Tensor
    pad_multiple: int
    batch_shape: tuple[int, int]

    @property
    def total_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> PackedBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device)
        return PackedBatch(**moved)


def _cumsum0(lengths: torch.Tensor) -> torch.Tensor:
    """[0, l0, l0+l1, ...] as int32, the cu_seqlens format flash-attn and TE expect."""
    zero = torch.zeros(1, dtype=torch.int64, device=lengths.device)
    return torch.cat([zero, lengths.cumsum(0)]).to(torch.int32)


def pack(batch: RLBatch, pad_multiple: int = 1) -> PackedBatch:
    """Pack the real tokens row after row, each slot padded to a multiple of pad_multiple."""
    if pad_multiple < 1:
        raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
    lengths = batch.lengths
    slots = (lengths + pad_multiple - 1) // pad_multiple * pad_multiple
    cu = _cumsum0(slots).long()
    total = int(cu[-1])
    device = batch.input_ids.device
    slot_pos = torch.arange(total, device=device)
    # Which slot each packed position falls in, and its offset inside the slot.
    row = torch.searchsorted(cu[1:], slot_pos, right=True)
    offset = slot_pos - cu[row]
    real = offset < lengths[row]
    # index[b, j] = original column of row b's j-th real token (-1 past the row's end).
    _, index = batch.to_right_padded()
    col = index[row, offset.clamp(max=batch.seq_len - 1)]
    source_row = torch.where(real, row, torch.full_like(row, -1))
    source_col = torch.where(real, col, torch.full_like(col, -1))
    safe_row, safe_col = source_row.clamp(min=0), source_col.clamp(min=0)
    ids = torch.where(real, batch.input_ids[safe_row, safe_col],
                      torch.full_like(row, batch.pad_id))
    response = real & batch.response_mask[safe_row, safe_col]
    return PackedBatch(
        input_ids=ids.unsqueeze(0), position_ids=offset.unsqueeze(0), cu_seqlens=cu.to(torch.int32),
        cu_seqlens_unpadded=_cumsum0(lengths), max_seqlen=int(slots.max()),
        response_mask=response.unsqueeze(0), real_mask=real.unsqueeze(0), source_row=source_row,
        source_col=source_col, pad_multiple=pad_multiple,
        batch_shape=(batch.batch_size, batch.seq_len))


def unpack(values: torch.Tensor, packed: PackedBatch, batch: RLBatch) -> torch.Tensor:
    """Per-token values [1, T] or [T] on the packed layout -> [B, S] on the batch's layout.

    Pad positions (and slot padding) are dropped; the result is 0 there. Note that a value computed
    at a slot's first token (e.g. a shifted logprob that crossed into the previous slot) is kept:
    mask with `batch.logprob_mask()` where the convention needs zeros.
    """
    flat = values.reshape(-1) if values.dim() == 2 and values.shape[0] == 1 else values
    if flat.dim() != 1 or flat.shape[0] != packed.total_tokens:
        raise ValueError(f"values {tuple(values.shape)} do not match the packed length "
                         f"{packed.total_tokens}: expected [1, T] or [T]")
    if packed.batch_shape != (batch.batch_size, batch.seq_len):
        raise ValueError(f"packed from a {packed.batch_shape} batch, unpacking into "
                         f"{(batch.batch_size, batch.seq_len)}")
    out = torch.zeros(packed.batch_shape, dtype=flat.dtype, device=flat.device)
    real = packed.source_row >= 0
    out[packed.source_row[real], packed.source_col[real]] = flat[real]
    return out
