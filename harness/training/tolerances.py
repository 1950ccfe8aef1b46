"""The one tolerance table for training invariance: Megatron policy steps vs the single-process
ground truth (`GroundTruthTrainer`, fp32), by dtype and metric, each number with its origin.

Metrics (suites/training/test_policy.py): `loss_rel_diff` and `grad_norm_rel_diff` are
|megatron - truth| / max(|truth|, 1) per step; `param_max_abs_diff` is the largest elementwise
|difference| of the HF-exported weights after the steps.
"""
from __future__ import annotations

from harness.parity.tolerances import Tolerance, dtype_key

_FP32_TARGET = "target: the issue's fp32 relative bound (1e-5)"

_TABLE: tuple[Tolerance, ...] = (
    Tolerance("loss_rel_diff", "fp32", 1e-5, "max",
              f"{_FP32_TARGET}; measured here (CPU/gloo, dp2/tp2/pp2/tp2pp2): <= 1.3e-6; "
              "H200 NCCL, every valid 2- and 4-GPU layout: <= 1.5e-7"),
    Tolerance("grad_norm_rel_diff", "fp32", 1e-5, "max",
              f"{_FP32_TARGET}; measured here (CPU/gloo, dp2/tp2/pp2/tp2pp2): <= 1.3e-6; "
              "H200 NCCL, every valid 2- and 4-GPU layout: <= 1.3e-6"),
    Tolerance("param_max_abs_diff", "fp32", 1e-5, "max",
              f"{_FP32_TARGET}, as an absolute bound on weights of magnitude <= ~1 after 2 Adam "
              "steps (eps 1e-6, see the suite); measured here: <= 7e-6 (TP2); H200 NCCL: <= 3.9e-6"),
    # bf16 weights and activations (fp32 main params, fp32 grad reduction) against the fp32 truth:
    # every difference is bf16 rounding, which grows with the steps (2 here).
    Tolerance("loss_rel_diff", "bf16", 0.02, "max",
              "measured here (CPU/gloo, tp2/pp2, 2 steps): 9e-4 .. 4.5e-3, growing with the step; "
              "H200 NCCL (tp1 + every valid 2- and 4-GPU layout): 9e-4 .. 5.2e-3; 0.02 is ~4x the worst"),
    Tolerance("grad_norm_rel_diff", "bf16", 0.05, "max",
              "measured here (CPU/gloo, tp2/pp2, 2 steps): 1.9e-4 .. 1.7e-2 (step 2); H200 NCCL (tp1 + "
              "every valid 2- and 4-GPU layout): 5.7e-4 .. 2.6e-2 (tp1); 0.05 is ~2x the worst, and "
              "still far below the 2x a gradient-scaling bug gives"),
    Tolerance("param_max_abs_diff", "bf16", 0.02, "max",
              "derived: weights are stored in bf16, so a weight near 1.5 is off by up to half an "
              "ulp (3.9e-3) before any step, plus up to 2 * lr per Adam step where bf16 noise flips "
              "a small gradient's sign (2 steps, lr 1e-3: 4e-3); measured here (CPU/gloo, tp2/pp2): "
              "5.8e-3 on a norm weight; H200 NCCL, every layout: 5.8e-3; 0.02 is ~3x"),
)

_BY_KEY = {(t.metric, t.dtype): t for t in _TABLE}


def training_tolerance(metric: str, dtype) -> Tolerance:
    key = (metric, dtype_key(dtype))
    if key not in _BY_KEY:
        raise KeyError(f"no training tolerance for {key}; known: {sorted(_BY_KEY)}")
    return _BY_KEY[key]


def training_tolerances() -> tuple[Tolerance, ...]:
    return _TABLE
