"""The report row, the results schema version, and the atomic write every report file uses."""
from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2  # of results.json; its layout is documented in harness.report.results
READABLE_VERSIONS = (1, 2)  # 1: rows without a claim (inferred on read: claims.infer_legacy)


@dataclass
class Row:
    """One comparison: (suite, test, layout, metric, value, tolerance, passed), the kind of claim it
    makes (harness.report.claims: exact, bounded, control, timing, observed), and where it ran."""

    suite: str
    test: str
    layout: str
    metric: str
    value: float
    tolerance: float | None
    passed: bool
    claim: str
    model: str = ""
    dtype: str = ""
    device: str = ""
    spec: str = ""  # the layer spec the model ran on (te, local; harness.bridge.specs); "" if none
    bridge: str = ""  # the run's bridge (mbridge, megatron-bridge; harness.bridge.backends): its megatron-core line
    units: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from harness.report.claims import check

        check(self.claim)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def atomic_write(path: str | os.PathLike, data: str | bytes) -> Path:
    """Temp file in the same directory, then os.replace: readers never see a half-written file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; reports are read by CI uploaders and people
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
