"""The single-process reference for "a correct RL training step": plain PyTorch on an HF model.

A distributed Megatron step is correct when it matches this one: same loss, same pre-clip grad
norm, same learning rate, same updated weights. Everything here is deliberately the textbook
version (torch.optim.AdamW in fp32, Megatron's clipping formula, a LambdaLR schedule), and it
is written to be *expressible* by Megatron:

- Optimizer: AdamW with decoupled weight decay applied only to >= 2-D weights; 1-D parameters
  (norms) and biases get none, which is Megatron's default parameter grouping.
- Clipping: total L2 norm over all parameters (accumulated in float64: `exact_grad_norm`), scale by
  max_norm / (norm + 1e-6) when that is < 1: the same formula as Megatron's clip_grad_norm_fp32.
- Schedule: Megatron's OptimizerParamScheduler with init_lr = 0: linear warmup
  ``lr * n / warmup_steps`` for n <= warmup_steps, then "constant" (lr) or "cosine" decay to
  min_lr at decay_steps (min_lr after). n counts completed optimizer steps, so with warmup the
  first step runs at lr 0, exactly as in Megatron, where the scheduler is stepped after the
  optimizer.
- Weights (`weights="bf16"`): Megatron's bf16 training keeps fp32 main parameters and runs the model
  on their bf16 copy (the main parameters start as the loaded bf16 weights, upcast). The ground truth
  then does the same: its fp32 weights start rounded to bf16, and each step's forward and backward
  run on them rounded to bf16 (in fp32 arithmetic), the gradient applied to the unrounded fp32
  weights. Below bf16's resolution (RL's lr 1e-6 at real widths: Adam moves a weight of 0.016 by
  1e-6, its bf16 spacing is 6e-5) the bf16 copy barely follows the fp32 weights, so the second
  step's forward of a plain fp32 ground truth sees an update that no bf16 run can see
  (qwen3-8b-shape on an H200: step-2 loss 0.39 apart, step 1 within 1.8e-3).
- HF's own bf16 (`bf16_yardstick=True`, with weights="bf16"): each step also records the loss the model itself
  in bf16 gives on the state the step starts from (`hf_bf16_loss`): how far the reference implementation's own
  bf16 rounding moves the loss, the yardstick a bf16 training gap is read against where HF's bf16 is the noisy
  side (suites/models/test_shapes.py, NOISY_HF_BF16). It changes nothing in the steps: the model goes to bf16
  and back on values bf16 holds exactly, its floating buffers (RoPE's inverse frequencies) put back as they were.
- Gradient accumulation: the loss of each micro-batch is normalised by the *global* batch's
  token / sequence counts (see `harness.training.loss`), so the summed micro-batch gradients are
  the gradient of the whole-batch loss, whatever the split.

The model's train/eval mode is left as the caller set it (the zoo builds models in eval mode and
its configs have no dropout, which is what makes the step deterministic).
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Literal

import torch
from torch import nn

from harness.logprobs.hf import shifted_token_outputs
from harness.training.loss import loss_counts, rl_loss
from harness.training.rl_data import RLTrainBatch

DecayStyle = Literal["constant", "cosine"]


def policy_logprobs(model: nn.Module, train_batch: RLTrainBatch, *,
                    batch_invariant: bool = True) -> torch.Tensor:
    """Differentiable float32 [B, S] logprobs of the batch's tokens (the project convention).

    Same forward as the parity reference `harness.logprobs.hf.hf_token_outputs` (attention_mask
    and position_ids from the batch) but with autograd on: that one runs under no_grad.

    batch_invariant (default): one forward per row. A batched fp32 forward is not bit-identical
    across batch sizes (kernels block the matmuls differently; ~1e-6 on logprobs), which would
    make the reference's loss depend on the micro-batch split by more than rounding of the final
    sums. Row by row, a row's logprobs are the same bits in every split, so micro_batches=1, 2, 4
    differ only in summation order (~1e-7). False: one forward for the whole part (faster).
    """
    device = next(model.parameters()).device
    if next(model.parameters()).dtype == torch.float64:
        return _unpadded_logprobs(model, train_batch)
    batch = train_batch.batch.to(device)
    rows = batch.split(batch.batch_size) if batch_invariant else [batch]
    out = []
    for part in rows:
        logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask.long(),
                       position_ids=part.position_ids(), use_cache=False).logits
        out.append(shifted_token_outputs(logits, part.input_ids, part.logprob_mask())[0])
    return torch.cat(out)


def _unpadded_logprobs(model: nn.Module, train_batch: RLTrainBatch) -> torch.Tensor:
    """policy_logprobs of a float64 model: one row at a time on its real tokens only (no attention mask), as
    `harness.logprobs.hf.hf_unpadded_token_outputs` with autograd on. HF's float64 mask is -inf, so a padded
    position's fully masked query row would be NaN, which the next layer carries into every row."""
    device = next(model.parameters()).device
    batch = train_batch.batch
    valid = batch.logprob_mask()
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float64, device=device)
    for row in range(batch.batch_size):
        real = batch.attention_mask[row].nonzero().flatten()
        if len(real) == 0:
            continue
        first, last = int(real[0]), int(real[-1]) + 1
        if len(real) != last - first:
            raise ValueError(f"row {row}: its real tokens are not contiguous")
        ids = batch.input_ids[row:row + 1, first:last].to(device)
        logits = model(input_ids=ids, position_ids=torch.arange(last - first, device=device)[None],
                       use_cache=False).logits
        out[row, first:last] = shifted_token_outputs(logits, ids, valid[row:row + 1, first:last].to(device))[0][0]
    return out


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
    total_steps is Megatron's lr_decay_steps (needed for decay_style="cosine"); min_lr its min_lr.
    batch_invariant: run rows one at a time so that micro_batches changes nothing, bit for bit
    (see `_micro_losses`); False for true batched gradient accumulation.
    """

    def __init__(self, model: nn.Module, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, clip_grad: float | None = 1.0,
                 warmup_steps: int = 0, decay_style: DecayStyle = "constant",
                 total_steps: int | None = None, min_lr: float = 0.0,
                 batch_invariant: bool = True, weights: str = "fp32", bf16_yardstick: bool = False,
                 **loss_kwargs: Any) -> None:
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                raise ValueError(f"the ground truth trains in fp32; got a {p.dtype} parameter")
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {list(WEIGHTS)}, got {weights!r}")
        if bf16_yardstick and weights != "bf16":
            raise ValueError("bf16_yardstick needs weights='bf16': HF's bf16 runs on the weights rounded to bf16")
        self.model = model
        self.weights = WEIGHTS[weights]
        self.bf16_yardstick = bf16_yardstick
        if self.weights is not None:
            round_weights(model.parameters(), self.weights)  # the main parameters start as the loaded bf16 weights
        self.clip_grad = clip_grad
        self.batch_invariant = batch_invariant
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
        """Forward (and backward) every micro-batch, each loss normalised by the global counts.

        batch_invariant: each micro-batch is further run one row at a time, forward *and*
        backward, so the gradient is accumulated row by row in the same order whatever the split:
        micro_batches then changes nothing, bit for bit (the reference is unique). Otherwise one
        forward/backward per micro-batch: true gradient accumulation, equal across splits to
        fp32 rounding (~1e-6; batched kernels round differently per batch size).
        """
        tokens, seqs = loss_counts(train_batch)
        total = 0.0
        stats: list[dict[str, float]] = []
        for part in train_batch.split(micro_batches):
            chunks = part.split(part.batch_size) if self.batch_invariant else [part]
            part_loss = 0.0
            part_stats: dict[str, float] = {}
            for chunk in chunks:
                logprobs = policy_logprobs(self.model, chunk, batch_invariant=False)
                loss, chunk_stats = rl_loss(logprobs, chunk, global_token_count=tokens,
                                            global_seq_count=seqs, **self.loss_kwargs)
                if backward:
                    loss.backward()
                part_loss += float(loss.detach())
                for k, v in chunk_stats.items():
                    part_stats[k] = part_stats.get(k, 0.0) + float(v)
            total += part_loss
            stats.append({"loss": part_loss, **part_stats})
        return total, stats

    @contextlib.contextmanager
    def _forward_weights(self):
        """The weights the model runs on: the fp32 weights, or (weights="bf16") them rounded to bf16 for
        the duration, the fp32 ones put back before the optimizer uses the gradients."""
        if self.weights is None:
            yield
            return
        with torch.no_grad():
            main = [p.detach().clone() for p in self.params]  # +4 bytes a parameter on the host
        round_weights(self.params, self.weights)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, kept in zip(self.params, main):
                    p.copy_(kept)

    def evaluate(self, train_batch: RLTrainBatch, micro_batches: int = 1) -> dict[str, Any]:
        """The loss (and stats) the current weights give, without touching them."""
        with torch.no_grad(), self._forward_weights():
            loss, stats = self._micro_losses(train_batch, micro_batches, backward=False)
        return {"loss": loss, "micro_batches": stats, **_summed(stats)}

    def step(self, train_batch: RLTrainBatch, micro_batches: int = 1) -> dict[str, Any]:
        """One optimizer step on the global train_batch, accumulated over micro_batches parts.

        Returns loss (the global-batch loss, summed over parts), grad_norm (total L2 norm before
        clipping), lr (the one this step used), micro_batches (per-part loss and stats) and the
        stats summed over parts (pg_loss, kl, clip_fraction, ratio_mean, tokens).
        """
        self.optimizer.zero_grad(set_to_none=True)
        with self._forward_weights():
            yardstick = self._hf_bf16_loss(train_batch, micro_batches) if self.bf16_yardstick else {}
            loss, stats = self._micro_losses(train_batch, micro_batches, backward=True)
        lr = self.lr
        grad_norm = exact_grad_norm(self.params)
        if self.clip_grad:
            clip_grads(self.params, grad_norm, float(self.clip_grad))
        self.optimizer.step()
        self.scheduler.step()
        self.steps_done += 1
        return {"loss": loss, "grad_norm": float(grad_norm), "lr": lr,
                "micro_batches": stats, **_summed(stats), **yardstick}

    def gradients(self, train_batch: RLTrainBatch, micro_batches: int = 1,
                  compute: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The unclipped gradient of the step's loss at the current weights, by parameter name (float64 copies),
        computed with the model in `compute` (torch.float64: the same weights, exact arithmetic to fp32's
        eye; its experts HF's eager loop, as torch's grouped_mm takes no float64). Nothing changes: the
        model goes back to fp32 (its values exact both ways), its floating buffers and gradients as they were."""
        if compute not in (torch.float32, torch.float64):
            raise ValueError(f"compute must be torch.float32 or torch.float64, got {compute}")
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers() if b.is_floating_point()}
        experts = getattr(self.model.config, "_experts_implementation", None)
        self.optimizer.zero_grad(set_to_none=True)
        if compute == torch.float64:
            self.model.to(torch.float64)
            if experts not in (None, "eager"):
                self.model.set_experts_implementation("eager")
        try:
            with self._forward_weights():
                self._micro_losses(train_batch, micro_batches, backward=True)
            return {name: p.grad.detach().double().cpu().clone() for name, p in self.model.named_parameters()
                    if p.grad is not None}
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            if compute == torch.float64:
                self.model.to(torch.float32)
                if experts not in (None, "eager"):
                    self.model.set_experts_implementation(experts)
                with torch.no_grad():
                    for name, kept in buffers.items():
                        self.model.get_buffer(name).copy_(kept)

    @torch.no_grad()
    def _hf_bf16_loss(self, train_batch: RLTrainBatch, micro_batches: int) -> dict[str, float]:
        """{"hf_bf16_loss": the loss of the model itself in bf16} on the rounded weights in place (class
        docstring, "HF's own bf16"), the model back in fp32 after, every value as it was."""
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers() if b.is_floating_point()}
        self.model.to(torch.bfloat16)
        try:
            loss, _ = self._micro_losses(train_batch, micro_batches, backward=False)
        finally:
            self.model.to(torch.float32)  # the parameters held bf16 values: exact both ways
            for name, kept in buffers.items():
                self.model.get_buffer(name).copy_(kept)
        return {"hf_bf16_loss": loss}


