"""`mrh report compare|trend|render|baseline|pack`: the report tools on the command line."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("compare", "trend", "render", "baseline", "pack"),
                        help="compare BASELINE CURRENT | trend RUN_DIR... [--out DIR] | render RUN_DIR | "
                             "baseline RUN_DIR [--to DIR] | pack PATH... [--threshold BYTES]")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the action's own arguments (see ACTION -h)")


def _render(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mrh report render",
                                     description="(re)write summary.md, report.html and results.csv of a run")
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    from harness.report.render import render_run

    try:
        render_run(args.run_dir)
    except ValueError as exc:
        print(f"mrh report render: {exc}", file=sys.stderr)
        return 2
    print(f"rendered {args.run_dir}")
    return 0


def main(args) -> int:
    if args.action == "compare":
        from harness.report.compare import main_compare

        return main_compare(args.rest)
    if args.action == "trend":
        from harness.report.trend import main_trend

        return main_trend(args.rest)
    if args.action == "baseline":
        from harness.report.baseline import main_baseline

        return main_baseline(args.rest)
    if args.action == "pack":
        from harness.report.packed import main_pack

        return main_pack(args.rest)
    return _render(args.rest)
