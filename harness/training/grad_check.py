"""A policy's gradients against exact arithmetic, tensor by tensor: where a weight bound cannot tell rounding
from a bug.

The training comparison (harness.training.invariance) holds the weights after two Adam steps to 1e-5. Adam's
first update of an element is lr * g / (|g| + eps): where |g| is near eps its sensitivity lr * eps / (|g| + eps)^2
turns fp32's ordinary gradient rounding into a weight gap of that order (tiny-deepseek-v3 at tp2ep2etp1-sp:
layer 0's kv_b_proj, an element with g = 2.8e-6, 1e-7 of rounding, 7e-6 of weight after one step:
reports/cpu/2026-12-07-fp64-gradients). The gradient itself has no such amplifier. So this check takes the
first step's unclipped gradient of every parameter, in HF's names, three ways on the same weights and batch:
the policy (fp32, its layout's reduction orders), HF's fp32 ground truth and HF in float64, and holds the
policy's distance to float64 to a multiple of HF's own fp32 distance, tensor by tensor (`bound()`). A missing
reduction or a gradient split wrongly (the MLA rope key's, harness.compat.megatron_core.MLA_ROPE_KEY_GRAD) is
orders of magnitude past fp32's rounding in the tensors it touches; a reduction order is not.

The gradient export reads each parameter's main_grad through the bridge's weight export, so it needs a layout
whose data-parallel and expert data-parallel groups are one rank (the gradients reduced there in full on every
rank), and a model whose HF weights are its Megatron weights rearranged (no offset: not Gemma 3's norms).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


# A relative error below fp32's unit roundoff (2^-24) is the exact answer rounded once to fp32: HF's own fp32
# distance is floored there, so a tensor HF happens to get exact does not make any rounding a failure.
FP32_ROUNDOFF = 2.0 ** -24
METRIC = "grad_error_over_hf_fp32"  # its bound: harness.training.tolerances


def bound():
    from harness.training.tolerances import training_tolerance

    return training_tolerance(METRIC, "fp32")


@dataclass
class GradientComparison:
    """Per HF parameter: the policy's and HF fp32's relative distance to HF's float64 gradient."""
    layout: str
    model: str
    policy_error: dict[str, float] = field(default_factory=dict)
    hf_fp32_error: dict[str, float] = field(default_factory=dict)

    def ratio(self, name: str) -> float:
        return self.policy_error[name] / max(self.hf_fp32_error[name], FP32_ROUNDOFF)

    @property
    def worst(self) -> str:
        return max(self.policy_error, key=self.ratio)

    @property
    def passed(self) -> bool:
        return bound().passes(self.ratio(self.worst))

    def record(self, report, **fields: Any) -> None:
        """The worst tensor's ratio (bounded) and its two distances (observed) as report rows."""
        worst = self.worst
        common = dict(layout=self.layout, model=self.model, dtype="fp32", tensor=worst, **fields)
        report.add(METRIC, self.ratio(worst), tolerance=bound().limit, passed=self.passed,
                   claim="bounded", **common)
        report.add("policy_grad_rel_error_vs_fp64", self.policy_error[worst], tolerance=None, passed=True,
                   claim="observed", **common)
        report.add("hf_fp32_grad_rel_error_vs_fp64", self.hf_fp32_error[worst], tolerance=None, passed=True,
                   claim="observed", **common)

    def summary(self, top: int = 5) -> str:
        names = sorted(self.policy_error, key=self.ratio, reverse=True)[:top]
        return f"{self.layout} {self.model}: " + "; ".join(
            f"{n} policy {self.policy_error[n]:.3g} vs HF fp32 {self.hf_fp32_error[n]:.3g} (x{self.ratio(n):.2f})"
            for n in names)


def _main_grads_exported(worker) -> dict[str, torch.Tensor] | None:
    """Rank side: the step's gradients reduced as the schedule's end does, exported as HF tensors (each
    parameter's main_grad in place of its data for the export, the data put back); rank 0's copy."""
    import torch.distributed as dist

    from harness.bridge import unwrap_model

    finalize = worker.model_config.finalize_model_grads_func
    if finalize is not None:
        finalize(list(worker.models), None)
    params = [p for model in unwrap_model(worker.models) for p in model.parameters()
              if getattr(p, "main_grad", None) is not None]
    kept = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad.to(p.dtype)
        state = worker.export()
    finally:
        for p, data in zip(params, kept):
            p.data = data
    return {n: t.double().cpu() for n, t in state.items()} if dist.get_rank() == 0 else None


def policy_gradients(policy, train_batch) -> dict[str, torch.Tensor]:
    """The unclipped gradient of a fresh policy's first step on `train_batch`, in HF's names. The step is left
    open (begin_step and accumulate, no optimizer step): use the policy for nothing else."""
    layout = policy.layout
    expert_dp = layout.world_size // (layout.pp * layout.ep * layout.expert_tp)
    if layout.dp != 1 or expert_dp != 1:
        raise ValueError(f"{layout}: the gradient export needs data parallel 1 and expert data parallel 1 (got "
                         f"{layout.dp} and {expert_dp}): the distributed optimizer's reduce-scatter leaves each "
                         "rank a shard of the gradient otherwise")
    policy.begin_step(train_batch)
    policy.accumulate(range(policy.config["micro_batches"]))
    return policy.apply(_main_grads_exported)[0]


def hf_gradients(model: str, train_batch, compute: torch.dtype, micro_batches: int = 2) -> dict[str, torch.Tensor]:
    """HF's unclipped first-step gradient in `compute` (the ground truth's trainer and loss)."""
    from harness.models import build_hf_model
    from harness.models.zoo import as_checkpoint_tensors
    from harness.training.ground_truth import GroundTruthTrainer
    from harness.training.invariance import LOSS, OPTIM

    hf = build_hf_model(model, dtype=torch.float32, seed=0)
    grads = GroundTruthTrainer(hf, **OPTIM, **LOSS).gradients(train_batch, micro_batches, compute=compute)
    return as_checkpoint_tensors(hf, grads)  # the names (and per-expert tensors) the policy's export has


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.norm().item()
    return (got - want).norm().item() / scale if scale else float((got - want).abs().max().item() > 0)


def compare_gradients_to_float64(policy, model: str) -> GradientComparison:
    """The ground truth's first batch (harness.training.invariance.ground_truth) through the policy, HF fp32
    and HF float64; every HF parameter with a gradient compared."""
    from harness.models import load_hf_config
    from harness.models.zoo import ZERO_CENTERED_NORMS
    from harness.training.invariance import ground_truth

    model_type = load_hf_config(model).model_type
    if model_type in ZERO_CENTERED_NORMS:
        raise ValueError(f"{model}: {model_type}'s norms are exported as w - 1 (zero-centered), so the weight export "
                         "does not carry their gradients; the gradient check takes models without an offset")
    batches, _, _ = ground_truth(model)
    got = policy_gradients(policy, batches[0])
    exact = hf_gradients(model, batches[0], torch.float64)
    fp32 = hf_gradients(model, batches[0], torch.float32)
    missing = sorted(set(exact) - set(got))
    if missing:
        raise AssertionError(f"the policy's gradient export lacks {missing[:5]} ({len(missing)} tensors)")
    result = GradientComparison(str(policy.layout), model)
    for name, want in exact.items():
        result.policy_error[name] = _relative(got[name], want)
        result.hf_fp32_error[name] = _relative(fp32[name], want)
    return result
