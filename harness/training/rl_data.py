"""An RL *training* batch: an `RLBatch` plus the per-token tensors the policy loss needs.

Everything is drawn for the global batch from one generator and only then split, so a batch is
identical however it is later cut into micro-batches or data-parallel shards: the concatenation of
`RLTrainBatch.split(n)` is the whole batch, bit for bit. That is what lets a distributed run be
compared against the single-process ground truth on the same numbers.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from harness.data.rl_batch import Padding, RLBatch, Side, make_rl_batch

# Offset between the token seed and the seed of the loss tensors: the tokens stay exactly those of
# make_rl_batch(seed), and the loss tensors come from an independent stream.
_TENSOR_SEED_OFFSET = 7_919


@dataclass(frozen=True, eq=False)  # eq=False: == on tensors is elementwise
class RLTrainBatch:
    """batch plus float32 [B, S] per-token tensors, all aligned with ``batch.input_ids``.

    advantages: GRPO-style, one scalar per sequence broadcast over its response tokens, 0 elsewhere.
    old_logprobs: logprobs of the behaviour policy (the one that sampled), for the PPO ratio.
    ref_logprobs: logprobs of the frozen reference policy, for the KL penalty.
    The logprob tensors follow the project convention (0 where undefined); values outside
    `loss_mask()` are ignored by the loss.
    """

    batch: RLBatch
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor

    def __post_init__(self) -> None:
        shape = tuple(self.batch.input_ids.shape)
        for name in ("advantages", "old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if tuple(value.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {shape}")
            if not value.is_floating_point():
                raise ValueError(f"{name} must be floating point, got {value.dtype}")

    @property
    def batch_size(self) -> int:
        return self.batch.batch_size

    def loss_mask(self) -> torch.Tensor:
        """bool [B, S]: the tokens the loss trains on: response tokens whose logprob is defined."""
        return self.batch.response_mask & self.batch.logprob_mask()

    def split(self, n: int) -> list[RLTrainBatch]:
        """n equal consecutive parts, row-aligned with `RLBatch.split`; ValueError if B % n."""
        parts = self.batch.split(n)  # raises on a bad n
        size = self.batch_size // n
        return [RLTrainBatch(part, self.advantages[i * size:(i + 1) * size],
                             self.old_logprobs[i * size:(i + 1) * size],
                             self.ref_logprobs[i * size:(i + 1) * size])
                for i, part in enumerate(parts)]

    def to(self, device: torch.device | str) -> RLTrainBatch:
        return RLTrainBatch(self.batch.to(device), self.advantages.to(device),
                            self.old_logprobs.to(device), self.ref_logprobs.to(device))

    def with_old_logprobs(self, old_logprobs: torch.Tensor,
                          ref_logprobs: torch.Tensor | None = None) -> RLTrainBatch:
        """A copy whose behaviour (and optionally reference) logprobs are the given ones, zeroed
        outside `loss_mask()`. Use it to make a batch on-policy for a given model (ratio = 1 on
        the first step), as in a real RL loop where old_logprobs come from the current policy."""
        mask = self.loss_mask()
        old = torch.where(mask, old_logprobs.detach().float(), torch.zeros_like(self.old_logprobs))
        ref = self.ref_logprobs if ref_logprobs is None else torch.where(
            mask, ref_logprobs.detach().float(), torch.zeros_like(self.ref_logprobs))
        return replace(self, old_logprobs=old, ref_logprobs=ref)


def concat_train_batches(parts: Sequence[RLTrainBatch]) -> RLTrainBatch:
    """Inverse of `RLTrainBatch.split` (all parts must share seq_len and pad_id)."""
    if not parts:
        raise ValueError("nothing to concatenate")
    pad_ids = {p.batch.pad_id for p in parts}
    if len(pad_ids) != 1:
        raise ValueError(f"parts disagree on pad_id: {sorted(pad_ids)}")
    batch = RLBatch(torch.cat([p.batch.input_ids for p in parts]),
                    torch.cat([p.batch.attention_mask for p in parts]),
                    torch.cat([p.batch.response_mask for p in parts]), pad_ids.pop())
    return RLTrainBatch(batch, torch.cat([p.advantages for p in parts]),
                        torch.cat([p.old_logprobs for p in parts]),
                        torch.cat([p.ref_logprobs for p in parts]))


def make_rl_train_batch(vocab_size: int, *, batch_size: int, seed: int,
                        prompt_lengths: int | Sequence[int],
                        response_lengths: int | Sequence[int],
                        padding: Padding | Sequence[Side] = "mixed",
                        seq_len: int | None = None,
                        old_logprob_noise: float = 0.05) -> RLTrainBatch:
    """A random valid training batch, identical for identical arguments.

    Tokens are `make_rl_batch(..., seed=seed)`. Then, from one generator for the whole batch:
    advantages ~ N(0, 1) per sequence (what GRPO's group-normalised rewards look like), broadcast
    over the row's loss tokens; old and ref logprobs = -log(vocab_size) + noise * N(0, 1) (the
    logprob of a near-uniform policy, which is what a randomly initialised model has), each with
    its own draws, on loss tokens only. Outside `loss_mask()` all three are 0.
    """
    batch = make_rl_batch(vocab_size, batch_size=batch_size, prompt_lengths=prompt_lengths,
                          response_lengths=response_lengths, padding=padding, seq_len=seq_len,
                          seed=seed)
    generator = torch.Generator().manual_seed(seed + _TENSOR_SEED_OFFSET)
    shape = tuple(batch.input_ids.shape)
    per_seq = torch.randn((batch_size, 1), generator=generator, dtype=torch.float32)
    old_noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    ref_noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    mask = batch.response_mask & batch.logprob_mask()
    zeros = torch.zeros(shape, dtype=torch.float32)
    base = -math.log(vocab_size)
    advantages = torch.where(mask, per_seq.expand(shape), zeros)
    old = torch.where(mask, base + old_logprob_noise * old_noise, zeros)
    ref = torch.where(mask, base + old_logprob_noise * ref_noise, zeros)
    return RLTrainBatch(batch, advantages, old, ref)
