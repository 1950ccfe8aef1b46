"""The run report as a whole session sees it: rows from every rank and every xdist worker reach one
results.json with each test's outcome, and a run killed mid-way still leaves a readable report.

CI runs the inner session once, under xdist (-n 2), and checks there what the single-process session
would show too: the rows of the ranks of a worker's world, the test process's, and every outcome (a
single-process session is what CI's own `make test` is; the inner one without xdist runs nightly)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

INNER = '''
import time, pytest
from harness.report import record_row

def _on_ranks(value):
    import torch.distributed as dist
    record_row("rank_value", value + dist.get_rank(), tolerance=None, passed=True, claim="observed", layout="dp2")
    return dist.get_rank()

@pytest.mark.world_size(2)
def test_rows_from_ranks(world):
    assert world.run(_on_ranks, 10) == [0, 1]

def test_row_from_the_test_process(report):
    report.add("local_value", 1.5, tolerance=2.0, passed=True, claim="bounded", model="m")

def test_fails():
    assert False, "on purpose"
'''


def _results(report_dir: Path) -> dict:
    runs = [p for p in report_dir.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return json.loads((runs[0] / "results.json").read_text())


def _check_rows_and_outcomes(document: dict) -> None:
    """Each rank's row, the test process's row and every test's outcome, as INNER recorded them."""
    assert document["schema_version"] == 2 and document["meta"]["complete"] is True
    rank_rows = sorted((r for r in document["rows"] if r["metric"] == "rank_value"), key=lambda r: r["extra"]["rank"])
    assert [(r["value"], r["extra"]["rank"], r["outcome"]) for r in rank_rows] == [(10, 0, "passed"), (11, 1, "passed")]
    assert rank_rows[0]["test"].endswith("test_rows_from_ranks[cpu]")
    local = [r for r in document["rows"] if r["metric"] == "local_value"]
    assert len(local) == 1 and local[0]["model"] == "m" and local[0]["suite"]
    outcomes = {t["nodeid"].split("::")[1]: t["outcome"] for t in document["tests"]}
    assert outcomes == {"test_rows_from_ranks[cpu]": "passed", "test_row_from_the_test_process": "passed",
                        "test_fails": "failed"}


def test_rows_from_ranks_and_the_test_reach_results_with_outcomes(pytester):
    pytester.makepyfile(test_inner=INNER)
    reports = pytester.path / "reports"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mrh-devices=cpu",
                                           f"--mrh-report-dir={reports}")
    result.assert_outcomes(passed=2, failed=1)
    _check_rows_and_outcomes(_results(reports))


# nightly: ~40 s on the CI machine (two xdist workers, each its own world; CI runs no xdist); CI runs the
# single-process session above, which the merged report must equal in what it checks (_check_rows_and_outcomes)
@pytest.mark.nightly
def test_xdist_workers_are_merged_into_one_report(pytester):
    pytester.makepyfile(test_inner=INNER)
    reports = pytester.path / "reports"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mrh-devices=cpu", "-n", "2",
                                           f"--mrh-report-dir={reports}")
    result.assert_outcomes(passed=2, failed=1)
    document = _results(reports)
    metrics = sorted(r["metric"] for r in document["rows"])
    assert metrics == ["local_value", "rank_value", "rank_value"]
    assert {t["outcome"] for t in document["tests"]} == {"passed", "failed"} and len(document["tests"]) == 3
    assert all(r["outcome"] == "passed" for r in document["rows"])
    _check_rows_and_outcomes(document)  # what the single-process session checks, on the merged report


def test_a_killed_run_leaves_a_readable_report_with_unfinished_tests(pytester):
    pytester.makepyfile(test_inner='''
        def test_first(report):
            report.add("before_kill", 1.0, tolerance=None, passed=True, claim="observed")

        def test_second():
            import time
            time.sleep(600)
    ''')
    reports = pytester.path / "reports"
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--mrh-report-dir={reports}"],
                            cwd=pytester.path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            runs = list(reports.glob("*/results.json")) if reports.exists() else []
            if runs and '"before_kill"' in runs[0].read_text():
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    document = _results(reports)
    outcomes = {t["nodeid"].split("::")[1]: t["outcome"] for t in document["tests"]}
    assert outcomes == {"test_first": "passed", "test_second": "unfinished"}
    assert document["meta"]["complete"] is False
    assert [r["metric"] for r in document["rows"]] == ["before_kill"]
    # `mrh report render` turns what the killed run left into the usual summary.
    from harness.report.render import render_run

    summary = render_run(next(reports.iterdir()))["summary"].read_text()
    assert "unfinished" in summary and "test_second" in summary


def test_the_written_file_is_the_document_as_outcomes_change(tmp_path):
    """results.json keeps each row's text between writes (harness.report.session._text): what it
    writes is document() exactly, also after a row's test changes its outcome and with rows of
    tests still running."""
    from harness.report.rows import Row
    from harness.report.session import RunReport

    run = RunReport(tmp_path, args=["suites"])
    run.collected([("s/a.py::t1", "s"), ("s/a.py::t2", "s")])
    run.add_rows([Row(suite="s", test="s/a.py::t1", layout="tp1", metric="m", value=1.5, tolerance=2.0, passed=True,
                      claim="bounded")])
    assert json.loads(run.flush().read_text()) == run.document()
    run.outcome("s/a.py::t1", "s", "call", "passed", 0.5, "")
    run.add_rows([Row(suite="s", test="s/a.py::t2", layout="tp1", metric="m", value=0.25, tolerance=None,
                      passed=False, claim="observed")])
    written = json.loads(run.flush().read_text())
    assert [r["outcome"] for r in written["rows"]] == ["passed", "unfinished"]
    assert json.dumps(written, sort_keys=True) == json.dumps(run.document(), sort_keys=True, default=str)
