"""Compare two runs row by row, each row by what it claims: what regressed, what moved, what
appeared, what vanished.

Rows are joined on ROW KEY = (suite, test, layout, model, dtype, device, spec, metric, variant,
packing, occurrence):
  - `test` is the pytest nodeid with its parametrization (`...::test_x[cuda-tp2-tiny-qwen3-fp32]`);
  - `variant` and `packing` come from the row's `extra` ("" when absent), because one test may
    record the same metric once per variant or packing;
  - `occurrence` (1, 2, ...) numbers rows whose other fields are all equal, in recording order,
    so a test that records a metric twice is compared pairwise instead of silently collapsed.

Each joined pair is judged by its CLAIM (harness.report.claims), never by how far its value moved:
another machine rounds differently, and a baseline is made on one machine and compared on others.
  - exact, bounded, control (gating): a REGRESSION when the row passed its own bound in the
    baseline and does not now (an exact claim broke, a figure is past its bound, a control's
    margin fell below SENSITIVITY_MARGIN), when the bound itself was loosened, or when the row's
    claim was weakened (exact -> bounded, gating -> not). A value that moved inside its bound is
    counted as MOVED, never a regression.
  - timing, observed: never gating; a changed value is listed as NOT GATING (wall times that moved
    by more than TIMING_NOISE, observations that changed at all).
IMPROVEMENTS: failed -> passed, a bound tightened. At test level, a test that passed in the
baseline and failed, errored or did not finish is a regression. Rows only in the current run are
NEW, rows only in the baseline are MISSING: both are listed in full and never dropped; they do not
by themselves count as a regression (a subset run, a new test, a skipped one are legitimate).
GENERATED rows (extra.generated: recorded by a hypothesis test, whose examples differ from run to
run) are never paired: they are always new or missing. When the two runs' fingerprints differ in
what changes arithmetic (CPU model, ISA flags, the CPU kernel pin, threads, library versions, GPU),
the compare says so first: values may move, claims may not.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.report import claims
from harness.report.blocks import Table, blocks_to_markdown, fmt_value
from harness.report.fingerprint import ARITHMETIC_KEYS
from harness.report.results import FAILING_OUTCOMES, load_run, normalise_run
from harness.report.rows import atomic_write
from harness.report.rules import Rule, rule_for

TIMING_NOISE = 0.25  # a wall time listed as moved beyond this relative change (shared machines: ~10-20%)

KEY_FIELDS = ("suite", "test", "layout", "model", "dtype", "device", "spec", "bridge", "metric")
EXTRA_KEY_FIELDS = ("variant", "packing", "evaluated_in")
Key = tuple[Any, ...]


def row_key(row: dict[str, Any]) -> Key:
    """The join key without the occurrence number (see module docstring)."""
    extra = row.get("extra") or {}
    return (tuple(str(row.get(f) or "") for f in KEY_FIELDS)
            + tuple("" if extra.get(k) is None else str(extra[k]) for k in EXTRA_KEY_FIELDS))


def index_rows(rows: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """key + (occurrence,) -> row, for every row: duplicates get occurrence 2, 3, ..."""
    seen: dict[Key, int] = {}
    indexed: dict[Key, dict[str, Any]] = {}
    for row in rows:
        key = row_key(row)
        seen[key] = seen.get(key, 0) + 1
        indexed[key + (seen[key],)] = row
    return indexed


@dataclass
class Change:
    """One joined row whose verdict is not "same"."""

    key: Key
    baseline: dict[str, Any]
    current: dict[str, Any]
    claim: str
    delta: float
    reasons: list[str]


@dataclass
class TestChange:
    nodeid: str
    before: str
    after: str
    message: str = ""


@dataclass
class CompareResult:
    baseline_source: str
    current_source: str
    regressions: list[Change] = field(default_factory=list)
    improvements: list[Change] = field(default_factory=list)
    ungated: list[Change] = field(default_factory=list)
    tests_regressed: list[TestChange] = field(default_factory=list)
    new: list[dict[str, Any]] = field(default_factory=list)
    missing: list[dict[str, Any]] = field(default_factory=list)
    unchanged: int = 0
    moved: int = 0  # gating rows whose value moved inside their bound
    fingerprint_changes: list[tuple[str, Any, Any]] = field(default_factory=list)

    @property
    def regressed(self) -> bool:
        return bool(self.regressions or self.tests_regressed)

    def headline(self) -> str:
        verdict = "REGRESSED" if self.regressed else "no regression"
        return (f"**{verdict}**: {len(self.regressions)} rows regressed, {len(self.tests_regressed)} "
                f"tests stopped passing, {len(self.improvements)} rows improved, {len(self.ungated)} "
                f"moved but not gating (timings, observations), {self.moved} moved within their bounds, "
                f"{self.unchanged} unchanged, {len(self.new)} new rows (only in current), "
                f"{len(self.missing)} missing rows (only in baseline).")

    def to_markdown(self, max_rows: int | None = None) -> str:
        """Regressions first, then tests that stopped passing, improvements, new and missing rows.
        Every item is listed unless `max_rows` caps each table (the cut is then counted, e.g. for
        a GitHub step summary, which must stay under 1 MiB)."""
        blocks: list[tuple[str, Any]] = [
            ("h2", "Compare runs"),
            ("p", f"Baseline `{self.baseline_source}` vs current `{self.current_source}`."),
            ("p", self.headline())]
        if self.fingerprint_changes:
            blocks += [("p", "The runs' fingerprints differ in what changes arithmetic: values may move "
                             "within their bounds; what a row claims may not."),
                       ("table", Table(["fingerprint", "baseline", "current"],
                                       [[k, fmt_value(b), fmt_value(c)] for k, b, c in self.fingerprint_changes]))]
        sections = (("Regressions", self.regressions, _change_table),
                    ("Tests that stopped passing", self.tests_regressed, _test_table),
                    ("Moved, not gating (timings, observations)", self.ungated, _change_table),
                    ("Improvements", self.improvements, _change_table),
                    ("New rows (only in current)", self.new, _row_table),
                    ("Missing rows (only in baseline)", self.missing, _row_table))
        for title, items, table in sections:
            if items:
                shown = table(items)
                if max_rows is not None and len(shown.rows) > max_rows:
                    shown.more, shown.rows = len(shown.rows) - max_rows, shown.rows[:max_rows]
                    shown.more_hint = "run `compare` without a cap to list them"
                blocks += [("h3", f"{title} ({len(items)})"), ("table", shown)]
        return blocks_to_markdown(blocks)


def _key_cells(row: dict[str, Any]) -> list[str]:
    extra = row.get("extra") or {}
    variant = "/".join(str(extra[k]) for k in EXTRA_KEY_FIELDS if extra.get(k) is not None)
    return [row.get("test", ""), row.get("metric", ""), row.get("claim", ""), row.get("layout", ""),
            row.get("model", ""), row.get("dtype", ""), row.get("device", ""), row.get("spec", ""), row.get("bridge", ""), variant]


_KEY_COLUMNS = ["test", "metric", "claim", "layout", "model", "dtype", "device", "spec", "bridge", "variant/packing"]


def _change_table(changes: list[Change]) -> Table:
    rows = [_key_cells(c.current) + [fmt_value(c.baseline.get("value")), fmt_value(c.current.get("value")),
                                     fmt_value(c.delta), "; ".join(c.reasons)]
            for c in changes]
    return Table(_KEY_COLUMNS + ["baseline", "current", "Δ", "why"], rows)


def _test_table(changes: list[TestChange]) -> Table:
    return Table(["test", "baseline", "current", "message"],
                 [[c.nodeid, c.before, c.after, c.message] for c in changes])


def _row_table(rows: list[dict[str, Any]]) -> Table:
    return Table(_KEY_COLUMNS + ["value", "tolerance", "passed"],
                 [_key_cells(r) + [fmt_value(r.get("value")), fmt_value(r.get("tolerance")),
                                   fmt_value(bool(r.get("passed")))] for r in rows])


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _tolerance(row: dict[str, Any]) -> float | None:
    value = _float(row.get("tolerance"))
    return None if math.isnan(value) else value


def is_generated(row: dict[str, Any]) -> bool:
    """Recorded by a property-based (hypothesis) test: its examples differ between runs."""
    return bool((row.get("extra") or {}).get("generated"))


def _stopped_passing(baseline: dict[str, Any], current: dict[str, Any]) -> bool:
    return bool(baseline.get("passed")) and not current.get("passed")


def _bound_kind(row: dict[str, Any], rule: Rule) -> str:
    """"max" (value <= bound) or "min" (value >= bound): the row's own, else its metric's direction."""
    kind = (row.get("extra") or {}).get("tolerance_kind")
    if kind in ("max", "min"):
        return kind
    return "min" if rule.direction == "higher_is_better" else "max"


def _bound_change(baseline: dict[str, Any], current: dict[str, Any], rule: Rule) -> str | None:
    """"loosened" / "tightened" / None for the pair's bounds."""
    b, c = _tolerance(baseline), _tolerance(current)
    if b == c or b is None:
        return None
    if c is None:
        return "loosened"
    looser = c > b if _bound_kind(current, rule) == "max" else c < b
    return "loosened" if looser else "tightened"


