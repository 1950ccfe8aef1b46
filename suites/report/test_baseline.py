"""`mrh report baseline`: only a complete, clean run becomes the baseline; results.json and
summary.md are copied; a refused run copies nothing."""
from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest

from harness.report.baseline import main_baseline, promote
from harness.report.results import load_run
from suites.report.runs import make_run, nodeid, parity_rows, row, write_run


@pytest.fixture
def clean(tmp_path: Path) -> Path:
    run = write_run(tmp_path / "run", make_run(parity_rows()))
    (run / "summary.md").write_text("# the run's own summary\n")
    return run


def test_a_clean_run_becomes_the_baseline(tmp_path: Path, clean: Path, capsys) -> None:
    target = tmp_path / "baselines" / "cpu"
    assert main_baseline([str(clean), "--to", str(target)]) == 0
    assert sorted(p.name for p in target.iterdir()) == ["results.json.gz", "summary.md"]  # packed, summary plain
    assert gzip.decompress((target / "results.json.gz").read_bytes()) == (clean / "results.json").read_bytes()
    assert (target / "summary.md").read_text() == "# the run's own summary\n"
    assert "baseline written" in capsys.readouterr().out
    assert load_run(target)["rows"] == load_run(clean)["rows"]  # compare reads the packed form
    assert load_run(target / "results.json")["rows"] == load_run(clean)["rows"]  # by the name BASELINE gives too


def test_a_new_baseline_replaces_a_plain_one_and_can_come_from_a_packed_run(tmp_path: Path, clean: Path) -> None:
    """An older baseline committed plain would shadow the packed one (readers prefer the plain
    file): promote removes it. A packed run (a committed one) can be promoted as well."""
    target = tmp_path / "b"
    target.mkdir()
    (target / "results.json").write_text("stale")
    promote(clean, target)
    assert sorted(p.name for p in target.iterdir()) == ["results.json.gz", "summary.md"]
    again = tmp_path / "again"
    promote(target / "results.json.gz", again)
    assert (again / "results.json.gz").read_bytes() == (target / "results.json.gz").read_bytes()


def test_a_missing_summary_is_rendered(tmp_path: Path, clean: Path) -> None:
    (clean / "summary.md").unlink()
    promote(clean, tmp_path / "b")
    assert (tmp_path / "b" / "summary.md").read_text().startswith("# megatron-rl-harness run: PASSED")


@pytest.mark.parametrize(("spoil", "message"), [
    (lambda d: d["meta"].update(complete=False), "the run did not finish"),
    (lambda d: d["tests"][0].update(outcome="failed"), "1 tests failed, errored or did not finish"),
    (lambda d: d["tests"][1].update(outcome="unfinished"), "1 tests failed, errored or did not finish"),
    (lambda d: d["rows"].append(row(nodeid("test_bad", "cpu"), "max_abs", 1.0, passed=False, outcome="failed")),
     "1 rows are over tolerance in failing tests"),
    (lambda d: d.update(tests=[]), "the run recorded no tests"),
])
def test_a_run_that_is_not_clean_is_refused_and_nothing_is_copied(tmp_path: Path, spoil, message, capsys) -> None:
    document = copy.deepcopy(make_run(parity_rows()))
    spoil(document)
    run = write_run(tmp_path / "run", document)
    target = tmp_path / "baseline"
    target.mkdir()
    (target / "results.json").write_text("old")
    assert main_baseline([str(run), "--to", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be a baseline" in err[0] and message in err[0]
    assert [p.name for p in target.iterdir()] == ["results.json"] and (target / "results.json").read_text() == "old"


def test_unreadable_run_exits_2(tmp_path: Path, capsys) -> None:
    assert main_baseline([str(tmp_path / "nope"), "--to", str(tmp_path / "b")]) == 2
    assert "no such file" in capsys.readouterr().err and not (tmp_path / "b").exists()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text(json.dumps({"rows": [], "schema_version": 9}))
    assert main_baseline([str(tmp_path / "bad")]) == 2
