"""Render one run directory: summary.md (GitHub step summary), report.html (tables + plots),
results.csv. The schema of results.json is documented in harness.report.results."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from harness.report.blocks import Block, blocks_to_html
from harness.report.plots import plots
from harness.report.results import ROW_COLUMNS, load_run
from harness.report.rows import atomic_write
from harness.report.summary import summary_blocks, summary_markdown


def write_summary_md(run_dir: str | os.PathLike) -> Path:
    run_dir = Path(run_dir)
    return atomic_write(run_dir / "summary.md", summary_markdown(load_run(run_dir)))


def write_html(run_dir: str | os.PathLike) -> Path:
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    blocks = summary_blocks(run, max_groups=2000, max_failures=2000)
    images = plots(run)
    # Plots right after the failures, before the long per-suite tables.
    at = next((i for i, (k, v) in enumerate(blocks) if k == "h2" and str(v).startswith("Suite ")),
              len(blocks))
    figures: list[Block] = [("h2", "Plots")] + [("img", image) for image in images] if images else []
    return atomic_write(run_dir / "report.html",
                        blocks_to_html(blocks[:at] + figures + blocks[at:], f"run {run_dir.name}"))


def write_csv(run_dir: str | os.PathLike) -> Path:
    """results.csv: one line per row, `extra` as JSON text (so one CSV cell, no embedded newline)."""
    run_dir = Path(run_dir)
    rows = load_run(run_dir)["rows"]
    frame = pd.DataFrame.from_records(
        [{c: (json.dumps(r.get(c) or {}, sort_keys=True, default=str) if c == "extra" else r.get(c))
          for c in ROW_COLUMNS} for r in rows], columns=list(ROW_COLUMNS))
    return atomic_write(run_dir / "results.csv", frame.to_csv(index=False, lineterminator="\n"))


def render_run(run_dir: str | os.PathLike) -> dict[str, Path]:
    """Write summary.md, report.html and results.csv into the run directory."""
    return {"summary": write_summary_md(run_dir), "html": write_html(run_dir),
            "csv": write_csv(run_dir)}


if __name__ == "__main__":  # python -m harness.report.render RUN_DIR...
    import sys

    for directory in sys.argv[1:]:
        for name, written in render_run(directory).items():
            print(f"{name}: {written}")
