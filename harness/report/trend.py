"""Trends across runs: one PNG per metric (x: the runs in start-time order, one line per
(model, layout, dtype), one panel per dtype so fp32's 1e-6 is not flattened by bf16's 1e-2),
plus index.html that embeds them all.

Each point is the WORST value of that series in that run (max, or min for higher-is-better metrics,
per rules.py), over the tests, variants and devices it merges: a trend should show the first run
where anything in the series got worse. Negative controls (rows over tolerance in passing tests)
are left out, as in report.html, since they are meant to be far off.
"""
from __future__ import annotations

import argparse
import base64
import html
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from harness.report.plots import figure_png
from harness.report.results import is_expected_failure, load_run
from harness.report.rows import atomic_write
from harness.report.rules import rule_for

SERIES_DIMS = ("model", "layout", "dtype")
MAX_SERIES = 8  # lines beyond this are folded into one "others" line (listed in index.html)
DEFAULT_OUT = Path("reports/trend")


def run_label(run: dict[str, Any], fallback: str) -> str:
    started = run["meta"].get("started")
    return str(started).replace("T", " ")[:16] if started else fallback


def trend_frame(runs: list[tuple[str, dict[str, Any]]]) -> pd.DataFrame:
    """Long table: run (order), label, metric, series, value: one line per row of every run."""
    records = []
    for order, (label, run) in enumerate(runs):
        for row in run["rows"]:
            if is_expected_failure(row):
                continue
            try:
                value = float(row.get("value"))
            except (TypeError, ValueError):
                continue
            series = "/".join(str(row.get(d) or "") for d in SERIES_DIMS if row.get(d)) or "all"
            records.append({"run": order, "label": label, "metric": row.get("metric", ""),
                            "dtype": row.get("dtype") or "", "series": series, "value": value})
    return pd.DataFrame.from_records(records,
                                     columns=["run", "label", "metric", "dtype", "series", "value"])


def metric_table(data: pd.DataFrame, metric: str) -> tuple[pd.DataFrame, list[str]]:
    """(run x series table of worst values, series folded into "others") for one metric's rows.
    Keeps the MAX_SERIES - 1 series worst in their latest run (closest to failing); the rest
    become one line of their worst value, and are named in index.html."""
    rule = rule_for(metric)
    aggregate = "min" if rule.direction == "higher_is_better" else "max"
    table = data.pivot_table(index="run", columns="series", values="value", aggfunc=aggregate)
    if len(table.columns) <= MAX_SERIES:
        return table, []
    latest = table.ffill().iloc[-1]
    ranked = latest.sort_values(ascending=(rule.direction == "higher_is_better")).index
    keep, rest = list(ranked[: MAX_SERIES - 1]), sorted(ranked[MAX_SERIES - 1:])
    folded = table[keep].copy()
    folded[f"others ({len(rest)}, worst)"] = getattr(table[rest], aggregate)(axis=1)
    return folded, rest


def plot_metric(panels: list[tuple[str, pd.DataFrame]], labels: list[str], metric: str) -> bytes:
    """One panel per dtype: (dtype, run x series table)."""
    fig = Figure(figsize=(max(7.0, 0.6 * len(labels) + 5), 4.0 * len(panels)))
    for k, (dtype, table) in enumerate(panels):
        _plot_panel(fig.add_subplot(len(panels), 1, k + 1), table, labels, metric, dtype)
    fig.tight_layout()
    return figure_png(fig)


def _plot_panel(ax, table: pd.DataFrame, labels: list[str], metric: str, dtype: str) -> None:
    for series in table.columns:
        ax.plot(list(table.index), table[series].tolist(), marker="o", label=str(series))
    values = table.stack()
    positive = values[values > 0]
    # A log axis only where the values are all positive and span orders of magnitude (|Δ|s).
    if len(positive) == len(values) and len(values) and positive.max() / positive.min() > 100:
        ax.set_yscale("log")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    rule = rule_for(metric)
    ax.set_title(f"{metric}{' — ' + dtype if dtype else ''} per run "
                 f"(worst per model/layout/dtype; {rule.direction.replace('_', ' ')})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _file_name(metric: str, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", metric) or "metric"
    name, n = f"{base}.png", 1
    while name in taken:  # two metrics that sanitise alike must not overwrite each other's PNG
        n += 1
        name = f"{base}-{n}.png"
    taken.add(name)
    return name


def trend(run_dirs: list[Path], out_dir: Path) -> Path:
    """Write one PNG per metric and index.html into out_dir; return index.html's path.
    Runs are ordered by meta.started (runs without it keep their argument order, last)."""
    loaded = [(run_label(run, Path(d).name), run) for d in run_dirs for run in [load_run(d)]]
    loaded.sort(key=lambda item: (item[1]["meta"].get("started") is None,
                                  str(item[1]["meta"].get("started") or "")))
    frame = trend_frame(loaded)
    labels = [f"#{i + 1} {label}" for i, (label, _) in enumerate(loaded)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts, taken = [], set()
    for metric in dict.fromkeys(frame["metric"]):
        rows = frame[frame["metric"] == metric]
        panels, folded = [], []
        for dtype, part in rows.groupby("dtype", sort=True):
            table, rest = metric_table(part, metric)
            panels.append((str(dtype), table))
            folded += rest
        png = plot_metric(panels, labels, metric)
        name = _file_name(metric, taken)
        atomic_write(out_dir / name, png)
        data = base64.b64encode(png).decode("ascii")
        # Collapsed: with a 100-layout matrix the list is long, and it is reference, not news.
        note = (f"<details><summary>Folded into “others” ({len(folded)} series)</summary>"
                f"<p>{html.escape(', '.join(folded))}</p></details>" if folded else "")
        parts.append(f"<h2>{html.escape(metric)}</h2><img alt=\"{html.escape(metric)}\" "
                     f"src=\"data:image/png;base64,{data}\">{note}")
    runs = "".join(f"<li>{html.escape(label)}: <code>{html.escape(run['source'])}</code></li>"
                   for label, run in loaded)
    body = "\n".join(parts) or "<p>No rows with numeric values in these runs.</p>"
    page = (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>trend</title><style>"
            f"body{{font-family:sans-serif;margin:1.5em}}img{{max-width:100%}}</style></head><body>"
            f"<h1>Trend over {len(loaded)} runs</h1><ol>{runs}</ol>\n{body}\n</body></html>\n")
    return atomic_write(out_dir / "index.html", page)


def main_trend(argv: list[str] | None = None) -> int:
    """`trend RUN_DIR... [--out DIR]`: 0 on success, 2 when a run cannot be read."""
    parser = argparse.ArgumentParser(prog="mrh report trend", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or results.json)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"output directory (default {DEFAULT_OUT})")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        index = trend([Path(r) for r in args.runs], Path(args.out))
    except ValueError as e:
        print(f"mrh report trend: {e}", file=sys.stderr)
        return 2
    print(index)
    return 0


if __name__ == "__main__":
    raise SystemExit(main_trend())
