"""Every tolerance of the harness rests on committed figures, and they still say what it says.

For each bound of each tolerance table: its evidence names committed run reports (the CPU baseline,
GPU runs under reports/gpu/) and a statistic of their rows; the statistic is recomputed here from
the committed file. The test fails when a cited figure no longer matches the report (a stale
origin), when a committed figure breaks its bound, or when a bound has neither evidence nor the
entries it is derived from.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from harness.checkpoint.tolerances import CRASH_TABLE as CRASH
from harness.checkpoint.tolerances import TABLE as RESUME
from harness.offload.tolerances import TABLE as OFFLOAD
from harness.parity.tolerances import FP8
from harness.parity.tolerances import TABLE as PARITY
from harness.report import packed
from harness.rollout.tolerances import EXACT_TIER, REAL_SHAPE
from harness.rollout.tolerances import TABLE as SYNC
from harness.training.tolerances import TABLE as TRAINING

TABLES = (PARITY, FP8, TRAINING, RESUME, CRASH, OFFLOAD, SYNC, REAL_SHAPE, EXACT_TIER)
ENTRIES = [(table, entry) for table in TABLES for entry in table.entries]


def _id(item) -> str:
    table, entry = item
    return f"{table.name}-{entry.metric}-{entry.dtype}-{entry.regime}"


@functools.cache
def _rows(root: Path, report: str) -> list[dict]:
    path = root / report  # committed as is, or packed beside it (results.json.gz)
    assert packed.is_file(path), f"{report}: cited as evidence, not committed"
    return packed.read_json(path)["rows"]


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


def test_a_stale_citation_and_a_broken_bound_are_caught():
    """The negative control of this check: a report whose figure moved, or broke the bound."""
    from harness.tolerance import Evidence, Tolerance

    rows = [{"suite": "parity", "metric": "max_abs", "dtype": "fp32", "value": v, "extra": {"variant": var}}
            for v, var in ((3.1e-6, None), (1e-6, None), (0.5, "scaled-norm"))]
    where = (("metric", "max_abs"), ("extra.variant", None))
    measured = Evidence("r.json", 3.1e-6, where).measure(rows)
    assert measured == 3.1e-6  # the variant's row is not evidence for a correct model's bound
    assert Evidence("r.json", 3.1e-6, where).matches(measured)
    assert not Evidence("r.json", 2.9e-6, where).matches(measured)  # stale: cites 2.9e-6
    assert not Tolerance("max_abs", "fp32", 3e-6).passes(measured)  # the bound no longer holds
    with pytest.raises(ValueError, match="no row"):
        Evidence("r.json", 1.0, (("metric", "mean_abs"),)).measure(rows)
