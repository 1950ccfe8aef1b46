"""Report rows: every comparison a suite makes becomes a row (suite, test, layout, metric, value,
tolerance, pass), collected in the parent and written as JSON and CSV."""
from harness.report.rows import Recorder, Row

__all__ = ["Recorder", "Row"]
