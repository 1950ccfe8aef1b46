"""Render one run directory: summary.md (GitHub step summary), report.html (tables + plots), results.csv.

Schema of `results.json`, version 1 (SCHEMA_VERSION)::

    {
      "schema_version": 1,
      "meta": {
        "started":  "2026-11-21T20:54:12Z",      # ISO 8601
        "finished": "2026-11-21T20:57:41Z",      # null while the run is going (or was killed)
        "args": ["suites/parity", "-m", "gpu"],   # pytest's invocation args
        "fingerprint": {...},                     # fingerprint.environment_fingerprint()
        "complete": true                          # false: the session did not reach its end
      },
      "tests": [                                  # one entry per collected test
        {"nodeid": "suites/parity/test_parity.py::test_x[cuda-tp2-tiny-qwen3-fp32]",
         "suite": "parity",
         "outcome": "passed",                     # passed | failed | error | skipped | unfinished
         "duration_s": 1.23,
         "message": ""}                           # failure/skip text, "" when passed
      ],
      "rows": [                                   # harness.report.rows.Row.as_dict() ...
        {"suite", "test", "layout", "metric", "value", "tolerance", "passed", "model", "dtype",
         "device", "units", "extra": {...},
         "outcome": "passed"}                     # ... plus the outcome of the row's test
      ]
    }

`meta.*` fields, `tests` and a row's `outcome` are optional on read (results.json files written by
Recorder before the plugin recorded them still load): a missing row outcome is looked up in `tests`
by nodeid, else None. `rows[].test` is the pytest nodeid of the test that produced the row.

A row with passed == False whose test passed is an *expected* failure: a negative control asserts
that a broken model does NOT match, so its rows are over tolerance by design. Reports list those
apart from real failures, and plots of the parity matrix leave them out.
"""
from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.report.rows import SCHEMA_VERSION, atomic_write
from harness.report.rules import rule_for

RESULTS = "results.json"
OUTCOMES = ("passed", "failed", "error", "skipped", "unfinished")
FAILING_OUTCOMES = ("failed", "error", "unfinished")
ROW_COLUMNS = ("suite", "test", "layout", "model", "dtype", "device", "metric", "value", "tolerance",
               "passed", "units", "outcome", "extra")
# Keys of `extra` that identify a row (compare.py keys on them too), shown as table dimensions.
EXTRA_DIMS = ("variant", "packing")
MD_LIMIT_BYTES = 60_000  # GitHub rejects step summaries over 1 MiB; this one stays readable
FINGERPRINT_ESSENTIALS = ("python", "torch", "megatron-core", "mbridge", "transformer-engine",
                          "transformers", "cuda", "driver", "gpu", "device", "commit", "host")


# ---------------------------------------------------------------------------------------- loading
def results_path(run: str | os.PathLike) -> Path:
    """A run directory or a results.json path -> the results.json path."""
    path = Path(run)
    return path / RESULTS if path.is_dir() else path


