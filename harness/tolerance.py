"""What a bound is: a limit on one metric, the evidence it rests on, and how far a value is past it.

Every tolerance table of the harness (parity: `harness.parity.tolerances`, training:
`harness.training.tolerances`) is made of `Tolerance` entries. An entry says why its limit is what
it is (`rationale`) and names the figures it rests on (`evidence`): a statistic of the rows of a
committed run report (the CPU baseline, a GPU run under reports/gpu/). suites/harness/
test_tolerance_evidence.py recomputes every cited figure from the committed report and fails when
the figure no longer matches what the origin says (a stale origin) or exceeds the bound. An entry
without evidence of its own must say from which entries it is derived (`derived_from`).

`margin` is how far past a bound a value is, in units of the bound's distance from a perfect match:
a negative control that fails by margin 3 is three times as far from perfect as the check allows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, NamedTuple

import torch

Kind = Literal["max", "min"]
SENSITIVITY_MARGIN = 3.0  # every negative control must fail its check by at least this margin

_DTYPE_NAMES: dict[object, str] = {
    "fp32": "fp32", "float32": "fp32", torch.float32: "fp32",
    "bf16": "bf16", "bfloat16": "bf16", torch.bfloat16: "bf16",
}


def dtype_key(dtype: str | torch.dtype) -> str:
    """"fp32" or "bf16" for the names and torch dtypes the tables accept; ValueError otherwise."""
    key = _DTYPE_NAMES.get(dtype)
    if key is None:
        raise ValueError(f"no tolerances for dtype {dtype!r}: the tables cover fp32 and bf16")
    return key


@dataclass(frozen=True)
class Evidence:
    """A figure read off a committed run report: `statistic` of the values of the rows whose fields
    match `where` (dotted names reach into a row's `extra`: ("extra.variant", None))."""

    report: str  # results.json of a run, relative to the repository root (committed packed: harness.report.packed)
    figure: float  # the cited value, as the origin states it (`digits` significant digits)
    where: tuple[tuple[str, Any], ...]
    statistic: Literal["max", "min"] = "max"
    digits: int = 2
    note: str = ""  # what the rows are, in words (machine, models, layouts)

    def select(self, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        return [row for row in rows if all(_field(row, name) == want for name, want in self.where)]

    def measure(self, rows: Iterable[dict[str, Any]]) -> float:
        """The statistic over the matching rows (ValueError when none match)."""
        values = [float(row["value"]) for row in self.select(rows)]
        if not values:
            raise ValueError(f"no row of {self.report} matches {dict(self.where)}")
        return max(values) if self.statistic == "max" else min(values)

    def matches(self, measured: float) -> bool:
        """The measured figure rounds to the cited one at `digits` significant digits."""
        return f"{measured:.{self.digits}g}" == f"{self.figure:.{self.digits}g}"

    def citation(self) -> str:
        where = ", ".join(f"{k}={v}" for k, v in self.where)
        note = f"{self.note}: " if self.note else ""
        return f"{note}{self.statistic} {self.figure:.{self.digits}g} ({self.report}; {where})"


def _field(row: dict[str, Any], name: str) -> Any:
    value: Any = row
    for part in name.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


@dataclass(frozen=True)
class Tolerance:
    """A bound on one metric: kind "max" passes when value <= limit, "min" when value >= limit.

    `ideal` is the value of a perfect match (0 for a difference, 1 for an agreement or an
    exp-mean); `regime` says which comparisons the bound is for ("any", or a table's own names).
    """

    metric: str
    dtype: str
    limit: float
    kind: Kind = "max"
    ideal: float = 0.0
    regime: str = "any"
    rationale: str = ""
    evidence: tuple[Evidence, ...] = ()
    derived_from: tuple[str, ...] = ()  # metrics of the same (dtype, regime) it is derived from

    def passes(self, value: float) -> bool:
        # NaN fails both kinds: every comparison with NaN is False.
        return value <= self.limit if self.kind == "max" else value >= self.limit

    def margin(self, value: float) -> float:
        """|value - ideal| / |limit - ideal|: < 1 within the bound, > 1 past it (inf for NaN, or for
        any deviation from an exact bound)."""
        if math.isnan(value):
            return math.inf
        allowed, off = abs(self.limit - self.ideal), abs(value - self.ideal)
        if allowed == 0:
            return 0.0 if off == 0 else math.inf
        return off / allowed

    @property
    def claim(self) -> str:
        """What a value held to this bound claims (harness.report.claims): exact or bounded."""
        from harness.report.claims import of_bound

        return of_bound(self.limit, self.ideal)

    @property
    def origin(self) -> str:
        parts = [self.rationale] if self.rationale else []
        parts += [f"evidence: {e.citation()}" for e in self.evidence]
        if self.derived_from:
            parts.append(f"derived from {', '.join(self.derived_from)}")
        return "; ".join(parts)


class CheckResult(NamedTuple):
    metric: str
    value: float
    tolerance: Tolerance
    passed: bool

    @property
    def margin(self) -> float:
        return self.tolerance.margin(self.value)

    @property
    def claim(self) -> str:
        return self.tolerance.claim

    @classmethod
    def judge(cls, metric: str, value: float, bound: Tolerance) -> "CheckResult":
        """`value` of `metric` held to `bound`."""
        value = float(value)
        return cls(metric, value, bound, bound.passes(value))


class Judged:
    """What the result of a check shares (the offload round trip, the resume comparison, the weight
    sync): its `checks` (each a value held to its bound) and its `failures` in words, both lists the
    subclass holds with its `dtype` and `device`; pass/fail, the separation, the report rows."""

    checks: list[CheckResult]
    failures: list[str]
    dtype: str
    device: str

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def separation(self) -> float:
        return separation(self.checks)

    def judge(self, metric: str, value: float, bound: "Tolerance", failure: str) -> CheckResult:
        """Record `value` of `metric` held to `bound`; `failure` is what a failure says."""
        result = CheckResult.judge(metric, value, bound)
        self.checks.append(result)
        if not result.passed:
            self.failures.append(failure)
        return result

    def check_rows(self, layout: str, model: str, /, **extra: Any) -> list:
        """One report row per check (suite and test are filled in by the recorder)."""
        from harness.report.rows import Row

        return [Row(suite="", test="", layout=layout, metric=c.metric, value=c.value, tolerance=c.tolerance.limit,
                    passed=c.passed, claim=c.claim, model=model, dtype=self.dtype, device=self.device,
                    extra=dict(extra, tolerance_kind=c.tolerance.kind))
                for c in self.checks]


def separation(checks: Iterable[CheckResult]) -> float:
    """How far the worst metric of a failing comparison is past its bound (see `Tolerance.margin`):
    the figure a negative control must push to >= SENSITIVITY_MARGIN."""
    return max((c.margin for c in checks), default=0.0)


@dataclass
class ToleranceTable:
    """One table: entries looked up by (metric, dtype, regime), falling back to regime "any"."""

    name: str
    entries: tuple[Tolerance, ...]
    _by_key: dict[tuple[str, str, str], Tolerance] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_key = {}
        for t in self.entries:
            key = (t.metric, t.dtype, t.regime)
            if key in self._by_key:
                raise ValueError(f"{self.name}: two entries for {key}")
            self._by_key[key] = t

    def get(self, metric: str, dtype: str | torch.dtype, regime: str = "any") -> Tolerance:
        d = dtype_key(dtype)
        found = self._by_key.get((metric, d, regime)) or self._by_key.get((metric, d, "any"))
        if found is None:
            known = sorted({(t.metric, t.dtype, t.regime) for t in self.entries})
            raise KeyError(f"{self.name}: no tolerance for {metric!r} ({d}, {regime}); known: {known}")
        return found

    def check(self, metrics: dict[str, float], dtype: str | torch.dtype,
              regime: str = "any") -> list[CheckResult]:
        """Every metric of `metrics` with a bound for (dtype, regime), in table order."""
        d = dtype_key(dtype)
        seen, results = set(), []
        for t in self.entries:
            if t.dtype != d or t.metric in seen or t.metric not in metrics:
                continue
            bound = self.get(t.metric, d, regime)
            seen.add(t.metric)
            value = float(metrics[t.metric])
            results.append(CheckResult(t.metric, value, bound, bound.passes(value)))
        return results

    def markdown(self) -> str:
        """The table as Markdown, with each entry's origin (for docs and the CLI)."""
        lines = ["| dtype | regime | metric | bound | origin |", "|---|---|---|---|---|"]
        for t in self.entries:
            bound = f"{'<=' if t.kind == 'max' else '>='} {t.limit:g}"
            origin = t.origin.replace("|", r"\|")  # a bare | would end the Markdown cell
            lines.append(f"| {t.dtype} | {t.regime} | {t.metric} | {bound} | {origin} |")
        return "\n".join(lines)