# The weights a ground truth runs its forward on (class docstring, "Weights"): its fp32 weights, or them
# rounded to bf16 as Megatron's bf16 model parameters are.
WEIGHTS = {"fp32": None, "bf16": torch.bfloat16}


@torch.no_grad()
def round_weights(params, dtype: torch.dtype) -> None:
    """Round fp32 parameters in place to `dtype`'s values, kept in fp32."""
    for param in params:
        param.copy_(param.to(dtype))


def exact_grad_norm(params) -> float:
    """The total L2 norm of the parameters' gradients, summed in float64 (harness.backends.norms): torch's
    float32 CPU norm was 1.3e-3 to 1.7e-3 low at real widths (qwen3-8b-shape, qwen3-30b-a3b-shape on an H200,
    2026-12-01), so the ground truth's grad norm and clip coefficient were off by as much."""
    from harness.backends.norms import float64_l2_norm

    return float64_l2_norm(p.grad for p in params if p.grad is not None)


@torch.no_grad()
def clip_grads(params, grad_norm: float, max_norm: float) -> None:
    """Megatron's clip_grad_norm_fp32: scale every gradient by max_norm / (norm + 1e-6) when that is < 1."""
    coefficient = max_norm / (grad_norm + 1.0e-6)
    if coefficient < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.mul_(coefficient)


def _summed(stats: list[dict[str, float]]) -> dict[str, float]:
    """Stats of the global batch: every per-part stat is globally normalised, so they add."""
    keys = ("pg_loss", "kl", "clip_fraction", "ratio_mean", "tokens")
    return {k: sum(s[k] for s in stats) for k in keys}