def load_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and normalise a run's results.json (a run directory or the file itself).

    Raises ValueError with the path and the reason when the file is missing, is not JSON, or has a
    schema_version this code does not know: a report of the wrong shape must not render as empty.
    """
    path = results_path(run_dir)
    if not path.is_file():
        raise ValueError(f"{path}: no such file (expected a run directory holding {RESULTS}, "
                         f"or the path of a {RESULTS})")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON document ({e})") from e
    return normalise_run(document, source=str(path))


def normalise_run(document: Any, source: str = "<dict>") -> dict[str, Any]:
    """Check the schema version and fill optional fields, so renderers never test for absence."""
    if not isinstance(document, dict) or "rows" not in document:
        raise ValueError(f"{source}: not a harness results document (no 'rows' key)")
    version = document.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(f"{source}: schema_version {version!r} is unknown; this code reads "
                         f"schema_version {SCHEMA_VERSION}")
    meta = dict(document.get("meta") or {})
    meta.setdefault("started", None)
    meta.setdefault("finished", None)
    meta.setdefault("args", [])
    meta.setdefault("fingerprint", {})
    meta.setdefault("complete", None)  # None: an older file that did not say
    tests = [dict(t) for t in document.get("tests") or []]
    outcome_of = {t.get("nodeid"): t.get("outcome") for t in tests}
    rows = []
    for row in document["rows"]:
        row = dict(row)
        row["extra"] = dict(row.get("extra") or {})
        row.setdefault("outcome", outcome_of.get(row.get("test")))
        for key in ("layout", "model", "dtype", "device", "units"):
            row[key] = row.get(key) or ""
        rows.append(row)
    return {"schema_version": version, "meta": meta, "tests": tests, "rows": rows,
            "source": source}


def is_expected_failure(row: dict[str, Any]) -> bool:
    """Over tolerance inside a test that passed: a negative control doing its job."""
    return not row.get("passed") and row.get("outcome") == "passed"


def is_real_failure(row: dict[str, Any]) -> bool:
    return not row.get("passed") and row.get("outcome") != "passed"


def rows_frame(rows: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Rows as a DataFrame with `extra`'s identifying keys lifted into columns."""
    records = []
    for row in rows:
        record = {c: row.get(c) for c in ROW_COLUMNS}
        for key in EXTRA_DIMS:
            value = (row.get("extra") or {}).get(key)
            record[key] = "" if value is None else str(value)
        record["expected_failure"] = is_expected_failure(row)
        records.append(record)
    columns = list(ROW_COLUMNS) + list(EXTRA_DIMS) + ["expected_failure"]
    return pd.DataFrame.from_records(records, columns=columns)


# ------------------------------------------------------------------------------------ formatting
def fmt_value(value: Any) -> str:
    """Numbers short but faithful: 3 significant digits, except ratios a hair off an integer
    (token_mult_prob_error 1.0000005 would print as "1") which print as "1+5e-07"."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        v = float(value)
        if math.isnan(v) or math.isinf(v):
            return str(v)
        nearest = round(v)
        if nearest != 0 and v != nearest and abs(v - nearest) < 1e-3 and abs(v) < 10:
            return f"{nearest}{v - nearest:+.2g}"
        return f"{v:.3g}"
    return str(value)


def _one_line(text: Any, limit: int = 240) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------------------------------------- content model
@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]
    more: int = 0  # rows left out by a cap: rendered as "... N more"
    failing: set[tuple[int, int]] = field(default_factory=set)  # (row, col) cells to highlight
    more_hint: str = "see report.html / results.csv"  # where the capped rows can be found


Block = tuple[str, Any]  # ("h1"|"h2"|"h3"|"p", text) or ("table", Table) or ("img", (title, png))


def summary_blocks(run: dict[str, Any], max_groups: int = 100, max_failures: int = 50) -> list[Block]:
    """The report's content, shared by the Markdown and the HTML renderer."""
    tests, rows, meta = run["tests"], run["rows"], run["meta"]
    counts = {o: sum(t.get("outcome") == o for t in tests) for o in OUTCOMES}
    failed_tests = [t for t in tests if t.get("outcome") in FAILING_OUTCOMES]
    real = [r for r in rows if is_real_failure(r)]
    expected = [r for r in rows if is_expected_failure(r)]
    status = ("FAILED" if failed_tests or real
              else "INCOMPLETE" if meta.get("complete") is False else "PASSED")
    blocks: list[Block] = [("h1", f"megatron-rl-harness run: {status}"), ("p", _when(meta))]
    blocks.append(("table", _fingerprint_table(meta.get("fingerprint") or {})))
    test_counts = " · ".join(f"{counts[o]} {o}" for o in OUTCOMES) if tests else "not recorded"
    blocks.append(("p", f"**Tests:** {len(tests)} ({test_counts}). **Rows:** {len(rows)} "
                        f"({len(real)} failing, {len(expected)} over tolerance in passing tests "
                        f"= expected, negative controls)."))
    blocks.append(("h2", f"Failures ({_n(len(failed_tests), 'test')}, {_n(len(real), 'row')})"))
    if not failed_tests and not real:
        blocks.append(("p", "None."))
    if failed_tests:
        blocks.append(("h3", "Tests"))
        blocks.append(("table", _capped(
            ["test", "outcome", "duration_s", "message"],
            [[t.get("nodeid", ""), t.get("outcome", ""), fmt_value(t.get("duration_s")),
              _one_line(t.get("message"))] for t in failed_tests], max_failures)))
    if real:
        blocks.append(("h3", "Rows over tolerance"))
        blocks.append(("table", _row_table(real, max_failures)))
    if expected:
        blocks.append(("h2", f"Expected: {_n(len(expected), 'row')} over tolerance in passing tests"))
        blocks.append(("p", "Negative controls: these tests pass because their rows miss the "
                            "tolerance (a deliberately broken model must not match)."))
        blocks.append(("table", _expected_table(expected, max_failures)))
    frame = rows_frame(rows)
    for suite, part in frame.groupby("suite", sort=True):
        blocks.append(("h2", f"Suite {suite}: {len(part)} rows, "
                             f"{part['test'].nunique()} tests"))
        blocks.extend(_suite_blocks(part, max_groups))
    return blocks


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _when(meta: dict[str, Any]) -> str:
    started, finished = meta.get("started"), meta.get("finished")
    text = f"Started {started or '?'}, " + (f"finished {finished}" if finished else "not finished")
    try:
        seconds = (datetime.fromisoformat(finished) - datetime.fromisoformat(started)).total_seconds()
        text += f" ({seconds:.0f} s)"
    except (TypeError, ValueError):
        pass
    args = " ".join(str(a) for a in meta.get("args") or [])
    return text + (f". Args: `{args}`" if args else "") + "."


