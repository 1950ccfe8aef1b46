"""Synthetic runs for the report tests (render, compare, trend): rows as the plugin records them,
results.json documents and run directories, and a parser that checks report.html's images."""
from __future__ import annotations

import base64
import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from harness.parity.tolerances import tolerance
from harness.report import Row
from harness.report.claims import of_bound
from harness.report.rows import SCHEMA_VERSION

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METRICS = {"max_abs": 1.9e-6, "mean_abs": 5e-7, "token_mult_prob_error": 1 + 5e-7, "kl_k3": 2e-13,
           "top1_agreement": 1.0}


def nodeid(name: str, params: str) -> str:
    return f"suites/parity/test_parity.py::{name}[{params}]"


def row(test: str, metric: str, value: float, *, passed: bool = True, tolerance: float | None = 1e-5,
        layout: str = "tp1", model: str = "tiny-qwen3", dtype: str = "fp32", device: str = "cpu",
        units: str = "", suite: str = "parity", extra: dict[str, Any] | None = None,
        outcome: str | None = "passed", claim: str | None = None, spec: str = "local") -> dict[str, Any]:
    """A row as the plugin writes it: the real Row dataclass, plus its test's outcome. The claim
    defaults to what its bound says (exact for a bound of 0, timing for a wall time)."""
    claim = claim or ("timing" if metric.endswith("_s") else of_bound(tolerance))
    record = Row(suite=suite, test=test, layout=layout, metric=metric, value=value,
                 tolerance=tolerance, passed=passed, claim=claim, model=model, dtype=dtype, device=device, spec=spec,
                 units=units, extra=dict({"variant": None, "packing": "right"}, **(extra or {}))).as_dict()
    record["outcome"] = outcome
    return record


def parity_rows(models=("tiny-qwen3", "tiny-llama"), layouts=("tp1", "tp2", "pp2"),
                dtypes=("fp32", "bf16"), scale: float = 1.0) -> list[dict[str, Any]]:
    """The parity matrix as the suite records it, each row with its real tolerance (the bound the
    test asserts: compare gives a row part of its room to that bound). The bf16 values are
    rounding noise of two arithmetics, so their bounds are the approximate regime's."""
    rows = []
    for model in models:
        for layout in layouts:
            for dtype in dtypes:
                test = nodeid("test_megatron_logprobs_match_hf", f"cpu-{layout}-{model}-{dtype}")
                for metric, value in METRICS.items():
                    rows.append(row(test, metric, value * (scale if metric != "top1_agreement" else 1),
                                    tolerance=tolerance(metric, dtype, "approximate").limit, layout=layout, model=model,
                                    dtype=dtype))
    return rows


def make_run(rows: list[dict[str, Any]], tests: list[dict[str, Any]] | None = None,
             started: str = "2026-11-21T20:00:00Z", complete: bool = True) -> dict[str, Any]:
    if tests is None:  # one passed test per distinct row test, unless the caller says otherwise
        tests = [{"nodeid": t, "suite": "parity", "outcome": "passed", "duration_s": 0.5, "message": ""}
                 for t in dict.fromkeys(r["test"] for r in rows)]
    return {"schema_version": SCHEMA_VERSION,
            "meta": {"started": started, "finished": "2026-11-21T20:03:30Z", "args": ["suites"],
                     "fingerprint": {"python": "3.11.7", "torch": "2.13.0", "megatron-core": "0.16.1",
                                     "gpus": [], "gpu_count": 0, "git_commit": "a" * 40},
                     "complete": complete},
            "tests": tests, "rows": rows}


def write_run(directory: Path, document: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.json").write_text(json.dumps(document), encoding="utf-8")
    return directory


class _Collector(HTMLParser):
    """Collects <img> sources and checks that table elements open and close in pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[str] = []
        self.depth: dict[str, int] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "img":
            self.images.append(dict(attrs)["src"] or "")
        if tag in ("table", "tr", "td", "th", "figure", "h1", "h2", "h3", "p"):
            self.depth[tag] = self.depth.get(tag, 0) + 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self.depth:
            self.depth[tag] -= 1


def parse_html(path: Path) -> _Collector:
    collector = _Collector()
    collector.feed(path.read_text(encoding="utf-8"))
    collector.close()
    assert all(v == 0 for v in collector.depth.values()), collector.depth
    return collector


def png_images(collector: _Collector) -> list[bytes]:
    prefix = "data:image/png;base64,"
    assert all(src.startswith(prefix) for src in collector.images)
    return [base64.b64decode(src[len(prefix):], validate=True) for src in collector.images]