def judge(baseline: dict[str, Any], current: dict[str, Any]) -> tuple[str, float, list[str], str]:
    """("regression" | "improvement" | "moved" | "same", current - baseline, reasons, claim) for one
    pair, by the current row's claim (module docstring)."""
    rule = rule_for(str(current.get("metric", "")))
    claim, before = current.get("claim"), baseline.get("claim")
    b, c = _float(baseline.get("value")), _float(current.get("value"))
    delta = c - b if not (math.isnan(b) or math.isnan(c)) else math.nan
    same_value = b == c or (math.isnan(b) and math.isnan(c))
    worse: list[str] = []
    better: list[str] = []
    if claims.weakened(before, claim):
        worse.append(f"claim weakened: {before} → {claim}")
    if claim in claims.GATING:
        if _stopped_passing(baseline, current):
            what = {"control": "margin fell below its required multiple",
                    "exact": "exact claim broke"}.get(claim, "past its own bound")
            worse.append(f"{what}: {fmt_value(current.get('value'))} vs bound {fmt_value(current.get('tolerance'))}")
        elif not baseline.get("passed") and current.get("passed"):
            better.append("failed → passed")
        change = _bound_change(baseline, current, rule)
        if change:
            (worse if change == "loosened" else better).append(
                f"bound {change}: {fmt_value(baseline.get('tolerance'))} → {fmt_value(current.get('tolerance'))}")
        verdict = "regression" if worse else "improvement" if better else "same" if same_value else "moved"
        return verdict, delta, worse or better, claim
    if worse:
        return "regression", delta, worse, claim
    moved = not same_value and (claim != "timing" or math.isnan(delta)
                                or abs(delta) > TIMING_NOISE * max(abs(b), 1e-3))
    if moved:
        word = "worse" if rule.worse(b, c) else "better"
        return "ungated", delta, [f"{claim}: {word} by {fmt_value(abs(delta))} (not gating)"], claim
    return "same", delta, [], claim