def _fingerprint_table(fp: dict[str, Any]) -> Table:
    gpus = fp.get("gpus") or []
    gpu = fp.get("gpu_model") or (gpus[0] if gpus else None)
    values = dict(fp, gpu=f"{gpu} x{fp.get('gpu_count', len(gpus))}" if gpu else None,
                  commit=(fp.get("git_commit") or "")[:10] or None)
    return Table(list(FINGERPRINT_ESSENTIALS),
                 [[fmt_value(values.get(k)) for k in FINGERPRINT_ESSENTIALS]])


def _capped(columns: list[str], rows: list[list[str]], cap: int) -> Table:
    return Table(columns, rows[:cap], more=max(0, len(rows) - cap))


def _row_table(rows: list[dict[str, Any]], cap: int) -> Table:
    body = [[r.get("test", ""), r["layout"], r["model"], r["dtype"], r.get("metric", ""),
             fmt_value(r.get("value")), fmt_value(r.get("tolerance")), r.get("outcome") or "?"]
            for r in rows]
    return _capped(["test", "layout", "model", "dtype", "metric", "value", "tolerance",
                    "test outcome"], body, cap)


def _expected_table(rows: list[dict[str, Any]], cap: int) -> Table:
    """One line per test (not per row): these are context, not news."""
    by_test: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_test.setdefault(row.get("test", ""), []).append(row)
    body = [[test, group[0]["layout"], group[0]["model"], group[0]["dtype"],
             "; ".join(f"{r.get('metric')} {fmt_value(r.get('value'))} (tol {fmt_value(r.get('tolerance'))})"
                       for r in group)]
            for test, group in by_test.items()]
    return _capped(["test", "layout", "model", "dtype", "over tolerance: value (tolerance)"], body, cap)


