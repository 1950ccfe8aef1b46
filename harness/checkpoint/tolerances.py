"""The tolerance table of resume invariance (harness.checkpoint.resume_check), with evidence.

A step resumed at the same layout is the same arithmetic on the same state: bit-exact, in fp32 and
bf16 alike (deterministic kernels on CUDA). A step resumed at another layout is a training step
under another layout: the training tolerance table's bounds (harness.training.tolerances). A load
that cannot restore the checkpoint must change nothing.
"""
from __future__ import annotations

from harness.evidence import CPU_BASELINE, H100_TP1, cite
from harness.tolerance import Evidence, Tolerance, ToleranceTable
from harness.training.tolerances import training_tolerance
_EXACT = "exact: the same arithmetic on the same restored state"


def _evidence(metric: str, dtype: str, regime: str, figures: dict[str, float]) -> tuple[Evidence, ...]:
    """The resumed steps of the fixed path (no variant): the checkpoint suite's and, beside each
    variant's run, suites/sensitivity's."""
    return cite((("metric", metric), ("dtype", dtype), ("extra.variant", None), ("extra.regime", regime)),
                figures)


_TABLE = tuple(
    Tolerance(metric, dtype, 0.0, regime="same-layout", rationale=_EXACT,
              evidence=_evidence(metric, dtype, "same-layout", {CPU_BASELINE: 0.0, H100_TP1: 0.0}))
    for dtype in ("fp32", "bf16")
    for metric in ("loss_rel_diff", "grad_norm_rel_diff", "param_max_abs_diff")
) + tuple(
    Tolerance("tensors_changed_by_failed_load", dtype, 0.0, regime="any",
              rationale="a load the harness cannot complete is refused before any rank changes state",
              evidence=_evidence("tensors_changed_by_failed_load", dtype, "other-layout", {CPU_BASELINE: 0.0}))
    for dtype in ("fp32", "bf16")
)

TABLE = ToleranceTable("resume", _TABLE)


def resume_tolerance(metric: str, dtype, *, same_layout: bool) -> Tolerance:
    """The bound for a resumed step's `metric`: exact at the same layout, the training table's at
    another; the failed-load bound for `tensors_changed_by_failed_load`."""
    if metric == "tensors_changed_by_failed_load":
        return TABLE.get(metric, dtype)
    return TABLE.get(metric, dtype, "same-layout") if same_layout else training_tolerance(metric, dtype)
