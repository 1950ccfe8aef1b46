"""`mrh report baseline RUN_DIR [--to DIR]`: make a run the committed baseline that `make compare`
(and CI) compares every run against.

Only a clean run can be a baseline: it finished, no test failed, errored or stayed unfinished, and
no row is over tolerance outside a negative control. Otherwise one error names what is wrong and
nothing is copied. The baseline is the run's results.json, stored packed as results.json.gz (what
compare reads; harness.report.packed: a GPU command carries the tracked tree, so it stays small), and
summary.md, plain (what a reviewer reads in the diff), each replaced atomically.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness.report.packed import read_bytes, write_packed
from harness.report.results import FAILING_OUTCOMES, RESULTS, is_real_failure, load_run, results_path
from harness.report.rows import atomic_write
from harness.report.summary import summary_markdown

DEFAULT_BASELINE = Path("reports/baselines/cpu")
BASELINE_FILES = ("results.json.gz", "summary.md")


def problems(run: dict) -> list[str]:
    """Why this run cannot be a baseline (empty: it can)."""
    found = []
    if run["meta"].get("complete") is not True:
        found.append("the run did not finish (meta.complete is not true)")
    if not run["tests"]:
        found.append("the run recorded no tests")
    failing = [t["nodeid"] for t in run["tests"] if t.get("outcome") in FAILING_OUTCOMES]
    if failing:
        found.append(f"{len(failing)} tests failed, errored or did not finish, e.g. {failing[0]}")
    over = [r for r in run["rows"] if is_real_failure(r)]
    if over:
        found.append(f"{len(over)} rows are over tolerance in failing tests, e.g. {over[0].get('test')} "
                     f"{over[0].get('metric')}")
    return found


def promote(run_dir: str | os.PathLike, to: str | os.PathLike = DEFAULT_BASELINE) -> list[Path]:
    """Copy the run's results.json (packed: results.json.gz, a plain results.json there is removed)
    and summary.md into `to`; ValueError before any copy if the run is unreadable or not clean."""
    run = load_run(run_dir)
    found = problems(run)
    if found:
        raise ValueError(f"{results_path(run_dir)} cannot be a baseline: " + "; ".join(found))
    to = Path(to)
    to.mkdir(parents=True, exist_ok=True)
    source = results_path(run_dir)
    written = [write_packed(to / RESULTS, read_bytes(source))]
    summary = source.with_name("summary.md")
    text = summary.read_text(encoding="utf-8") if summary.is_file() else summary_markdown(run)
    written.append(atomic_write(to / "summary.md", text))
    return written


def main_baseline(argv: list[str] | None = None) -> int:
    """Exit 0 when copied, 2 when the run is unreadable or not clean (nothing copied)."""
    parser = argparse.ArgumentParser(prog="mrh report baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="run directory or its results.json (plain or .gz)")
    parser.add_argument("--to", default=str(DEFAULT_BASELINE), help=f"baseline directory (default {DEFAULT_BASELINE})")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        written = promote(args.run_dir, args.to)
    except ValueError as exc:
        print(f"mrh report baseline: {exc}", file=sys.stderr)
        return 2
    print("baseline written: " + ", ".join(str(p) for p in written))
    return 0
