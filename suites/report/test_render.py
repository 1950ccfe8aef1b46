"""Tests for harness.report.render (and fingerprint): a results.json round trip through the
renderers, on synthetic rows and on the rows of a real GPU run. No processes, no GPUs."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness.report import Row, packed
from harness.report.blocks import fmt_value
from harness.report.fingerprint import environment_fingerprint
from harness.report.render import render_run, write_csv, write_html, write_summary_md
from harness.report.results import load_run
from harness.report.rows import SCHEMA_VERSION, atomic_write
from harness.report.summary import MD_LIMIT_BYTES
from suites.report.runs import PNG_MAGIC, make_run, nodeid, parity_rows, parse_html, png_images, row, write_run

REPO = Path(__file__).resolve().parents[2]
GPU_REPORT = REPO / "reports/gpu/2026-11-21-parity-h200x4/parity-2gpu.json"  # committed packed (.json.gz)


FAILED_TEST = nodeid("test_megatron_logprobs_match_hf", "cpu-tp2-tiny-qwen2-bf16")
ERROR_TEST = nodeid("test_megatron_logprobs_match_hf", "cpu-pp2-tiny-qwen2-bf16")
NEGATIVE = nodeid("test_negative_control_fails_parity", "cpu-swapped-gate-up")


def mixed_run() -> dict[str, Any]:
    """Passing matrix + a failing test with a failing row + an erroring and a skipped test + a
    negative control + one memory and one blocking-time row."""
    rows = parity_rows()
    rows.append(row(FAILED_TEST, "max_abs", 0.7, passed=False, tolerance=0.4, layout="tp2",
                    model="tiny-qwen2", dtype="bf16", outcome="failed"))
    rows.append(row(FAILED_TEST, "mean_abs", 0.01, tolerance=0.09, layout="tp2", model="tiny-qwen2",
                    dtype="bf16", outcome="failed"))
    rows.append(row(NEGATIVE, "max_abs", 2.0, passed=False, layout="tp2",
                    extra={"variant": "swapped-gate-up"}))
    rows.append(row(nodeid("test_memory", "cpu-tp2"), "peak_bytes", 3 * 2**30, tolerance=None,
                    layout="tp2", units="bytes", suite="memory", extra={"phase": "forward"}))
    rows.append(row(nodeid("test_sync", "cpu-nccl"), "weight_sync_blocking_s", 0.25, tolerance=None,
                    layout="tp2", units="s", suite="sync", extra={"strategy": "broadcast"}))
    run = make_run(rows)
    run["tests"] = [t for t in run["tests"] if t["nodeid"] != FAILED_TEST]
    run["tests"] += [
        {"nodeid": FAILED_TEST, "suite": "parity", "outcome": "failed", "duration_s": 2.0,
         "message": "AssertionError: max_abs 0.7 > 0.4\nsecond line | with a pipe"},
        {"nodeid": ERROR_TEST, "suite": "parity", "outcome": "error", "duration_s": 0.1,
         "message": "RuntimeError: NCCL Error 1"},
        {"nodeid": nodeid("test_megatron_logprobs_match_hf", "cpu-tp4-tiny-qwen2-bf16"),
         "suite": "parity", "outcome": "skipped", "duration_s": 0.0, "message": "needs 4 ranks"},
    ]
    return run


# --------------------------------------------------------------------------------------- summary
def test_summary_lists_failures_first_with_counts(tmp_path: Path) -> None:
    path = write_summary_md(write_run(tmp_path / "run", mixed_run()))
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# megatron-rl-harness run: FAILED")
    assert "**Tests:** 18 (15 passed · 1 failed · 1 error · 1 skipped · 0 unfinished)" in text
    assert "**Rows:** 65 (1 failing, 1 over tolerance in passing tests" in text
    failures = text.index("## Failures (2 tests, 1 row)")
    # the failed and the erroring test, and the failing row with value vs tolerance, come before
    # the negative control and every per-suite table
    assert failures < text.index(FAILED_TEST) < text.index("## Expected") < text.index("## Suite parity")
    assert failures < text.index(ERROR_TEST) < text.index("## Suite")
    failing_row = next(l for l in text.splitlines() if l.startswith(f"| {FAILED_TEST} | tp2"))
    assert "| max_abs | 0.7 | 0.4 | failed |" in failing_row
    assert "second line \\| with a pipe" in text  # one line per message, pipes escaped
    # negative control: listed as expected, not as a failure
    assert text.index(NEGATIVE) > text.index("## Expected")
    # per-suite table: one line per (model, layout, dtype), worst value per metric
    assert "| tiny-qwen3 | tp2 | fp32 |" in text and "1+5e-07" in text
    assert "## Suite memory" in text and "## Suite sync" in text
    assert len(text.encode()) < MD_LIMIT_BYTES


def test_summary_of_a_clean_run_says_passed(tmp_path: Path) -> None:
    text = write_summary_md(write_run(tmp_path, make_run(parity_rows()))).read_text()
    assert text.startswith("# megatron-rl-harness run: PASSED")
    assert "## Failures (0 tests, 0 rows)\n\nNone." in text
    incomplete = make_run(parity_rows(), complete=False)
    assert write_summary_md(write_run(tmp_path / "i", incomplete)).read_text().startswith(
        "# megatron-rl-harness run: INCOMPLETE")


def test_summary_stays_short_for_a_huge_run(tmp_path: Path) -> None:
    models = [f"model-{i}" for i in range(30)]
    layouts = [f"tp{i}" for i in range(1, 11)]
    rows = parity_rows(models=models, layouts=layouts)  # 600 groups, 3000 rows
    rows += [dict(r, passed=False, outcome="failed") for r in rows[:400]]
    text = write_summary_md(write_run(tmp_path, make_run(rows))).read_text()
    assert len(text.encode()) < MD_LIMIT_BYTES
    assert "more (see report.html / results.csv)" in text


# ------------------------------------------------------------------------------------------ html
def test_report_html_embeds_the_plots_as_png(tmp_path: Path) -> None:
    path = write_html(write_run(tmp_path, mixed_run()))
    assert path.name == "report.html"
    collector = parse_html(path)
    images = png_images(collector)
    assert len(images) == 3  # max |Δ| per layout/model, memory per phase, blocking per strategy
    assert all(image.startswith(PNG_MAGIC) and len(image) > 5000 for image in images)
    html_text = path.read_text()
    assert FAILED_TEST in html_text and "class='fail'" in html_text
    assert html_text.index("Failures") < html_text.index("<img") < html_text.index("Suite parity")


def test_report_html_skips_plots_without_data(tmp_path: Path) -> None:
    only_other = [row(nodeid("test_x", "cpu"), "something", 3.0, suite="other")]
    collector = parse_html(write_html(write_run(tmp_path / "a", make_run(only_other))))
    assert collector.images == []
    empty = write_html(write_run(tmp_path / "b", make_run([])))
    assert parse_html(empty).images == []
    no_memory = [r for r in mixed_run()["rows"] if r["suite"] == "parity"]
    assert len(parse_html(write_html(write_run(tmp_path / "c", make_run(no_memory)))).images) == 1


def test_missing_and_nan_values_render(tmp_path: Path) -> None:
    test = nodeid("test_megatron_logprobs_match_hf", "cpu-tp1-tiny-qwen3-fp32")
    rows = [row(test, "max_abs", None, passed=False, outcome="failed"),  # type: ignore[arg-type]
            row(test, "mean_abs", float("nan"), passed=False, outcome="failed"),
            row(test, "peak_bytes", None, units="bytes")]  # type: ignore[arg-type]
    written = render_run(write_run(tmp_path, make_run(rows)))
    text = written["summary"].read_text()
    assert "| max_abs | — | 1e-05 | failed |" in text and "| mean_abs | nan | 1e-05 | failed |" in text
    parse_html(written["html"])


# ------------------------------------------------------------------------------------------- csv
def test_csv_has_one_line_per_row(tmp_path: Path) -> None:
    run = mixed_run()
    path = write_csv(write_run(tmp_path, run))
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(run["rows"]) + 1
    frame = pd.read_csv(path)
    assert len(frame) == len(run["rows"])
    assert {"suite", "test", "metric", "value", "tolerance", "passed", "outcome", "extra"} <= set(frame.columns)
    extras = [json.loads(e) for e in frame["extra"]]
    assert extras[-1] == {"packing": "right", "strategy": "broadcast", "variant": None}
    assert frame["value"].tolist() == pytest.approx([r["value"] for r in run["rows"]])


# ------------------------------------------------------------------------------- load and writes
def test_load_run_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"results\.json.*no such file"):
        load_run(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON document"):
        load_run(bad)
    future = write_run(tmp_path / "future", dict(make_run([]), schema_version=3))
    with pytest.raises(ValueError, match="schema_version 3 is unknown; this code reads schema_version 1 and 2"):
        load_run(future)
    (bad / "results.json").write_text(json.dumps({"schema_version": 1}))
    with pytest.raises(ValueError, match="no 'rows' key"):
        load_run(bad / "results.json")


def test_minimal_document_renders(tmp_path: Path) -> None:
    """A results.json with rows only (no tests, no meta fields) still renders."""
    row = Row(suite="parity", test="t::a[x]", layout="tp1", metric="max_abs", value=1e-6,
              tolerance=1e-5, passed=True, claim="bounded", model="m", dtype="fp32")
    atomic_write(tmp_path / "results.json", json.dumps({"schema_version": SCHEMA_VERSION,
                                                        "meta": {"args": ["suites"]}, "rows": [row.as_dict()]}))
    run = load_run(tmp_path)
    assert run["rows"][0]["outcome"] is None and run["tests"] == []
    written = render_run(tmp_path)
    assert {p.name for p in written.values()} == {"summary.md", "report.html", "results.csv"}
    assert "Tests:** 0 (not recorded)" in written["summary"].read_text()
    # no temp files left behind by the atomic writes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "results.csv",
                                                          "results.json", "summary.md"]


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path: Path) -> None:
    target = atomic_write(tmp_path / "summary.md", "old")
    with pytest.raises(TypeError):
        atomic_write(target, 12345)  # type: ignore[arg-type]  # not str/bytes: fails mid-write
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.md"]
    assert oct(target.stat().st_mode & 0o777) == "0o644"


def test_fmt_value() -> None:
    assert fmt_value(1.0000005) == "1+5e-07"
    assert fmt_value(1 + 1e-5) == "1+1e-05"
    assert fmt_value(1.0) == "1" and fmt_value(1e-5) == "1e-05" and fmt_value(0.98947) == "0.989"
    assert fmt_value(float("nan")) == "nan" and fmt_value(None) == "—" and fmt_value(True) == "yes"


# ------------------------------------------------------------------------------ real GPU report
def gpu_report_as_run(path: Path) -> dict[str, Any]:
    """The hand-assembled GPU report (reports/gpu/...) in schema 1: its tests use dotted module
    ids (suites.parity.test_parity::x) where rows use nodeids (suites/parity/test_parity.py::x)."""
    doc = packed.read_json(path)
    tests = []
    for t in doc["tests"]:
        module, _, name = t["test"].partition("::")
        if module == "None":  # a session-level record, not a test
            continue
        tests.append({"nodeid": module.replace(".", "/") + ".py::" + name, "suite": module.split(".")[1],
                      "outcome": t["outcome"], "duration_s": t["time_s"], "message": t["detail"]})
    outcomes = {t["nodeid"]: t["outcome"] for t in tests}
    return {"schema_version": 1,
            "meta": {"started": doc["started"], "finished": None, "args": doc["command"].split(),
                     "fingerprint": doc["environment"], "complete": True},
            "tests": tests, "rows": [dict(r, outcome=outcomes.get(r["test"])) for r in doc["rows"]]}


@pytest.mark.skipif(not packed.is_file(GPU_REPORT), reason="real GPU report not in this checkout")
def test_real_gpu_report_renders(tmp_path: Path) -> None:
    run = gpu_report_as_run(GPU_REPORT)
    written = render_run(write_run(tmp_path, run))
    text = written["summary"].read_text()
    assert text.startswith("# megatron-rl-harness run: PASSED")
    assert "**Tests:** 101 (101 passed" in text and "**Rows:** 530 (0 failing, 25 over" in text
    assert "| 3.12.3 | 2.11.0+cu130 | 0.16.1 | 0.15.1 |" in text
    assert "## Expected: 25 rows" in text and "... " not in text  # all 94 groups fit
    assert len(text.encode()) < MD_LIMIT_BYTES
    assert len(png_images(parse_html(written["html"]))) == 1  # parity only: the max |Δ| chart
    assert len(written["csv"].read_text().splitlines()) == 531


# ---------------------------------------------------------------------------------- fingerprint
def test_fingerprint_is_complete_fast_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    start = time.perf_counter()
    fp = environment_fingerprint("cpu")
    assert time.perf_counter() - start < 1.0
    assert {"python", "torch", "megatron-core", "mbridge", "transformer-engine", "transformers", "cuda",
            "driver", "gpus", "gpu_count", "device", "git_commit", "git_dirty", "host", "platform"} <= set(fp)
    assert fp["device"] == "cpu" and fp["python"].count(".") == 2 and fp["torch"]
    assert fp["git_commit"] == "unknown" or len(fp["git_commit"]) == 40
    json.dumps(fp)  # JSON-able as is
    monkeypatch.setenv("PATH", "")  # no git, no nvidia-smi
    monkeypatch.delenv("MRH_GIT_COMMIT", raising=False)
    monkeypatch.chdir("/")
    bare = environment_fingerprint()
    assert bare["git_commit"] == "unknown" and bare["driver"] is None and bare["gpus"] == []
    assert bare["device"] is None
