"""Which way is worse for each metric: THE table of per-metric directions.

Every "worst value" in a summary (summary.py), every trend line (trend.py) and the direction in
which a loosened bound counts against a compare (compare.py) take it from this one table, so a
metric cannot be "lower is better" in one report and "higher is better" in another. Add a metric's
rule here, not in the callers. What a row's value is judged by in a compare is its claim
(harness.report.claims), not this table: a value may move within its bound on another machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

Direction = Literal["lower_is_better", "higher_is_better", "equal"]


@dataclass(frozen=True)
class Rule:
    """`metric_pattern` is an fnmatch pattern (case-sensitive); the first matching rule wins."""

    metric_pattern: str
    direction: Direction
    why: str

    def worst(self, values: list[float]) -> float:
        """The worst of several values under this rule's direction (for summaries and trends)."""
        finite = [v for v in values if v is not None]
        if not finite:
            return math.nan
        if any(isinstance(v, float) and math.isnan(v) for v in finite):
            return math.nan  # a NaN anywhere is the worst news there is
        return min(finite) if self.direction == "higher_is_better" else max(finite)

    def worse(self, before: float, after: float) -> bool:
        """`after` is worse than `before` in this rule's direction (any change for "equal")."""
        if self.direction == "equal":
            return after != before
        return after > before if self.direction == "lower_is_better" else after < before


RULES: tuple[Rule, ...] = (
    Rule("max_abs", "lower_is_better", "logprob |Δ| vs HF"),
    Rule("mean_abs", "lower_is_better", "logprob |Δ| vs HF, averaged over tokens"),
    Rule("kl_k3", "lower_is_better", "k3 KL estimate between the two logprob sets"),
    Rule("token_mult_prob_error", "lower_is_better", "mean exp(|Δ logprob|), 1 for a perfect match"),
    Rule("top1_agreement", "higher_is_better", "fraction of tokens whose argmax agrees"),
    Rule("*_rel_diff", "lower_is_better", "|value - reference| / max(|reference|, 1) of loss or grad norm"),
    Rule("*max_abs_diff", "lower_is_better", "largest |Δ| of a weight or a checkpoint tensor"),
    Rule("separation", "higher_is_better",
         "a variant's worst metric over its bound (harness.tolerance.Tolerance.margin), >= 3 required"),
    Rule("reward*", "higher_is_better", "the RL task's reward"),
    # Memory before times: a name such as "peak_bytes" must not fall through to the time rule.
    Rule("*bytes*", "lower_is_better", "bytes: held, freed minus theory, growth"),
    Rule("*gib*", "lower_is_better", "as *bytes*, in GiB"),
    Rule("*_s", "lower_is_better", "wall times in seconds"),
    Rule("*", "lower_is_better",
         "counts of violations, mismatched tensors, changed bytes, and other differences: fewer is better"),
)


def rule_for(metric: str) -> Rule:
    """The first rule of RULES whose pattern matches `metric` (the "*" fallback always does)."""
    for rule in RULES:
        if fnmatchcase(metric, rule.metric_pattern):
            return rule
    return RULES[-1]
