"""The RL batch every parity check runs on: token ids, a real-token mask and a response mask.

Logprob convention (project-wide): ``logprobs[b, t] = log p(input_ids[b, t] | real tokens of row b
before t)``, aligned with ``input_ids``; 0.0 where t is a pad or the row's first real token (nothing
predicts it). `RLBatch.logprob_mask()` is True exactly where that value is defined.

Rows are contiguous: a row's real tokens form one block that touches the left edge (right padding),
the right edge (left padding) or both (no padding). That is what rollouts produce, and it lets HF's
``cumsum(mask) - 1`` position ids and Megatron's ``0..s-1`` positions agree after
`RLBatch.to_right_padded`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

Side = Literal["left", "right", "none"]
Padding = Literal["left", "right", "mixed", "none"]


@dataclass(frozen=True, eq=False)  # eq=False: == on tensors is elementwise; compare fields instead
class RLBatch:
    """A padded batch of prompt+response rows.

    input_ids: [B, S] int64; pad positions hold ``pad_id``.
    attention_mask: [B, S] bool, True = real token.
    response_mask: [B, S] bool, True = a response token (its logprob is compared/trained).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    pad_id: int = 0

    # ---- shape -------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens per row, int64 [B]."""
        return self.attention_mask.sum(dim=1)

    def padding_sides(self) -> list[Side]:
        """Per row: "left" (pads before the tokens), "right" (pads after) or "none" (no pads)."""
        sides: list[Side] = []
        for row in self.attention_mask:
            if bool(row.all()):
                sides.append("none")
            elif not bool(row[0]):
                sides.append("left")
            else:
                sides.append("right")
        return sides

    # ---- derived per-token tensors -------------------------------------------------------------
    def position_ids(self) -> torch.Tensor:
        """HF's positions: real tokens count 0, 1, ... from the row's first real token.

        Left pads get 0 (clamped) and right pads repeat the last position; neither is attended.
        """
        return (self.attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)

    def logprob_mask(self) -> torch.Tensor:
        """bool [B, S]: True where the logprob convention defines a value (a real token with a real
        token before it). Contiguous rows make "the previous column is real" the same test."""
        mask = self.attention_mask.clone()
        mask[:, 0] = False
        mask[:, 1:] &= self.attention_mask[:, :-1]
        return mask

    # ---- layout transforms ------------------------------------------------------------------
    def to_right_padded(self) -> tuple[RLBatch, torch.Tensor]:
        """Move every row's real tokens to start at column 0 ("remove left padding").

        Why Megatron needs it: after this transform every pad comes after the row's real tokens,
        so a plain causal mask is exact for every real token (no padding mask needed), and column
        j *is* position j, matching Megatron's default positions 0..s-1. (RoPE scores depend only
        on position differences, so shifted positions are exact in real arithmetic, but they round
        differently: visible in bf16.)

        Returns ``(right_padded, index)``: ``index[b, j]`` is the original column of right-padded
        column j, or -1 where column j is a pad. Pass it to `restore`.
        """
        # A stable sort of "is pad" puts the real tokens first, in their original order.
        order = torch.sort((~self.attention_mask).to(torch.int8), dim=1, stable=True).indices
        cols = torch.arange(self.seq_len, device=self.input_ids.device)
        real = cols.unsqueeze(0) < self.lengths.unsqueeze(1)
        index = torch.where(real, order, torch.full_like(order, -1))
        ids = torch.where(real, self.input_ids.gather(1, order),
                          torch.full_like(self.input_ids, self.pad_id))
        response = self.response_mask.gather(1, order) & real
        return replace(self, input_ids=ids, attention_mask=real, response_mask=response), index

    def restore(self, values_right_padded: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Map per-token values [B, S] computed on ``self.to_right_padded()[0]`` back to this
        batch's columns; pad columns get 0."""
        shape = (self.batch_size, self.seq_len)
        if tuple(values_right_padded.shape) != shape or tuple(index.shape) != shape:
            raise ValueError(f"restore: values {tuple(values_right_padded.shape)} and index "
                             f"{tuple(index.shape)} must both be {shape}")
        out = torch.zeros_like(values_right_padded)
        valid = index >= 0
        rows = torch.arange(self.batch_size, device=index.device).unsqueeze(1).expand(shape)
        out[rows[valid], index[valid]] = values_right_padded[valid]
        return out

    def split(self, n: int) -> list[RLBatch]:
        """n equal consecutive parts (micro-batches or DP shards); ValueError if B % n != 0."""
        if n < 1 or self.batch_size % n:
            raise ValueError(f"cannot split a batch of {self.batch_size} rows into {n} equal parts")
        size = self.batch_size // n
        return [self._rows(slice(i * size, (i + 1) * size)) for i in range(n)]

    def _rows(self, rows: slice) -> RLBatch:
        return replace(self, input_ids=self.input_ids[rows],
                       attention_mask=self.attention_mask[rows],
                       response_mask=self.response_mask[rows])

    def to(self, device: torch.device | str) -> RLBatch:
        return replace(self, input_ids=self.input_ids.to(device),
                       attention_mask=self.attention_mask.to(device),
                       response_mask=self.response_mask.to(device))

    # ---- checks -----------------------------------------------------------------------------
    def validate(self, vocab_size: int | None = None) -> RLBatch:
        """Raise ValueError naming the first broken rule; return self so calls can chain."""
        ids, attn, resp = self.input_ids, self.attention_mask, self.response_mask
        if ids.dim() != 2 or attn.shape != ids.shape or resp.shape != ids.shape:
            raise ValueError(f"input_ids {tuple(ids.shape)}, attention_mask {tuple(attn.shape)} "
                             f"and response_mask {tuple(resp.shape)} must be equal [B, S] shapes")
        if ids.dtype != torch.int64:
            raise ValueError(f"input_ids must be int64, got {ids.dtype}")
        if attn.dtype != torch.bool or resp.dtype != torch.bool:
            raise ValueError(f"masks must be bool, got attention_mask {attn.dtype}, "
                             f"response_mask {resp.dtype}")
        if self.batch_size == 0 or self.seq_len == 0:
            raise ValueError(f"empty batch {tuple(ids.shape)}")
        if vocab_size is not None and not (0 <= self.pad_id < vocab_size):
            raise ValueError(f"pad_id {self.pad_id} is outside the vocab [0, {vocab_size})")
        if vocab_size is not None and (bool((ids < 0).any()) or bool((ids >= vocab_size).any())):
            raise ValueError(f"token ids span [{int(ids.min())}, {int(ids.max())}], outside the "
                             f"vocab [0, {vocab_size})")
        _check_rows(attn)
        if bool((ids[~attn] != self.pad_id).any()):
            raise ValueError(f"pad positions must hold pad_id {self.pad_id}")
        if bool((resp & ~attn).any()):
            raise ValueError("response_mask marks pad positions: it must be a subset of "
                             "attention_mask")
        orphans = resp & ~self.logprob_mask()
        if bool(orphans.any()):
            row = int(orphans.any(dim=1).nonzero()[0])
            raise ValueError(f"row {row}: a response token has no real token before it "
                             "(every response needs a prompt of length >= 1)")
        return self


def _check_rows(attn: torch.Tensor) -> None:
    """Every row has a real token, and its real tokens are one block touching an edge."""
    lengths = attn.sum(dim=1)
    if bool((lengths == 0).any()):
        raise ValueError(f"row {int((lengths == 0).nonzero()[0])} has no real tokens")
    # Number of pad->real switches plus a real first column = number of real blocks.
    starts = (attn[:, 1:] & ~attn[:, :-1]).sum(dim=1) + attn[:, 0].long()
    bad = (starts != 1) | (~attn[:, 0] & ~attn[:, -1])
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(f"row {row}: real tokens must be one contiguous block padded on one side "
                         f"only (mask {attn[row].int().tolist()})")


# ---- generators ------------------------------------------------------------------------------
def make_rl_batch(vocab_size: int, *, batch_size: int, prompt_lengths: int | Sequence[int],
                  response_lengths: int | Sequence[int], padding: Padding | Sequence[Side],
                  seq_len: int | None = None, seed: int, pad_id: int = 0) -> RLBatch:
    """A random valid batch, identical for identical arguments.

    padding: "left" / "right": every row shorter than seq_len is padded on that side; "none": no
    pads (all rows must have length seq_len); "mixed": rows shorter than seq_len alternate left and
    right in a seed-shuffled order (so both occur once there are two short rows); or one side per
    row. A row of full length is unpadded whatever is asked. seq_len defaults to the longest row.
    Real tokens are uniform over the whole vocab, pad_id included, so code that finds pads by id
    instead of by mask gets caught.
    """
    prompts = _per_row(prompt_lengths, batch_size, "prompt_lengths")
    responses = _per_row(response_lengths, batch_size, "response_lengths")
    if min(prompts) < 1 or min(responses) < 0:
        raise ValueError("prompt lengths must be >= 1 and response lengths >= 0")
    lengths = [p + r for p, r in zip(prompts, responses)]
    seq_len = max(lengths) if seq_len is None else seq_len
    if seq_len < max(lengths):
        raise ValueError(f"seq_len {seq_len} is shorter than the longest row ({max(lengths)})")
    generator = torch.Generator().manual_seed(seed)
    sides = _sides(padding, lengths, seq_len, generator)
    ids = torch.full((batch_size, seq_len), pad_id, dtype=torch.int64)
    attn = torch.zeros((batch_size, seq_len), dtype=torch.bool)
    resp = torch.zeros_like(attn)
    for row, (prompt, length, side) in enumerate(zip(prompts, lengths, sides)):
        start = seq_len - length if side == "left" else 0
        tokens = torch.randint(0, vocab_size, (length,), generator=generator)
        ids[row, start:start + length] = tokens
        attn[row, start:start + length] = True
        resp[row, start + prompt:start + length] = True
    return RLBatch(ids, attn, resp, pad_id).validate(vocab_size)


def _per_row(value: int | Sequence[int], batch_size: int, name: str) -> list[int]:
    values = [int(value)] * batch_size if isinstance(value, int) else [int(v) for v in value]
    if len(values) != batch_size:
        raise ValueError(f"{name} has {len(values)} entries for batch_size {batch_size}")
    return values


def _sides(padding: Padding | Sequence[Side], lengths: list[int], seq_len: int,
           generator: torch.Generator) -> list[Side]:
    short = {i for i, length in enumerate(lengths) if length < seq_len}
    if not isinstance(padding, str):
        sides = list(padding)
        if len(sides) != len(lengths) or not set(sides) <= {"left", "right", "none"}:
            raise ValueError(f"padding must give one of left/right/none per row, got {sides}")
        if any(sides[i] == "none" for i in short):
            raise ValueError("a row shorter than seq_len cannot be unpadded")
        return [side if i in short else "none" for i, side in enumerate(sides)]
    if padding == "none":
        if short:
            raise ValueError(f"padding='none' needs every row to have length {seq_len}; rows "
                             f"{sorted(short)} are shorter")
        return ["none"] * len(lengths)
    if padding in ("left", "right"):
        return [padding if i in short else "none" for i in range(len(lengths))]
    if padding == "mixed":
        alternating = ["left" if k % 2 == 0 else "right" for k in range(len(short))]
        order = torch.randperm(len(short), generator=generator).tolist()
        shuffled = [alternating[k] for k in order]
        sides: list[Side] = ["none"] * len(lengths)
        for i, side in zip(sorted(short), shuffled):
            sides[i] = side
        return sides
    raise ValueError(f"unknown padding {padding!r}: use left, right, mixed, none or a list")


# (prompt, response, side) per row of the default parity batch: 8 rows of 24 columns, so it
# splits into 1, 2, 4 or 8 micro/DP parts and every 2-row part holds two different sides.
_STANDARD_ROWS: tuple[tuple[int, int, Side], ...] = (
    (5, 19, "none"),
    (3, 9, "left"),
    (7, 10, "right"),
    (1, 23, "none"),    # shortest possible prompt
    (10, 4, "left"),
    (2, 13, "right"),
    (12, 1, "left"),    # single response token
    (4, 16, "right"),
)
STANDARD_SEQ_LEN = 24


def standard_parity_batch(vocab_size: int, seed: int = 0) -> RLBatch:
    """The default parity batch: 8 x 24, variable prompt/response lengths, with left-padded,
    right-padded and unpadded rows.

    Two traps are planted: the last response token of row 2 (right-padded, so it sits right
    before the pads) and a prompt token of row 4 equal pad_id, as when EOS doubles as pad. A
    backend that derives the mask from ids rather than attention_mask gets these wrong.
    """
    prompts, responses, sides = zip(*_STANDARD_ROWS)
    batch = make_rl_batch(vocab_size, batch_size=len(_STANDARD_ROWS), prompt_lengths=prompts,
                          response_lengths=responses, padding=sides, seq_len=STANDARD_SEQ_LEN,
                          seed=seed)
    ids = batch.input_ids.clone()
    ids[2, prompts[2] + responses[2] - 1] = batch.pad_id
    left_start_4 = STANDARD_SEQ_LEN - prompts[4] - responses[4]
    ids[4, left_start_4 + 1] = batch.pad_id
    return replace(batch, input_ids=ids).validate(vocab_size)