def _suite_blocks(part: pd.DataFrame, max_groups: int) -> list[Block]:
    """One compact table per suite: a line per (model, layout, dtype, ...) group, the worst value
    of each metric under its rule's direction. Constant dimensions go into a caption instead."""
    dims = [d for d in ("model", "layout", "dtype", "device", "units") + EXTRA_DIMS
            if part[d].astype(str).str.len().gt(0).any()]
    constant = {d: part[d].iloc[0] for d in dims if part[d].nunique(dropna=False) == 1}
    dims = [d for d in dims if d not in constant]
    metrics = list(dict.fromkeys(part["metric"]))  # the order the suite records them in
    wide = len(metrics) <= 8  # a column per metric; beyond that one line per (group, metric)
    keys = dims if wide else dims + ["metric"]
    blocks: list[Block] = []
    if constant:
        blocks.append(("p", "All rows: " + ", ".join(f"{k}={v}" for k, v in constant.items())))
    lines = []
    groups = part.groupby(keys, sort=True, dropna=False) if keys else [((), part)]
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        real = int((~group["passed"].astype(bool) & ~group["expected_failure"]).sum())
        n_ok = int(group["passed"].astype(bool).sum())
        ok = f"{n_ok}/{len(group)}" + (" expected" if n_ok < len(group) and not real else "")
        cells, bad = [str(k) for k in key], []
        for metric in (metrics if wide else [key[-1]]):
            sub = group[group["metric"] == metric]
            if sub.empty:
                cells.append("")
                bad.append(False)
                continue
            worst = rule_for(metric).worst(pd.to_numeric(sub["value"], errors="coerce").tolist())
            over = not sub["passed"].astype(bool).all()
            bad.append(over)
            cells.append(("✗ " if over else "") + fmt_value(worst))
        lines.append((real == 0, cells + [ok], bad))
    # Groups holding real failures first, so a capped table never hides them.
    order = sorted(range(len(lines)), key=lambda i: (lines[i][0], i))
    columns = keys + (metrics if wide else ["worst"]) + ["rows ok"]
    table = Table(columns, [lines[i][1] for i in order[:max_groups]],
                  more=max(0, len(order) - max_groups))
    for r, i in enumerate(order[:max_groups]):
        for c, over in enumerate(lines[i][2]):
            if over:
                table.failing.add((r, len(keys) + c))
    blocks.append(("table", table))
    return blocks


# ------------------------------------------------------------------------------------- renderers
def _md_cell(text: Any) -> str:
    return _one_line(text, 400).replace("|", "\\|")


