"""Rows recorded anywhere: in the test process or inside a rank process.

`record_row` appends to this process's buffer. A rank's buffer travels back with the reply of the
call that recorded it (harness.launch) and lands in the parent's buffer, where the pytest plugin
drains it after each test and fills in the test's suite and name.
"""
from __future__ import annotations

from typing import Any

_buffer: list[dict[str, Any]] = []


def record_row(metric: str, value: float, *, tolerance: float | None, passed: bool, claim: str,
               layout: str = "", **fields: Any) -> None:
    """Record one comparison and the kind of claim it makes (harness.report.claims); suite and
    test are filled in by the test process."""
    from harness.report.claims import check

    _buffer.append({"metric": metric, "value": float(value), "tolerance": tolerance,
                    "passed": bool(passed), "claim": check(claim), "layout": layout, **fields})


def extend(rows: list[dict[str, Any]]) -> None:
    _buffer.extend(rows)


def drain() -> list[dict[str, Any]]:
    """Every row recorded since the last drain, oldest first."""
    rows = list(_buffer)
    _buffer.clear()
    return rows
