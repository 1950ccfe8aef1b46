"""The tolerance table of resume invariance (harness.checkpoint.resume_check), with evidence.

A step resumed at the same layout is the same arithmetic on the same state: bit-exact, in fp32 and
bf16 alike (deterministic kernels on CUDA). A step resumed at another layout is a training step
under another layout: the training tolerance table's bounds (harness.training.tolerances). A load
that cannot restore the checkpoint must change nothing.
"""
from __future__ import annotations

from harness.evidence import CPU_BASELINE, H100_CKPT, H100_TP1, cite
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
) + tuple(
    Tolerance("load_failed", dtype, 0.0, regime="any",
              rationale="a resume loads; the one failure allowed is the harness's own refusal before any "
                        "rank works (a CheckpointError), which counts 0",
              evidence=_evidence("load_failed", dtype, "other-layout", {CPU_BASELINE: 0.0}))
    for dtype in ("fp32", "bf16")
)

TABLE = ToleranceTable("resume", _TABLE)


def resume_tolerance(metric: str, dtype, *, same_layout: bool) -> Tolerance:
    """The bound for a resumed step's `metric`: exact at the same layout, the training table's at
    another; the failed-load bound for `tensors_changed_by_failed_load`."""
    if metric in ("tensors_changed_by_failed_load", "load_failed"):
        return TABLE.get(metric, dtype)
    return TABLE.get(metric, dtype, "same-layout") if same_layout else training_tolerance(metric, dtype)


# Crash safety (harness.checkpoint.crash): counts of invariant violations after a crash, and the
# resumed step, which is a same-layout resume (the table above).
_INVARIANTS = {
    "tracker_names_incomplete": "the tracker is written only after the checkpoint it names is complete",
    "finalized_not_tracked": "a save reported finalized is named by the tracker (or a newer one is)",
    "finalized_but_none_complete": "nothing complete is deleted before a newer one is complete and tracked",
    "resumed_not_newest": "a resume takes the newest complete checkpoint",
    "orphan_processes": "a killed job leaves no process behind",
    "checkpoints_unloadable": "a finalized checkpoint loads the weights it was saved from",
}
# The fixed path's figures (no variant) of each committed run that has them: 0 violations.
_CRASH_EVIDENCE = {metric: {CPU_BASELINE: 0.0, H100_CKPT: 0.0} for metric in _INVARIANTS}
_CRASH_EVIDENCE["checkpoints_unloadable"] = {CPU_BASELINE: 0.0}  # dp >= 2 only: no row in the one-GPU run
CRASH_TABLE = ToleranceTable("crash-safety", tuple(
    Tolerance(metric, "fp32", 0.0, rationale=f"invariant, a count of violations: {why}",
              evidence=cite((("metric", metric), ("extra.variant", None)), _CRASH_EVIDENCE[metric]))
    for metric, why in _INVARIANTS.items()))


def crash_tolerance(metric: str) -> Tolerance:
    """The bound of a crash-safety check: 0 violations, or the same-layout resume bound."""
    if metric in _INVARIANTS:
        return CRASH_TABLE.get(metric, "fp32")
    return TABLE.get(metric, "fp32", "same-layout")