def blocks_to_markdown(blocks: list[Block]) -> str:
    out: list[str] = []
    for kind, value in blocks:
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + value)
        elif kind == "p":
            out.append(value)
        elif kind == "table":
            out.append("| " + " | ".join(_md_cell(c) for c in value.columns) + " |")
            out.append("|" + "---|" * len(value.columns))
            out.extend("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in value.rows)
            if value.more:
                out.append(f"\n... {value.more} more ({value.more_hint})")
        out.append("")
    return "\n".join(out)


def blocks_to_html(blocks: list[Block], title: str) -> str:
    body: list[str] = []
    for kind, value in blocks:
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{html.escape(value)}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{_inline_code(value)}</p>")
        elif kind == "table":
            head = "".join(f"<th>{html.escape(c)}</th>" for c in value.columns)
            trs = []
            for r, row in enumerate(value.rows):
                tds = "".join(
                    ("<td class='fail'>" if (r, c) in value.failing else "<td>") + html.escape(cell) + "</td>"
                    for c, cell in enumerate(row))
                trs.append(f"<tr>{tds}</tr>")
            more = (f"<p class='more'>... {value.more} more ({html.escape(value.more_hint)})</p>"
                    if value.more else "")
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(trs)}</tbody></table>{more}")
        elif kind == "img":
            name, png = value
            data = base64.b64encode(png).decode("ascii")
            body.append(f"<figure><img alt=\"{html.escape(name)}\" src=\"data:image/png;base64,{data}\">"
                        f"<figcaption>{html.escape(name)}</figcaption></figure>")
    style = ("body{font-family:sans-serif;margin:1.5em;max-width:1400px}"
             "table{border-collapse:collapse;margin:.5em 0;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}"
             "th{background:#f0f0f0}td.fail{background:#fdd;font-weight:bold}"
             "img{max-width:100%}figcaption{color:#555;font-size:13px}.more{color:#777}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _inline_code(text: str) -> str:
    """The paragraphs use **bold** and `code` only: translate those two, escape the rest."""
    out, parts = [], html.escape(text).split("`")
    for i, part in enumerate(parts):
        bolds = part.split("**")
        part = "".join(f"<b>{b}</b>" if j % 2 else b for j, b in enumerate(bolds))
        out.append(f"<code>{part}</code>" if i % 2 else part)
    return "".join(out)


# ----------------------------------------------------------------------------------------- plots
def figure_png(fig: Figure) -> bytes:
    """PNG bytes of a figure. Figures are built on the Agg canvas directly (no pyplot): headless,
    no global backend switch, no figure registry to leak in a long pytest session."""
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return buffer.getvalue()


def _bars(ax, table: pd.DataFrame, log: bool) -> None:
    """Grouped bars: one group per index entry, one bar per column."""
    n = max(1, len(table.columns))
    width = 0.8 / n
    for i, column in enumerate(table.columns):
        xs = [x - 0.4 + width * (i + 0.5) for x in range(len(table.index))]
        ax.bar(xs, table[column].fillna(0.0).tolist(), width=width, label=str(column))
    ax.set_xticks(range(len(table.index)))
    ax.set_xticklabels([str(i) for i in table.index], rotation=30, ha="right")
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)


def _numeric_values(rows: pd.DataFrame) -> pd.DataFrame | None:
    """The rows whose value is a number (as float), or None when there are none to plot."""
    data = rows.copy()
    data["value"] = pd.to_numeric(data["value"], errors="coerce")
    data = data.dropna(subset=["value"])
    return None if data.empty else data


def plot_max_abs(frame: pd.DataFrame) -> bytes | None:
    """(a) worst max |Δ| per layout (x) and model (bars), one panel per dtype, log y, with that
    dtype's tolerance(s) as dashed lines. Negative controls are left out: they are meant to be
    orders of magnitude off and would flatten every real bar."""
    data = _numeric_values(frame[(frame["metric"] == "max_abs") & ~frame["expected_failure"]])
    if data is None:
        return None
    dtypes = sorted(data["dtype"].unique())
    fig = Figure(figsize=(max(8.0, 1.1 * data["layout"].nunique() + 4), 4.2 * len(dtypes)))
    for k, dtype in enumerate(dtypes):
        ax = fig.add_subplot(len(dtypes), 1, k + 1)
        sub = data[data["dtype"] == dtype]
        table = sub.pivot_table(index="layout", columns="model", values="value", aggfunc="max")
        # Zero (bit-identical) would vanish on a log axis: draw it at a visible floor instead.
        positive = table[table > 0].min().min()
        floor = positive / 10 if pd.notna(positive) else 1e-12
        _bars(ax, table.clip(lower=floor), log=True)
        for tol in sorted(pd.to_numeric(sub["tolerance"], errors="coerce").dropna().unique())[:3]:
            ax.axhline(tol, color="red", linestyle="--", linewidth=1)
            ax.annotate(f"tolerance {tol:g}", (0.995, tol), xycoords=("axes fraction", "data"),
                        ha="right", va="bottom", color="red", fontsize=8)
        ax.set_title(f"max |Δ logprob| vs HF — {dtype or 'no dtype'} (worst per layout/model)")
        ax.set_ylabel("max_abs")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="model")
    fig.tight_layout()
    return figure_png(fig)


MEMORY_UNITS = {"bytes": 1 / 2**30, "b": 1 / 2**30, "mib": 1 / 1024, "gib": 1.0}


