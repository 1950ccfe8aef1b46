"""Re-report a device run (ci/gpu_report.py's JSON: environment, tests, rows) as a run directory
in the harness report format (results.json schema v1 + results.csv, summary.md, report.html).

    python ci/rereport_gpu.py reports/gpu/DIR/NAME.json reports/gpu/DIR/NAME-run

NAME.json may be committed packed (NAME.json.gz, harness.report.packed): either path reads it. The run
directory is written plain; `mrh report pack` it before committing.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.report.packed import GZ, is_file, read_json, read_text
from harness.report.render import render_run
from harness.report.rows import SCHEMA_VERSION, atomic_write


def _nodeid(junit_name: str) -> str:
    """JUnit 'suites.parity.test_parity::test_x[cuda-tp2]' -> pytest 'suites/parity/test_parity.py::test_x[cuda-tp2]'."""
    module, _, name = junit_name.partition("::")
    return module.replace(".", "/") + ".py::" + name


def convert(device_report: dict, interrupted: bool) -> dict:
    tests = [{"nodeid": _nodeid(t["test"]), "suite": (_nodeid(t["test"]).split("/") + [""])[1],
              "outcome": t["outcome"], "duration_s": t["time_s"], "message": t["detail"]}
             for t in device_report["tests"]]
    outcome = {t["nodeid"]: t["outcome"] for t in tests}
    rows = [{**row, "outcome": outcome.get(row["test"], "unfinished")} for row in device_report.get("rows", [])]
    environment = device_report["environment"]
    fingerprint = {**environment, "gpu": ", ".join(environment.get("gpus") or []), "device": "cuda"}
    meta = {"started": device_report["started"], "finished": None, "args": device_report["command"].split(),
            "fingerprint": fingerprint, "complete": not interrupted,
            "wall_s": device_report["wall_s"]}
    return {"schema_version": SCHEMA_VERSION, "meta": meta, "tests": tests, "rows": rows}


def main(argv: list[str]) -> int:
    source, target = Path(argv[0]), Path(argv[1])
    target.mkdir(parents=True, exist_ok=True)
    plain = source.with_name(source.name.removesuffix(GZ))  # NAME.json or a packed NAME.json.gz
    log = plain.with_suffix(".log")
    interrupted = is_file(log) and "KeyboardInterrupt" in read_text(log, errors="replace")
    document = convert(read_json(plain), interrupted)
    atomic_write(target / "results.json", json.dumps(document, indent=1))
    render_run(target)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
