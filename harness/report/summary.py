"""summary.md's content: the run's status and fingerprint, failures first (tests, then rows over
tolerance), expected failures (negative controls), then one compact table per suite. report.html
shows the same blocks with every group and the plots."""
from __future__ import annotations

from datetime import datetime
from typing import Any

import pandas as pd

from harness.report.blocks import Block, Table, blocks_to_markdown, fmt_value, one_line
from harness.report.results import (EXTRA_DIMS, FAILING_OUTCOMES, OUTCOMES, is_expected_failure,
                                    is_real_failure, rows_frame)
from harness.report.rules import rule_for

MD_LIMIT_BYTES = 60_000  # GitHub rejects step summaries over 1 MiB; this one stays readable
FINGERPRINT_ESSENTIALS = ("python", "torch", "megatron-core", "mbridge", "transformer-engine",
                          "transformers", "cuda", "driver", "gpu", "device", "commit", "host")



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
              one_line(t.get("message"))] for t in failed_tests], max_failures)))
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
                  commit=_commit(fp))
    return Table(list(FINGERPRINT_ESSENTIALS),
                 [[fmt_value(values.get(k)) for k in FINGERPRINT_ESSENTIALS]])


def _commit(fp: dict[str, Any]) -> str | None:
    """The commit as a short sha, "+dirty" when tracked files differed from it."""
    commit = (fp.get("git_commit") or "")[:10] or None
    return f"{commit}+dirty" if commit and fp.get("git_dirty") else commit


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
    dims = [d for d in ("model", "layout", "dtype", "device", "spec", "bridge", "units") + EXTRA_DIMS
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



def summary_markdown(run: dict[str, Any]) -> str:
    """summary.md's text, shrinking the per-suite caps until it fits MD_LIMIT_BYTES."""
    groups, failures = 100, 50
    while True:
        text = blocks_to_markdown(summary_blocks(run, max_groups=groups, max_failures=failures))
        if len(text.encode("utf-8")) < MD_LIMIT_BYTES or (groups <= 1 and failures <= 1):
            return text
        groups, failures = max(1, groups // 2), max(1, failures // 2)
