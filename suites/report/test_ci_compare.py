"""CI's regression check end to end: `make test` writes its run to a known directory
(--mrh-run-dir), `make baseline` makes a clean run the baseline, `make compare` fails on a real
regression and passes on the same code with new tests, skipped tests, other hypothesis examples
and other wall times (which a different CI machine gives)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the environment running these tests holds `mrh`
# The Makefile as a fresh shell runs it: under `make nightly RUN_DIR=...` the outer make's variables
# reach an inner make through MAKEFLAGS and would override what these tests read.
MAKE_ENV = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
INNER = """
import json
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from harness.report import record_row

VALUES = json.load(open("values.json"))

def test_parity(report):
    report.add("max_abs", VALUES["max_abs"], tolerance=1e-5, passed=VALUES["max_abs"] <= 1e-5, claim="bounded",
               dtype="fp32")
    report.add("save_s", VALUES["save_s"], tolerance=None, passed=True, claim="timing", units="s")

@pytest.mark.skipif(VALUES.get("skip_other", False), reason="not in this run")
def test_other(report):
    report.add("mean_abs", 5e-7, tolerance=2e-6, passed=True, claim="bounded", dtype="fp32")

@pytest.mark.skipif(not VALUES.get("extra_test", False), reason="a test added later")
def test_extra(report):
    report.add("mean_abs", 4e-7, tolerance=2e-6, passed=True, claim="bounded", dtype="fp32")

@settings(max_examples=3, deadline=None, database=None)
@given(x=st.floats(0, 5e-6))
def test_generated(x):
    record_row("max_abs", x, tolerance=1e-5, passed=True, claim="bounded", dtype="fp32")
"""
BASE = {"max_abs": 2e-6, "save_s": 0.5}


@pytest.fixture
def project(pytester):
    pytester.makepyfile(test_inner=INNER)
    return pytester


def _test(project, **values) -> Path:
    """`make test`'s pytest call, on the inner project: the run lands in runs/latest."""
    (project.path / "values.json").write_text(json.dumps({**BASE, **values}))
    result = project.runpytest("-p", "no:cacheprovider", f"--mrh-run-dir={project.path / 'runs' / 'latest'}")
    result.assert_outcomes(passed=3 + bool(values.get("extra_test")) - bool(values.get("skip_other")),
                           skipped=1 - bool(values.get("extra_test")) + bool(values.get("skip_other")))
    return project.path / "runs" / "latest"


def _make(target: str, project) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), target, f"BIN={BIN}",
                           f"RUN_DIR={project.path / 'runs' / 'latest'}", f"BASELINE={project.path / 'baseline'}"],
                          capture_output=True, text=True, env=MAKE_ENV)


def _compare(project) -> tuple[int, str]:
    """(exit status of `mrh report compare` under make, the Markdown it wrote)."""
    done = _make("compare", project)
    markdown = (project.path / "runs" / "latest" / "compare.md").read_text()
    assert markdown.rstrip("\n") in done.stdout  # printed and written alike
    failed = re.search(r"compare\] Error (\d+)", done.stderr)
    assert (done.returncode == 0) == (failed is None), done.stderr
    return int(failed.group(1)) if failed else 0, markdown


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_compare_fails_on_a_regression_only(project):
    latest = _test(project)
    rows = json.loads((latest / "results.json").read_text())["rows"]
    assert [r["extra"].get("generated", False) for r in rows if "test_generated" in r["test"]] == [True] * 3
    made = _make("baseline", project)
    assert made.returncode == 0, made.stderr
    # packed, as committed (harness.report.packed): compare reads it below
    assert sorted(p.name for p in (project.path / "baseline").iterdir()) == ["results.json.gz", "summary.md"]

    _test(project)  # same code again: other hypothesis examples; the first run is moved, not lost
    kept = [p for p in (project.path / "runs").iterdir() if p.name != "latest"]
    assert len(kept) == 1 and (kept[0] / "results.json").is_file()
    code, markdown = _compare(project)
    assert code == 0 and "**no regression**" in markdown
    assert "### New rows (only in current) (3)" in markdown and "### Missing rows (only in baseline) (3)" in markdown

    # Another machine: 3x slower saves; and a test added, another skipped: listed, not failing.
    _test(project, save_s=1.5, extra_test=True, skip_other=True)
    code, markdown = _compare(project)
    assert code == 0 and "**no regression**" in markdown
    assert "### Moved, not gating (timings, observations) (1)" in markdown
    assert "test_extra" in markdown.split("### New rows")[1] and "test_other" in markdown.split("### Missing rows")[1]

    # A real regression: max |Δ| 10x and over its bound (the test records it without failing).
    _test(project, max_abs=2e-5)
    code, markdown = _compare(project)
    assert code == 1 and "**REGRESSED**: 1 rows regressed" in markdown
    line = next(l for l in markdown.splitlines() if "test_parity" in l and "max_abs" in l)
    assert "past its own bound" in line and "| 2e-06 | 2e-05 |" in line


def test_run_dir_refuses_a_directory_that_is_not_a_run(pytester):
    pytester.makepyfile(test_inner="def test_x():\n    pass\n")
    precious = pytester.path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    result = pytester.runpytest("-p", "no:cacheprovider", f"--mrh-run-dir={precious}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--mrh-run-dir: *precious exists and is not a run directory (no results.json)*"])
    assert [p.name for p in precious.iterdir()] == ["notes.txt"]


def test_ci_runs_setup_test_and_compare_and_stops_at_the_first_failure():
    """.ci/run is the README's commands and the baseline compare, under `set -e` (so pytest's exit
    5, no tests collected, fails CI like any other failure)."""
    lines = [l.strip() for l in (REPO / ".ci" / "run").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert "set -euo pipefail" in lines
    assert [l.split()[1] for l in lines if l.startswith("make ")] == ["setup", "test", "compare"]
    dry = subprocess.run(["make", "-n", "-C", str(REPO), "test", "compare"], capture_output=True, text=True, check=True,
                         env=MAKE_ENV)
    assert "--mrh-run-dir=reports/runs/latest" in dry.stdout
    assert "report compare reports/baselines/cpu reports/runs/latest" in dry.stdout
