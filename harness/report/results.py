"""A run's results.json: the schema, loading it (with a clear error for the wrong file), and the row
classifications every report shares.

Schema of `results.json`, version 2 (SCHEMA_VERSION; version 1 files, whose rows had no claim,
still load: the claim is inferred, harness.report.claims.infer_legacy)::

    {
      "schema_version": 2,
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
        {"suite", "test", "layout", "metric", "value", "tolerance", "passed",
         "claim",                                 # harness.report.claims: exact | bounded | control | timing | observed
         "model", "dtype", "device", "spec",      # spec: the layer spec (te, local), "" where none
         "bridge",                                # mbridge | megatron-bridge (older files: from the fingerprint)
         "units", "extra": {...},
         "outcome": "passed"}                     # ... plus the outcome of the row's test
      ]
    }

A committed run's results.json may be stored packed, as results.json.gz (harness.report.packed,
`mrh report pack`): every path here names `results.json`, and the packed form is read when the plain
file is absent.

`meta.*` fields, `tests` and a row's `outcome` are optional on read (results.json files written by
Recorder before the plugin recorded them still load): a missing row outcome is looked up in `tests`
by nodeid, else None. `rows[].test` is the pytest nodeid of the test that produced the row.

A row with passed == False whose test passed is an *expected* failure: a negative control asserts
that a broken model does NOT match, so its rows are over tolerance by design. Reports list those
apart from real failures, and plots of the parity matrix leave them out.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from harness.report.claims import infer_legacy
from harness.report.packed import read_json, resolve
from harness.report.rows import READABLE_VERSIONS

RESULTS = "results.json"
OUTCOMES = ("passed", "failed", "error", "skipped", "unfinished")
FAILING_OUTCOMES = ("failed", "error", "unfinished")
ROW_COLUMNS = ("suite", "test", "layout", "model", "dtype", "device", "spec", "bridge", "metric", "value", "tolerance",
               "passed", "claim", "units", "outcome", "extra")
# Keys of `extra` that identify a row (compare.py keys on them too), shown as table dimensions.
EXTRA_DIMS = ("variant", "packing")


def results_path(run: str | os.PathLike) -> Path:
    """A run directory, a results.json path or a results.json.gz path -> the file that holds the
    run: results.json, else its packed form results.json.gz (the plain path when neither exists)."""
    path = Path(run)
    return resolve(path / RESULTS if path.is_dir() else path)


def load_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and normalise a run's results.json (a run directory or the file itself, plain or packed).

    Raises ValueError with the path and the reason when the file is missing, is not JSON, or has a
    schema_version this code does not know: a report of the wrong shape must not render as empty.
    """
    path = results_path(run_dir)
    if not path.is_file():
        raise ValueError(f"{path}: no such file (expected a run directory holding {RESULTS} or {RESULTS}.gz, "
                         f"or the path of one)")
    try:
        document = read_json(path)  # ValueError naming the file: corrupt .gz, not JSON
    except OSError as e:
        raise ValueError(f"{path}: not a readable JSON document ({e})") from e
    return normalise_run(document, source=str(path))


def normalise_run(document: Any, source: str = "<dict>") -> dict[str, Any]:
    """Check the schema version and fill optional fields, so renderers never test for absence."""
    if not isinstance(document, dict) or "rows" not in document:
        raise ValueError(f"{source}: not a harness results document (no 'rows' key)")
    version = document.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"{source}: schema_version {version!r} is unknown; this code reads "
                         f"schema_version {' and '.join(map(str, READABLE_VERSIONS))}")
    meta = dict(document.get("meta") or {})
    meta.setdefault("started", None)
    meta.setdefault("finished", None)
    meta.setdefault("args", [])
    meta.setdefault("fingerprint", {})
    meta.setdefault("complete", None)  # None: an older file that did not say
    tests = [dict(t) for t in document.get("tests") or []]
    outcome_of = {t.get("nodeid"): t.get("outcome") for t in tests}
    bridge = run_bridge(meta["fingerprint"])
    rows = []
    for row in document["rows"]:
        row = dict(row)
        row["extra"] = dict(row.get("extra") or {})
        row.setdefault("outcome", outcome_of.get(row.get("test")))
        for key in ("layout", "model", "dtype", "device", "spec", "units"):
            row[key] = row.get(key) or ""
        row["bridge"] = row.get("bridge") or bridge
        if not row.get("claim"):
            row["claim"] = infer_legacy(row)
        rows.append(row)
    return {"schema_version": version, "meta": meta, "tests": tests, "rows": rows,
            "source": source}


def run_bridge(fingerprint: dict[str, Any]) -> str:
    """The bridge of a run whose rows do not name it (written before the column existed): the one
    bridge its fingerprint lists, else "" (such runs all ran mbridge, the only bridge there was)."""
    found = [name for name in ("mbridge", "megatron-bridge") if fingerprint.get(name)]
    return found[0] if len(found) == 1 else ""


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
