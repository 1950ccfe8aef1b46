"""The single-process reference for "a correct RL training step": plain PyTorch on an HF model.

A distributed Megatron step is correct when it matches this one: same loss, same pre-clip grad
norm, same learning rate, same updated weights. Everything here is deliberately the textbook
version (torch.optim.AdamW in fp32, torch.nn.utils.clip_grad_norm_, a LambdaLR schedule), and it
is written to be *expressible* by Megatron:

- Optimizer: AdamW with decoupled weight decay applied only to >= 2-D weights; 1-D parameters
  (norms) and biases get none, which is Megatron's default parameter grouping.
- Clipping: total L2 norm over all parameters, scale by max_norm / (norm + 1e-6) when that is
  < 1: the same formula as Megatron's clip_grad_norm_fp32.
- Schedule: Megatron's OptimizerParamScheduler with init_lr = 0: linear warmup
  ``lr * n / warmup_steps`` for n <= warmup_steps, then "constant" (lr) or "cosine" decay to
  min_lr at decay_steps (min_lr after). n counts completed optimizer steps, so with warmup the
  first step runs at lr 0, exactly as in Megatron, where the scheduler is stepped after the
  optimizer.
- Gradient accumulation: the loss of each micro-batch is normalised by the *global* batch's
  token / sequence counts (see `harness.training.loss`), so the summed micro-batch gradients are
  the gradient of the whole-batch loss, whatever the split.

The model's train/eval mode is left as the caller set it (the zoo builds models in eval mode and
its configs have no dropout, which is what makes the step deterministic).
"""
from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import nn

from harness.logprobs.hf import shifted_token_outputs
from harness.training.loss import loss_counts, rl_loss
from harness.training.rl_data import RLTrainBatch

DecayStyle = Literal["constant", "cosine"]


def policy_logprobs(model: nn.Module, train_batch: RLTrainBatch) -> torch.Tensor:
    """Differentiable float32 [B, S] logprobs of the batch's tokens (the project convention).

    Same forward as the parity reference `harness.logprobs.hf.hf_token_outputs` (attention_mask
    and position_ids from the batch) but with autograd on: that one runs under no_grad.
    """
    device = next(model.parameters()).device
    batch = train_batch.batch.to(device)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long(),
                   position_ids=batch.position_ids(), use_cache=False).logits
    logprobs, _ = shifted_token_outputs(logits, batch.input_ids, batch.logprob_mask())
    return logprobs


def megatron_lr_lambda(warmup_steps: int, decay_style: DecayStyle, decay_steps: int | None,
                       min_lr_ratio: float):
    """LambdaLR factor for completed step n, mirroring Megatron's OptimizerParamScheduler.get_lr
    (init_lr = 0, max_lr = 1, min_lr = min_lr_ratio)."""
    if decay_style not in ("constant", "cosine"):
        raise ValueError(f"unknown decay_style {decay_style!r}: use constant or cosine")
    if decay_style == "cosine" and (decay_steps is None or decay_steps <= warmup_steps):
        raise ValueError(f"cosine decay needs decay_steps > warmup_steps ({warmup_steps}), "
                         f"got {decay_steps}")

    def factor(n: int) -> float:
        if warmup_steps > 0 and n <= warmup_steps:
            return n / warmup_steps
        if decay_style == "constant":
            return 1.0
        if n > decay_steps:
            return min_lr_ratio
        ratio = (n - warmup_steps) / (decay_steps - warmup_steps)
        return min_lr_ratio + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (1.0 - min_lr_ratio)

    return factor


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Megatron's default grouping: no weight decay for biases and 1-D parameters."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():  # tied weights are listed once
        if not param.requires_grad:
            continue
        (no_decay if param.dim() == 1 or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class GroundTruthTrainer:
    """Single-process RL trainer: one `step` = forward/backward over micro-batches, clip, AdamW.

    loss_kwargs go to `rl_loss` (clip_eps, clip_eps_high, kl_coef, aggregation).
    """

    def __init__(self, model: nn.Module, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, clip_grad: float | None = 1.0,
                 warmup_steps: int = 0, decay_style: DecayStyle = "constant",
                 total_steps: int | None = None, min_lr: float = 0.0,
                 **loss_kwargs: Any) -> None:
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                raise ValueError(f"the ground truth trains in fp32; got a {p.dtype} parameter")
        self.model = model
        self.clip_grad = clip_grad
        self.loss_kwargs = loss_kwargs
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(_param_groups(model, weight_decay), lr=lr,
                                           betas=betas, eps=eps, foreach=False)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            megatron_lr_lambda(warmup_steps, decay_style, total_steps, min_lr / lr if lr else 0.0))
        self.steps_done = 0

    @property
    def lr(self) -> float:
        """The learning rate the next step will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    def _micro_losses(self, train_batch: RLTrainBatch, micro_batches: int, backward: bool
                      ) -> tuple[float, list[dict[str, float]]]:
        tokens, seqs = loss_counts(train_batch)
        total = 0.0
        stats: list[dict[str, float]] = []
        for part in train_batch.split(micro_batches):
            loss, part_stats = rl_loss(policy_logprobs(self.model, part), part,
                                       global_token_count=tokens, global_seq_count=seqs,
                                       **self.loss_kwargs)
            if backward:
                loss.backward()
            total += float(loss.detach())
            stats.append({"loss": float(loss.detach()),
                          **{k: float(v) for k, v in part_stats.items()}})
        return total, stats

    def evaluate(self, train_batch: RLTrainBatch, micro_batches: int = 1) -> dict[str, Any]:
        """The loss (and stats) the current weights give, without touching them."""
        with torch.no_grad():
            loss, stats = self._micro_losses(train_batch, micro_batches, backward=False)
        return {"loss": loss, "micro_batches": stats, **_summed(stats)}

    def step(self, train_batch: RLTrainBatch, micro_batches: int = 1) -> dict[str, Any]:
        """One optimizer step on the global train_batch, accumulated over micro_batches parts.

        Returns loss (the global-batch loss, summed over parts), grad_norm (total L2 norm before
        clipping), lr (the one this step used), micro_batches (per-part loss and stats) and the
        stats summed over parts (pg_loss, kl, clip_fraction, ratio_mean, tokens).
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss, stats = self._micro_losses(train_batch, micro_batches, backward=True)
        lr = self.lr
        max_norm = float("inf") if not self.clip_grad else float(self.clip_grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=False)
        self.optimizer.step()
        self.scheduler.step()
        self.steps_done += 1
        return {"loss": loss, "grad_norm": float(grad_norm), "lr": lr,
                "micro_batches": stats, **_summed(stats)}


def _summed(stats: list[dict[str, float]]) -> dict[str, float]:
    """Stats of the global batch: every per-part stat is globally normalised, so they add."""
    keys = ("pg_loss", "kl", "clip_fraction", "ratio_mean", "tokens")
    return {k: sum(s[k] for s in stats) for k in keys}
