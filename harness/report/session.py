"""A run's report directory, kept current while the run goes on.

results.json (schema: harness.report.results) is rewritten atomically after every test, so a run
that is killed still leaves a readable report: tests that never finished stay "unfinished". Under
pytest-xdist every worker keeps its own file under `workers/<id>/`; the controller, which sees
every test's outcome, merges the workers' rows into the run's results.json each time it writes.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from pathlib import Path
from typing import Any, Iterable

from harness.report.packed import resolve
from harness.report.rows import SCHEMA_VERSION, Row, atomic_write
_ROW_FIELDS = {f.name for f in dataclasses.fields(Row)}


def as_row(record: dict[str, Any], suite: str, test: str) -> Row:
    """A recorded dict -> Row: unknown keys go to `extra`; suite/test default to the test's."""
    known = {k: v for k, v in record.items() if k in _ROW_FIELDS}
    extra = {**known.pop("extra", {}), **{k: v for k, v in record.items() if k not in _ROW_FIELDS}}
    known.setdefault("suite", suite)
    known.setdefault("test", test)
    return Row(**known, extra=extra)


def claim_run_dir(directory: Path) -> Path | None:
    """Make `directory` free for a new run; a previous run there (it holds results.json, or a
    committed run's results.json.gz) is moved beside it, to the timestamped name a run gets by
    default, and that path is returned. A non-empty directory that is not a run is refused
    (ValueError): it is not ours to move."""
    directory = Path(directory)
    if not directory.exists() or (directory.is_dir() and not any(directory.iterdir())):
        return None
    results = resolve(directory / "results.json")  # a committed run may hold it packed (.gz)
    if not results.is_file():
        raise ValueError(f"{directory} exists and is not a run directory (no results.json); "
                         "choose another run directory or move it away")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(results.stat().st_mtime))
    moved = directory.with_name(f"{stamp}-{uuid.uuid4().hex[:6]}")
    directory.rename(moved)
    return moved


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class RunReport:
    def __init__(self, directory: Path, *, args: list[str], fingerprint: dict[str, Any] | None = None,
                 worker: str | None = None):
        self.directory = Path(directory)
        self.worker = worker
        self.path = self.directory / ("workers" if worker else "") / (worker or "") / "results.json"
        self.meta: dict[str, Any] = {"started": _now(), "finished": None, "args": list(args),
                                     "fingerprint": fingerprint or {}, "complete": False}
        self.tests: dict[str, dict[str, Any]] = {}
        self.rows: list[Row] = []
        self._row_text: dict[int, tuple[str, str]] = {}  # id(row) -> (outcome, its JSON): _text()

    # ------------------------------------------------------------------ recording
    def collected(self, tests: Iterable[tuple[str, str]]) -> None:
        """Every test the run intends to run, as (nodeid, suite): "unfinished" until reported."""
        for nodeid, suite in tests:
            self.tests.setdefault(nodeid, {"nodeid": nodeid, "suite": suite, "outcome": "unfinished",
                                           "duration_s": 0.0, "message": ""})

    def outcome(self, nodeid: str, suite: str, phase: str, outcome: str, duration: float, message: str) -> None:
        """Fold one phase's report into the test's outcome (setup/call/teardown, as pytest sends)."""
        test = self.tests.setdefault(nodeid, {"nodeid": nodeid, "suite": suite, "outcome": "unfinished",
                                              "duration_s": 0.0, "message": ""})
        test["duration_s"] += duration
        failed = outcome == "failed"
        if phase == "call":
            test["outcome"] = outcome
        elif failed:  # a broken setup or teardown is an error, whatever the call did
            test["outcome"] = "error"
        elif phase == "setup" and outcome == "skipped":
            test["outcome"] = "skipped"
        if failed or (outcome == "skipped" and not test["message"]):
            test["message"] = _clip(message)

    def add_rows(self, rows: Iterable[Row]) -> None:
        self.rows.extend(rows)

    # ------------------------------------------------------------------ writing
    def document(self) -> dict[str, Any]:
        rows = [r.as_dict() for r in self.rows]
        tests = dict(self.tests)
        for worker in self._worker_documents():
            rows += worker["rows"]
            for test in worker["tests"]:  # the controller's own outcome (from xdist) wins
                tests.setdefault(test["nodeid"], test)
        outcomes = {nodeid: t["outcome"] for nodeid, t in tests.items()}
        for row in rows:
            row["outcome"] = outcomes.get(row["test"], "unfinished")
        return {"schema_version": SCHEMA_VERSION, "meta": self.meta, "tests": list(tests.values()),
                "rows": rows}

    def _worker_documents(self) -> list[dict[str, Any]]:
        if self.worker is not None:
            return []
        documents = []
        for path in sorted((self.directory / "workers").glob("*/results.json")):
            try:
                documents.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue  # a killed worker's last complete file is merged; a partial one is not
        return documents

    def flush(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, self._text())
        return self.path

    def _text(self) -> str:
        """document() as JSON, one row per line. Rewritten after every test, so each of this
        process's rows keeps its text until its test's outcome changes: serializing every row
        anew each time took 0.3 s per test late in a 1,750-test run (minutes of a CI run)."""
        workers = self._worker_documents()
        tests = dict(self.tests)
        for worker in workers:
            for test in worker["tests"]:  # the controller's own outcome (from xdist) wins
                tests.setdefault(test["nodeid"], test)
        outcomes = {nodeid: t["outcome"] for nodeid, t in tests.items()}
        lines = []
        for row in self.rows:
            outcome = outcomes.get(row.test, "unfinished")
            cached = self._row_text.get(id(row))
            if cached is None or cached[0] != outcome:
                cached = (outcome, json.dumps({**row.as_dict(), "outcome": outcome}, default=str))
                self._row_text[id(row)] = cached
            lines.append(cached[1])
        for worker in workers:
            lines += [json.dumps({**row, "outcome": outcomes.get(row["test"], "unfinished")}, default=str)
                      for row in worker["rows"]]
        head = json.dumps({"schema_version": SCHEMA_VERSION, "meta": self.meta, "tests": list(tests.values())},
                          indent=1, default=str)
        return head[:-2] + ',\n "rows": [\n' + ",\n".join(lines) + "\n ]\n}"

    def finish(self) -> Path:
        self.meta.update(finished=_now(), complete=True)
        return self.flush()


def _clip(message: str, head: int = 1000, tail: int = 7000) -> str:
    """A failure's text for the report: its start (where) and its end (the error, and the stacks a
    hang report carries), the middle elided."""
    if len(message) <= head + tail:
        return message
    return f"{message[:head]}\n[... {len(message) - head - tail} characters ...]\n{message[-tail:]}"
