"""The one tolerance table for training invariance: Megatron policy steps vs the single-process
ground truth (`GroundTruthTrainer`, fp32), by dtype and metric, each bound with its evidence.

Metrics (`harness.training.invariance`): `loss_rel_diff` and `grad_norm_rel_diff` are
|megatron - truth| / max(|truth|, 1) per step; `param_max_abs_diff` is the largest elementwise
|difference| of the HF-exported weights after the steps; `replica_max_abs_diff` is the largest
|difference| between the float32 main copies of a parameter that several ranks hold. bf16 runs
(bf16 weights and activations, fp32 main params and grad reduction) are compared with the fp32
truth: every difference is bf16 rounding, which grows with the steps.
"""
from __future__ import annotations

from harness.evidence import CPU_BASELINE, CPU_FP64_GRADS, CPU_FP64_GRADS_FAMILIES, H100_FP64_GRADS, H100_TP1, H200X2_RUN, cite
from harness.tolerance import Evidence, Tolerance, ToleranceTable

_FP32_TARGET = "the issue's fp32 relative bound (1e-5)"


def _evidence(metric: str, dtype: str, figures: dict[str, float]) -> tuple[Evidence, ...]:
    """The training suite's rows of correct policies (no variant)."""
    return cite((("suite", "training"), ("metric", metric), ("dtype", dtype), ("extra.variant", None)),
                figures)


_EXACT_REPLICAS = ("exact: every replica gets the same all-reduced gradient and the same update "
                   "(the main parameters are float32 in bf16 training too)")

_TABLE: tuple[Tolerance, ...] = (
    Tolerance("loss_rel_diff", "fp32", 1e-5, rationale=f"{_FP32_TARGET}; 40x the worst measured",
              evidence=_evidence("loss_rel_diff", "fp32",
                                 {CPU_BASELINE: 2.5e-7, H100_TP1: 2.0e-7, H200X2_RUN: 2.1e-7})),
    Tolerance("grad_norm_rel_diff", "fp32", 1e-5, rationale=f"{_FP32_TARGET}; 6x the worst measured (2x H200)",
              evidence=_evidence("grad_norm_rel_diff", "fp32",
                                 {CPU_BASELINE: 8.0e-7, H100_TP1: 4.5e-7, H200X2_RUN: 1.6e-6})),
    Tolerance("param_max_abs_diff", "fp32", 1e-5,
              rationale=f"{_FP32_TARGET}, as an absolute bound on weights of magnitude <= ~1 after 2 "
                        "Adam steps (eps 1e-6, see harness.training.invariance); 1.3x the worst measured "
                        "(H100, tp1)",
              evidence=_evidence("param_max_abs_diff", "fp32",
                                 {CPU_BASELINE: 5.1e-6, H100_TP1: 7.5e-6, H200X2_RUN: 7.5e-6})),
    Tolerance("replica_max_abs_diff", "fp32", 0.0, rationale=_EXACT_REPLICAS,
              evidence=_evidence("replica_max_abs_diff", "fp32",
                                 {CPU_BASELINE: 0.0, H100_TP1: 0.0, H200X2_RUN: 0.0})),
    Tolerance("loss_rel_diff", "bf16", 0.02, rationale="3.8x the worst measured (2x H200)",
              evidence=_evidence("loss_rel_diff", "bf16",
                                 {CPU_BASELINE: 5.0e-3, H100_TP1: 4.1e-3, H200X2_RUN: 5.2e-3})),
    Tolerance("grad_norm_rel_diff", "bf16", 0.05,
              rationale="1.7x the worst measured (2x H200; CPU 0.028, step 2, tp2), and far below the 2x a "
                        "gradient-scaling bug gives",
              evidence=_evidence("grad_norm_rel_diff", "bf16",
                                 {CPU_BASELINE: 0.028, H100_TP1: 0.011, H200X2_RUN: 0.029})),
    Tolerance("param_max_abs_diff", "bf16", 0.02,
              rationale="weights are stored in bf16, so a weight near 1.5 is off by up to half an ulp "
                        "(3.9e-3) before any step, plus up to 2 * lr per Adam step where bf16 noise "
                        "flips a small gradient's sign (2 steps, lr 1e-3: 4e-3); 3.4x the worst measured",
              evidence=_evidence("param_max_abs_diff", "bf16",
                                 {CPU_BASELINE: 5.8e-3, H100_TP1: 5.8e-3, H200X2_RUN: 5.8e-3})),
    Tolerance("replica_max_abs_diff", "bf16", 0.0, rationale=_EXACT_REPLICAS,
              evidence=_evidence("replica_max_abs_diff", "bf16",
                                 {CPU_BASELINE: 0.0, H100_TP1: 0.0, H200X2_RUN: 0.0})),
)

# The first step's gradients against HF in float64 (harness.training.grad_check): per tensor, the policy's
# relative distance over HF's own fp32 one, the worst tensor's ratio.
_GRADIENTS = (
    Tolerance("grad_error_over_hf_fp32", "fp32", 4.0, rationale=(
        "the policy's gradient as exact as HF's own fp32 to a reduction order: measured 1.51 (tp1), 1.70 (tp2-sp), "
        "1.56 (tp2ep2etp1-sp) on the CPU tier (the same on both stacks) and 2.10 / 2.03 (stack A / B) at tp1 on an "
        "H100, tiny-deepseek-v3; the other MoE families at tp2ep2etp1-sp 1.15 (Mixtral) to 2.04 (gpt-oss, stack B); "
        "1.9x the worst; megatron-core's own MLA gather (the rope key's gradient not summed over TP) reads 2.1e5 at "
        "tp2ep2etp1-sp"),
        evidence=cite((("metric", "grad_error_over_hf_fp32"),),
                      {CPU_FP64_GRADS: 1.7, CPU_FP64_GRADS_FAMILIES: 2.0, H100_FP64_GRADS: 2.1})),
)

TABLE = ToleranceTable("training", _TABLE + _GRADIENTS)


def training_tolerance(metric: str, dtype) -> Tolerance:
    return TABLE.get(metric, dtype)


def training_tolerances() -> tuple[Tolerance, ...]:
    return TABLE.entries
