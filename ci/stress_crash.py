#!/usr/bin/env python3
"""Crash injection under CPU load, repeated: does any crash check or rotation variant flake?

Runs the CI crash slice (suites/checkpoint/test_crash_safety.py without its nightly matrix, the
fault-point tests, the rotation tests that hold writes in flight) and every rotation variant of the
catalog (suites/sensitivity/test_variants.py, fp32 and bf16) REPEATS times, each repetition a fresh
pytest session (no cached trial), while LOAD busy processes per core compete for the CPU. Every test
must pass every time: a fault point is reached for certain whatever the machine's speed
(harness.checkpoint.faults), so a failure here is a flake, i.e. a false claim.

    .venv/bin/python ci/stress_crash.py --repeats 20 --load 1 --out reports/stress/<date>-crash-cpu

Writes OUT/results.json (machine fingerprint, settings, per-test counts, every repetition's
failures) and OUT/README.md (the table), progress on stderr; exit 0 with 0 flakes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLICES = [
    ["suites/checkpoint/test_crash_safety.py", "suites/checkpoint/test_faults.py",
     "suites/checkpoint/test_rotation.py"],
    # every rotation variant, both dtypes (bf16 is nightly in CI; its selection needs --mrh-nightly)
    ["suites/sensitivity/test_variants.py", "--mrh-nightly", "-k",
     "tracker-at-schedule or delete-before-finalize or keep1-deletes-first or async-tracker-never-written "
     "or tracker-in-place or overlapping-async-saves or resume-trusts-tracker"],
]


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _session(args: list[str], run_dir: Path) -> dict:
    """One pytest session; its run report's tests (outcome per nodeid)."""
    cmd = [sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider", f"--mrh-run-dir={run_dir}"]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    tests = json.loads((run_dir / "results.json").read_text())["tests"] if (run_dir / "results.json").is_file() else []
    return {"exit": done.returncode, "seconds": round(time.monotonic() - started, 1),
            "tests": {t["nodeid"]: (t["outcome"], t.get("message", "")[-20000:]) for t in tests},
            "tail": done.stdout[-2000:]}


def _write_report(args, counts, failures, sessions, busy: int, started: float, *, done: bool) -> int:
    """OUT/results.json and OUT/README.md as they stand (rewritten after every session, atomically:
    a stopped run keeps what it did); returns the flakes so far."""
    from harness.report.fingerprint import environment_fingerprint

    flakes = len(failures)
    repeats_done = len({s["repeat"] for s in sessions if s["slice"] == len(SLICES) - 1})
    document = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "repeats": args.repeats,
                "repeats_done": repeats_done, "complete": done, "load_per_core": args.load,
                "busy_processes": busy, "slices": SLICES,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
                "hours": round((time.time() - started) / 3600, 2),
                "fingerprint": environment_fingerprint(), "flakes": flakes,
                "tests": {n: dict(c) for n, c in sorted(counts.items())}, "failures": failures, "sessions": sessions}
    fp = document["fingerprint"]
    status = "" if done else f" (stopped or running: {repeats_done} of {args.repeats} repetitions done)"
    lines = [f"# Crash injection under load: {flakes} flakes in {repeats_done} repetitions{status}", "",
             f"`{document['command']}` at {fp.get('git_commit', '?')[:12]}{' (dirty)' if fp.get('git_dirty') else ''}, "
             f"{document['started']}, {document['hours']} h; {fp.get('cpu_model')} ({fp.get('cpu_count')} cores, "
             f"{', '.join(fp.get('cpu_flags') or [])}), {busy} busy processes competing; torch {fp.get('torch')}, "
             f"megatron-core {fp.get('megatron-core')}.", "",
             "| test | passed | failed/error |", "|---|---|---|"]
    for nodeid, c in sorted(counts.items()):
        lines.append(f"| `{nodeid}` | {c['passed']} | {sum(v for k, v in c.items() if k != 'passed')} |")
    if failures:
        lines += ["", "## Failures", ""] + [f"- repeat {f['repeat']}: `{f['nodeid']}` {f['outcome']}: "
                                            f"{f['message'][-600:]}" for f in failures]
    _write_atomically(args.out / "results.json", json.dumps(document, indent=1, default=str) + "\n")
    _write_atomically(args.out / "README.md", "\n".join(lines) + "\n")
    return flakes


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--load", type=int, default=1, help="busy processes per core (default 1)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))

    args.out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, Counter] = defaultdict(Counter)
    failures, sessions = [], []
    busy = _busy(args.load * (os.cpu_count() or 1))
    started = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="mrh-stress-") as tmp:
            for rep in range(args.repeats):
                for index, slice_args in enumerate(SLICES):
                    result = _session(slice_args, Path(tmp) / f"r{rep}-s{index}")
                    sessions.append({"repeat": rep, "slice": index, "exit": result["exit"], "seconds": result["seconds"]})
                    if not result["tests"]:
                        failures.append({"repeat": rep, "nodeid": f"<slice {index} session>", "outcome": "no report",
                                         "message": result["tail"]})
                    for nodeid, (outcome, message) in result["tests"].items():
                        counts[nodeid][outcome] += 1
                        if outcome != "passed":
                            failures.append({"repeat": rep, "nodeid": nodeid, "outcome": outcome, "message": message})
                    _write_report(args, counts, failures, sessions, len(busy), started, done=False)
                    print(f"repeat {rep + 1}/{args.repeats} slice {index}: {len(result['tests'])} tests, exit "
                          f"{result['exit']}, {result['seconds']} s, failures so far {len(failures)}", file=sys.stderr)
    finally:
        for proc in busy:
            proc.kill()
    flakes = _write_report(args, counts, failures, sessions, len(busy), started, done=True)
    print(f"{flakes} flakes; {args.out}/README.md", file=sys.stderr)
    return 1 if flakes else 0


if __name__ == "__main__":
    raise SystemExit(main())
