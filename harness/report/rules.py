"""How to compare one metric between two runs: THE table of per-metric rules.

Every comparison (compare.py), every "worst value" in a summary (summary.py) and every trend line
(trend.py) takes its direction from this one table, so a metric cannot be "lower is better" in one
report and "higher is better" in another. Add a metric's rule here, not in the callers.

CI compares its run against a baseline recorded on another machine (`make compare`), so a rule
must tolerate what another CPU or GPU model changes with the same code: low-precision rounding
(the `headroom` share below) and wall times (`gating=False`: listed, never a regression).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

Kind = Literal["abs", "rel"]
Direction = Literal["lower_is_better", "higher_is_better", "equal"]


@dataclass(frozen=True)
class Rule:
    """`metric_pattern` is an fnmatch pattern (case-sensitive); the first matching rule wins.

    The allowed change before a row counts as worse (or better) is `tolerance` itself (kind "abs")
    or `tolerance * |baseline|` (kind "rel"), but never less than `floor`: a relative rule on a
    value that is pure float noise (1e-7 → 3e-7 is "3x worse") would otherwise flag every run.
    Nor less than `headroom` times the row's room to its own pass tolerance (the bound the test
    asserted, with its documented origin): a bf16 max |Δ| of 0.05 under a 0.4 bound may move by
    0.0875, since another machine's kernels round bf16 differently, while an fp32 value close to
    its bound gets almost no room. `gating=False`: a change is listed but never a regression.
    """

    metric_pattern: str
    kind: Kind
    tolerance: float
    direction: Direction
    why: str
    floor: float = 0.0
    headroom: float = 0.0
    gating: bool = True

    def allowed(self, baseline: float, row_tolerance: float | None = None) -> float:
        """The change from `baseline` this rule tolerates (in the metric's units); `row_tolerance`
        is the baseline row's own pass bound, if it has one."""
        span = self.tolerance if self.kind == "abs" else self.tolerance * abs(baseline)
        return max(span if math.isfinite(span) else 0.0, self.floor,
                   self.headroom * self.room(baseline, row_tolerance))

    def room(self, baseline: float, row_tolerance: float | None) -> float:
        """How far `baseline` is from the row's pass bound in the bad direction (0 when past it,
        without a bound, or for "equal" metrics)."""
        if row_tolerance is None or self.direction == "equal":
            return 0.0
        gap = row_tolerance - baseline if self.direction == "lower_is_better" else baseline - row_tolerance
        return gap if math.isfinite(gap) and gap > 0 else 0.0

    def worst(self, values: list[float]) -> float:
        """The worst of several values under this rule's direction (for summaries and trends)."""
        finite = [v for v in values if v is not None]
        if not finite:
            return math.nan
        if any(isinstance(v, float) and math.isnan(v) for v in finite):
            return math.nan  # a NaN anywhere is the worst news there is
        return min(finite) if self.direction == "higher_is_better" else max(finite)


# A quarter of the way to the row's own bound: bf16 rounding on another machine's kernels moves
# values by tens of percent; a real bug moves them past the bound (and `passed` flips).
HEADROOM = 0.25
_TIMING = ("wall times depend on the machine and its load, and compare runs across machines (CI "
           "vs the committed baseline): listed, never a regression; measure speed with `mrh bench` "
           "on one machine")

RULES: tuple[Rule, ...] = (
    Rule("max_abs", "rel", 0.5, "lower_is_better",
         "logprob |Δ| vs HF: kernels and reduction order move it by tens of percent, a real bug "
         "by orders of magnitude. fp32 values are whole ulps of a logprob (2^-19 = 1.9e-6 for "
         "|logprob| in [4, 8)), so one ulp more doubles the value: the floor of 2 ulps keeps "
         "that quiet (the fp32 tolerance, 1e-5, still catches real drift via `passed`)",
         floor=4e-6, headroom=HEADROOM),
    Rule("mean_abs", "rel", 0.5, "lower_is_better",
         "as max_abs, averaged over tokens: fp32 values are ~5e-7, noise ~1e-7 to 5e-7",
         floor=1e-6, headroom=HEADROOM),
    Rule("kl_k3", "rel", 0.5, "lower_is_better",
         "k3 KL estimate ~ mean(r^2)/2, so fp32 noise is ~1e-13..2e-12; the floor is a tenth of "
         "the fp32 tolerance (1e-10)",
         floor=1e-11, headroom=HEADROOM),
    Rule("token_mult_prob_error", "abs", 1e-3, "lower_is_better",
         "mean exp(|Δ logprob|), a ratio near 1 (fp32 ~1+5e-7, bf16 ~1.01-1.02): absolute, "
         "since a relative change of a number near 1 is the same thing", headroom=HEADROOM),
    Rule("top1_agreement", "abs", 0.02, "higher_is_better",
         "fraction of tokens whose argmax agrees; a drop of 2 points is one token in 50 flipping",
         headroom=HEADROOM),
    # Training and checkpoint differences (harness.training.tolerances, suites/checkpoint).
    Rule("*_rel_diff", "rel", 0.5, "lower_is_better",
         "|value - reference| / max(|reference|, 1) of loss and grad norm (Megatron vs the "
         "single-process truth, resumed vs uninterrupted): fp32 noise ~1e-7..1.3e-6, so the "
         "floor is a tenth of the fp32 bound (1e-5); bf16 values are rounding of their own size",
         floor=1e-6, headroom=HEADROOM),
    Rule("*max_abs_diff", "rel", 0.5, "lower_is_better",
         "largest |Δ| of a weight (after optimizer steps, or between two checkpoints): fp32 "
         "noise is a few ulps of weights ~1 (1.2e-7 each, measured up to 7e-6 after 2 Adam "
         "steps); the floor is a fifth of the fp32 bound (1e-5)",
         floor=2e-6, headroom=HEADROOM),
    # How far a negative control fails its check (suites/sensitivity): the test itself asserts
    # >= SENSITIVITY_MARGIN; the figure's size (up to inf for an exact bound) moves with another
    # machine's rounding of a wrong model, which is no regression of the harness.
    Rule("separation", "rel", 0.5, "higher_is_better",
         "a variant's worst metric over its bound (harness.tolerance.Tolerance.margin): the "
         "sensitivity test fails below 3; above, its size is listed, never a regression",
         gating=False),
    # Memory before times: a name such as "peak_bytes" must not fall through to the time rule.
    Rule("*bytes*", "rel", 0.05, "lower_is_better",
         "allocator peaks are near-deterministic for fixed shapes; 5% is a real change"),
    Rule("*gib*", "rel", 0.05, "lower_is_better", "as *bytes*, in GiB"),
    Rule("*blocking_s*", "rel", 0.25, "lower_is_better",
         f"wall time the trainer is blocked; shared machines jitter ~10-20%; {_TIMING}",
         floor=1e-3, gating=False),
    Rule("*_s", "rel", 0.25, "lower_is_better",
         f"wall times in seconds; shared machines jitter ~10-20%; below 1 ms is timer noise; {_TIMING}",
         floor=1e-3, gating=False),
    Rule("*", "rel", 1e-6, "equal",
         "unknown metric: any change beyond float round-off is reported, in either direction"),
)


def rule_for(metric: str) -> Rule:
    """The first rule of RULES whose pattern matches `metric` (the "*" fallback always does)."""
    for rule in RULES:
        if fnmatchcase(metric, rule.metric_pattern):
            return rule
    return RULES[-1]
