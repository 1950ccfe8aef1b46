"""Every tolerance of the harness rests on committed figures, and they still say what it says.

For each bound of each tolerance table: its evidence names committed run reports (the CPU baseline,
GPU runs under reports/gpu/) and a statistic of their rows; the statistic is recomputed here from
the committed file. The test fails when a cited figure no longer matches the report (a stale
origin), when a committed figure breaks its bound, or when a bound has neither evidence nor the
entries it is derived from.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from harness.parity.tolerances import TABLE as PARITY
from harness.training.tolerances import TABLE as TRAINING

TABLES = (PARITY, TRAINING)
ENTRIES = [(table, entry) for table in TABLES for entry in table.entries]


def _id(item) -> str:
    table, entry = item
    return f"{table.name}-{entry.metric}-{entry.dtype}-{entry.regime}"


@functools.cache
def _rows(root: Path, report: str) -> list[dict]:
    path = root / report
    assert path.is_file(), f"{report}: cited as evidence, not committed"
    return json.loads(path.read_text())["rows"]


@pytest.mark.parametrize("item", ENTRIES, ids=[_id(i) for i in ENTRIES])
def test_every_cited_figure_is_in_the_committed_report_and_within_its_bound(item, pytestconfig):
    table, entry = item
    assert entry.rationale, "say why the limit is what it is"
    if not entry.evidence:
        assert entry.derived_from, "a bound needs evidence or the entries it is derived from"
        for metric in entry.derived_from:
            source = table.get(metric, entry.dtype, entry.regime)
            assert source.evidence, f"{metric} ({entry.dtype}, {entry.regime}) has no evidence itself"
    for evidence in entry.evidence:
        measured = evidence.measure(_rows(pytestconfig.rootpath, evidence.report))
        assert evidence.matches(measured), (
            f"stale origin: cites {evidence.figure:.{evidence.digits}g}, {evidence.report} says "
            f"{measured:.{evidence.digits + 2}g} ({dict(evidence.where)})")
        assert entry.passes(measured), (
            f"{evidence.report}: {evidence.statistic} {measured:.3g} breaks the bound "
            f"{entry.kind} {entry.limit:g}")


def test_evidence_statistics_follow_the_bound_direction():
    """A "max" bound is tested by the largest figure, a "min" bound by the smallest."""
    for _, entry in ENTRIES:
        for evidence in entry.evidence:
            assert evidence.statistic == entry.kind, f"{entry.metric}/{entry.dtype}: {evidence}"
