"""The RL policy loss (PPO / GRPO clipped surrogate, optional k3 KL to a reference policy).

Why the counts are parameters: a distributed trainer never sees the whole batch at once. It
computes the loss per micro-batch and per data-parallel rank, sums the gradients (accumulation
adds them, DP all-reduce sums or averages them), and must end up with the gradient of the loss of
the *global* batch. A mean over *local* tokens breaks that as soon as parts hold different numbers
of tokens. So every aggregation here is written as ``sum over local units / global count``: pass
the count of the whole global batch as ``global_token_count`` / ``global_seq_count`` and the
per-part losses (and gradients) add up to the global ones. Left as None, the counts are the local
ones, which is the plain single-batch loss.

Aggregations (names as in verl's ``loss_agg_mode``):

- "token-mean": sum over all loss tokens of the per-token loss / number of loss tokens. Every
  token weighs the same, so long responses weigh more.
- "seq-mean-token-mean": per sequence, the mean over its loss tokens; then the mean over
  sequences. Every sequence weighs the same whatever its length.
- "seq-mean-token-sum": per sequence, the sum over its loss tokens; then the mean over sequences.

A "sequence" for the two sequence-level modes is a row with at least one loss token: rows
without one contribute nothing and are not counted (so the default count matches what a
trainer would pass as global_seq_count after counting the same way, see `loss_counts`).
"""
from __future__ import annotations

from typing import Literal

import torch

from harness.training.rl_data import RLTrainBatch

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def loss_counts(train_batch: RLTrainBatch) -> tuple[int, int]:
    """(tokens, sequences) the loss normalises by: loss tokens, and rows with >= 1 loss token.

    A trainer calls this on the *global* batch and passes the results to `rl_loss` on every part.
    """
    per_row = train_batch.loss_mask().sum(dim=1)
    return int(per_row.sum()), int((per_row > 0).sum())


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      advantages: torch.Tensor, clip_eps: float, clip_eps_high: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO policy loss ``-min(r A, clip(r, 1 - eps, 1 + eps_high) A)``, r = exp(lp - old).

    Returns (pg, ratio, clipped) where clipped is True where the clipped term is the one chosen
    and differs from the unclipped one (so its gradient is 0 there). The asymmetric upper bound
    (eps_high) is DAPO's "clip-higher"; eps_high = eps is standard PPO.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -ratio * advantages
    clipped_loss = -torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high) * advantages
    pg = torch.maximum(unclipped, clipped_loss)
    return pg, ratio, clipped_loss > unclipped


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || ref): ``exp(ref - lp) - (ref - lp) - 1``.

    Non-negative, 0 exactly where lp == ref, unbiased for tokens sampled from the policy (the
    estimator GRPO uses). No clamping: the reference must see the raw value.
    """
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation,
              global_token_count: int | float | None = None,
              global_seq_count: int | float | None = None) -> torch.Tensor:
    """Reduce per-token values [B, S] over the bool mask to a scalar, as a local sum divided by a
    global count (see the module docstring), so that parts' results add up to the whole's."""
    values = torch.where(mask, values, torch.zeros_like(values))
    if aggregation == "token-mean":
        count = int(mask.sum()) if global_token_count is None else global_token_count
        return values.sum() / max(count, 1)
    if aggregation not in ("seq-mean-token-mean", "seq-mean-token-sum"):
        raise ValueError(f"unknown aggregation {aggregation!r}: use one of {AGGREGATIONS}")
    tokens_per_seq = mask.sum(dim=1)
    per_seq = values.sum(dim=1)
    if aggregation == "seq-mean-token-mean":
        per_seq = per_seq / tokens_per_seq.clamp(min=1).to(per_seq.dtype)
    count = int((tokens_per_seq > 0).sum()) if global_seq_count is None else global_seq_count
    return per_seq.sum() / max(count, 1)


def rl_loss(logprobs: torch.Tensor, train_batch: RLTrainBatch, *, clip_eps: float = 0.2,
            clip_eps_high: float | None = None, kl_coef: float = 0.0,
            aggregation: Aggregation = "token-mean",
            global_token_count: int | float | None = None,
            global_seq_count: int | float | None = None
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, stats) of the current policy's per-token logprobs [B, S] on train_batch.

    loss = aggregate(pg + kl_coef * k3_kl) over ``response_mask & logprob_mask``. Computed in at
    least float32 (bf16 logprobs are upcast), differentiable w.r.t. logprobs.

    stats (detached 0-dim tensors), all normalised by the same global counts as the loss so that
    summing them over the parts of a global batch gives the global value:
      pg_loss: the aggregated policy-gradient term; kl: the aggregated k3 KL (before kl_coef);
      clip_fraction: share of loss tokens where clipping zeroes the gradient (token-normalised);
      ratio_mean: mean ratio over loss tokens (token-normalised); tokens: local loss-token count.
    """
    if tuple(logprobs.shape) != tuple(train_batch.advantages.shape):
        raise ValueError(f"logprobs {tuple(logprobs.shape)} vs batch "
                         f"{tuple(train_batch.advantages.shape)}")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp = logprobs.to(dtype)
    mask = train_batch.loss_mask().to(lp.device)
    zeros = torch.zeros_like(lp)
    # Masked positions become lp = old = ref = A = 0 (constants): finite whatever the inputs
    # hold there, so no NaN/inf from a pad column can reach the loss or the gradient.
    lp = torch.where(mask, lp, zeros)
    old = torch.where(mask, train_batch.old_logprobs.to(lp.device, dtype), zeros)
    ref = torch.where(mask, train_batch.ref_logprobs.to(lp.device, dtype), zeros)
    adv = torch.where(mask, train_batch.advantages.to(lp.device, dtype), zeros)

    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    pg, ratio, clipped = clipped_surrogate(lp, old, adv, clip_eps, eps_high)
    kl = k3_kl(lp, ref)
    per_token = pg + kl_coef * kl if kl_coef else pg

    counts = dict(global_token_count=global_token_count, global_seq_count=global_seq_count)
    loss = aggregate(per_token, mask, aggregation, **counts)
    with torch.no_grad():
        token_count = int(mask.sum()) if global_token_count is None else global_token_count
        stats = {
            "pg_loss": aggregate(pg, mask, aggregation, **counts),
            "kl": aggregate(kl, mask, aggregation, **counts),
            "clip_fraction": (clipped & mask).sum().to(dtype) / max(token_count, 1),
            "ratio_mean": torch.where(mask, ratio, zeros).sum() / max(token_count, 1),
            "tokens": mask.sum(),
        }
    return loss, {k: v.detach() for k, v in stats.items()}
