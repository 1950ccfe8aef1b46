"""Tests for harness.report.trend: one PNG per metric across runs, an index that embeds them,
series capping, and the CLI."""
from __future__ import annotations

import re
from pathlib import Path

from harness.report.trend import MAX_SERIES, main_trend, trend
from suites.report.runs import PNG_MAGIC, make_run, nodeid, parity_rows, parse_html, png_images, row, write_run


def three_runs(tmp_path: Path) -> list[Path]:
    """Three runs given out of order: the trend must sort them by meta.started."""
    runs = []
    for name, started, scale in (("c", "2026-11-23T10:00:00Z", 3.0), ("a", "2026-11-21T10:00:00Z", 1.0),
                                 ("b", "2026-11-22T10:00:00Z", 2.0)):
        rows = parity_rows(scale=scale)
        rows.append(row(nodeid("test_step", "cpu"), "step_s", 0.5 * scale, tolerance=None, suite="bench"))
        runs.append(write_run(tmp_path / name, make_run(rows, started=started)))
    return runs


def test_one_png_per_metric_and_an_index(tmp_path: Path) -> None:
    out = tmp_path / "trend"
    index = trend(three_runs(tmp_path), out)
    assert index == out / "index.html"
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["kl_k3.png", "max_abs.png", "mean_abs.png", "step_s.png", "token_mult_prob_error.png",
                    "top1_agreement.png"]
    assert all((out / p).read_bytes().startswith(PNG_MAGIC) for p in pngs)
    embedded = png_images(parse_html(index))
    assert len(embedded) == len(pngs)
    assert set(embedded) == {(out / p).read_bytes() for p in pngs}
    text = index.read_text()
    listed = [text.index(f"<code>{tmp_path / n / 'results.json'}</code>") for n in ("a", "b", "c")]
    assert listed == sorted(listed)  # run order = start time, not argument order


def test_series_beyond_the_cap_are_folded_and_named(tmp_path: Path) -> None:
    models = [f"model-{i:02d}" for i in range(MAX_SERIES + 4)]
    runs = [write_run(tmp_path / str(i), make_run(parity_rows(models=models, layouts=("tp1",), dtypes=("fp32",),
                                                              scale=1 + i), started=f"2026-11-2{i}T00:00:00Z"))
            for i in range(2)]
    text = trend(runs, tmp_path / "out").read_text()
    n_folded = len(models) - (MAX_SERIES - 1)
    folded = re.search(r"Folded into “others” \((\d+) series\)</summary><p>([^<]*)</p>", text)
    assert folded and int(folded.group(1)) == n_folded and len(folded.group(2).split(", ")) == n_folded


def test_odd_metric_names_get_safe_distinct_files(tmp_path: Path) -> None:
    rows = [row(nodeid("t", "cpu"), "a/b", 1.0), row(nodeid("t", "cpu"), "a b", 2.0)]
    out = tmp_path / "out"
    trend([write_run(tmp_path / "r", make_run(rows))], out)
    assert sorted(p.name for p in out.glob("*.png")) == ["a_b-2.png", "a_b.png"]


def test_cli(tmp_path: Path, capsys) -> None:
    runs = three_runs(tmp_path)
    out = tmp_path / "cli-out"
    assert main_trend([*map(str, runs), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out / "index.html")
    assert main_trend([str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main_trend([]) == 2  # at least one run is required
