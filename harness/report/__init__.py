"""Report rows: every comparison a suite makes becomes a row (suite, test, layout, metric, value,
tolerance, pass), collected in the parent and written as JSON and CSV."""
from harness.report.buffer import record_row
from harness.report.rows import SCHEMA_VERSION, Row, atomic_write

__all__ = ["Row", "SCHEMA_VERSION", "atomic_write", "record_row"]