def plot_memory(frame: pd.DataFrame) -> bytes | None:
    """(b) memory per phase in GiB: x = phase (extra.phase, else the metric name), bars = layout
    / model. Rows say their unit; bytes and MiB are converted so bars are comparable."""
    units = frame["units"].astype(str).str.lower()
    data = frame[units.isin(list(MEMORY_UNITS))].copy()
    if data.empty:
        return None
    data["gib"] = pd.to_numeric(data["value"], errors="coerce") * units[data.index].map(MEMORY_UNITS)
    data = data.dropna(subset=["gib"])
    if data.empty:
        return None
    data["phase"] = [(e or {}).get("phase") or m for e, m in zip(data["extra"], data["metric"])]
    data["series"] = _series_label(data, ("model", "layout", "dtype"))
    table = data.pivot_table(index="phase", columns="series", values="gib", aggfunc="max")
    table = _cap_columns(table, 10)
    fig = Figure(figsize=(max(8.0, 1.2 * len(table.index) + 4), 4.5))
    ax = fig.add_subplot(1, 1, 1)
    _bars(ax, table, log=False)
    ax.set_title("memory per phase (max over tests)")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return figure_png(fig)


def plot_blocking(frame: pd.DataFrame) -> bytes | None:
    """(c) metrics named *blocking_s* per strategy (extra.strategy, else variant, else layout);
    the median over rows, since single timings on shared machines jitter."""
    data = _numeric_values(frame[frame["metric"].astype(str).str.contains("blocking_s", regex=False)])
    if data is None:
        return None
    data["strategy"] = [(e or {}).get("strategy") or v or l or "?"
                        for e, v, l in zip(data["extra"], data["variant"], data["layout"])]
    table = _cap_columns(data.pivot_table(index="strategy", columns="metric", values="value",
                                          aggfunc="median"), 10)
    fig = Figure(figsize=(max(8.0, 1.2 * len(table.index) + 4), 4.5))
    ax = fig.add_subplot(1, 1, 1)
    _bars(ax, table, log=False)
    ax.set_title("time blocked per strategy (median over rows)")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return figure_png(fig)


def _series_label(data: pd.DataFrame, dims: tuple[str, ...]) -> list[str]:
    return ["/".join(str(v) for v in values if v) or "all"
            for values in zip(*(data[d].astype(str) for d in dims))]


def _cap_columns(table: pd.DataFrame, cap: int) -> pd.DataFrame:
    """Keep the `cap - 1` largest series; fold the rest into one "other (max of N)" column."""
    if len(table.columns) <= cap:
        return table
    keep = table.max().sort_values(ascending=False).index[: cap - 1]
    rest = [c for c in table.columns if c not in keep]
    capped = table[list(keep)].copy()
    capped[f"other (max of {len(rest)})"] = table[rest].max(axis=1)
    return capped


def plots(run: dict[str, Any]) -> list[tuple[str, bytes]]:
    """(title, png) for every plot that has data; an empty list when none has."""
    frame = rows_frame(run["rows"])
    if frame.empty:
        return []
    makers = (("max |Δ logprob| vs HF per layout and model (worst row; negative controls left "
               "out; 0 is drawn at a tenth of the smallest non-zero value)", plot_max_abs), ("memory per phase", plot_memory),
              ("blocking time per strategy", plot_blocking))
    return [(title, png) for title, make in makers if (png := make(frame)) is not None]


# ---------------------------------------------------------------------------------------- writing
def summary_markdown(run: dict[str, Any]) -> str:
    """summary.md's text, shrinking the per-suite caps until it fits MD_LIMIT_BYTES."""
    groups, failures = 100, 50
    while True:
        text = blocks_to_markdown(summary_blocks(run, max_groups=groups, max_failures=failures))
        if len(text.encode("utf-8")) < MD_LIMIT_BYTES or (groups <= 1 and failures <= 1):
            return text
        groups, failures = max(1, groups // 2), max(1, failures // 2)


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
