"""The report row and the recorder that collects and writes rows."""
from __future__ import annotations

import csv
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

SCHEMA_VERSION = 1
COLUMNS = ("suite", "test", "layout", "model", "dtype", "device", "metric", "value", "tolerance",
           "passed", "units", "extra")


@dataclass
class Row:
    suite: str
    test: str
    layout: str
    metric: str
    value: float
    tolerance: float | None
    passed: bool
    model: str = ""
    dtype: str = ""
    device: str = ""
    units: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Recorder:
    """Collects rows in the parent process; `write(directory)` stores results.json and .csv."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def extend(self, rows: Iterable[Row]) -> None:
        self.rows.extend(rows)

    def write(self, directory: str | os.PathLike, meta: dict[str, Any] | None = None) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        document = {"schema_version": SCHEMA_VERSION, "meta": meta or {},
                    "rows": [r.as_dict() for r in self.rows]}
        _atomic_write(directory / "results.json", json.dumps(document, indent=1, default=str))
        _atomic_write(directory / "results.csv", _csv(self.rows))
        return directory


def _csv(rows: list[Row]) -> str:
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS)
    writer.writeheader()
    for row in rows:
        record = row.as_dict()
        record["extra"] = json.dumps(record["extra"], default=str) if record["extra"] else ""
        writer.writerow(record)
    return buffer.getvalue()


def _atomic_write(path: Path, text: str) -> None:
    """Write to a temporary file in the same directory, then rename: never a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