def _as_run(run: dict[str, Any] | str | os.PathLike, role: str) -> dict[str, Any]:
    if isinstance(run, dict):
        return normalise_run(run, source=str(run.get("source") or f"<{role} dict>"))
    return load_run(run)


def compare_runs(baseline: dict[str, Any] | str | os.PathLike,
                 current: dict[str, Any] | str | os.PathLike) -> CompareResult:
    """Compare two runs (loaded documents, run directories or results.json paths); see module doc."""
    base, cur = _as_run(baseline, "baseline"), _as_run(current, "current")
    result = CompareResult(base["source"], cur["source"])
    result.fingerprint_changes = fingerprint_changes(base["meta"]["fingerprint"], cur["meta"]["fingerprint"])
    base_rows = index_rows([r for r in base["rows"] if not is_generated(r)])
    cur_rows = index_rows([r for r in cur["rows"] if not is_generated(r)])
    for key, row in cur_rows.items():
        if key not in base_rows:
            result.new.append(row)
            continue
        verdict, delta, reasons, claim = judge(base_rows[key], row)
        if verdict == "same":
            result.unchanged += 1
        elif verdict == "moved":
            result.moved += 1
        else:
            change = Change(key, base_rows[key], row, claim, delta, reasons)
            {"regression": result.regressions, "improvement": result.improvements,
             "ungated": result.ungated}[verdict].append(change)
    result.missing = [row for key, row in base_rows.items() if key not in cur_rows]
    result.new += [r for r in cur["rows"] if is_generated(r)]
    result.missing += [r for r in base["rows"] if is_generated(r)]
    before = {t.get("nodeid"): t for t in base["tests"]}
    for test in cur["tests"]:
        old = before.get(test.get("nodeid"))
        if old and old.get("outcome") == "passed" and test.get("outcome") in FAILING_OUTCOMES:
            result.tests_regressed.append(TestChange(test["nodeid"], "passed", test["outcome"],
                                                     " ".join(str(test.get("message") or "").split())[:240]))
    return result


def fingerprint_changes(baseline: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, baseline, current) for each fingerprint field that changes arithmetic and differs."""
    return [(k, baseline.get(k), current.get(k)) for k in ARITHMETIC_KEYS if baseline.get(k) != current.get(k)]


def main_compare(argv: list[str] | None = None) -> int:
    """`compare BASELINE CURRENT [--markdown PATH]`: exit 1 on regression, 2 on unreadable input."""
    parser = argparse.ArgumentParser(prog="mrh report compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", help="baseline run directory or results.json")
    parser.add_argument("current", help="current run directory or results.json")
    parser.add_argument("--markdown", metavar="PATH", help="also write the Markdown report here")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors: return it, as the docstring says
        return int(e.code or 0)
    runs = {}
    for role in ("baseline", "current"):
        try:
            runs[role] = load_run(getattr(args, role))
        except ValueError as e:
            print(f"mrh report compare: cannot read the {role} run: {e}", file=sys.stderr)
            return 2
    result = compare_runs(runs["baseline"], runs["current"])
    text = result.to_markdown()
    print(text)
    if args.markdown:
        path = Path(args.markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text)
    return 1 if result.regressed else 0


if __name__ == "__main__":
    raise SystemExit(main_compare())
