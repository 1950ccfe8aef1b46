#!/usr/bin/env python3
"""Crash injection under CPU load, repeated: does any crash check or rotation variant flake?

Runs the CI crash slice (suites/checkpoint/test_crash_safety.py without its nightly matrix, the
fault-point tests, the rotation tests that hold writes in flight) and every rotation variant of the
catalog (suites/sensitivity/test_variants.py, fp32 and bf16) REPEATS times, each repetition a fresh
pytest session (no cached trial), while LOAD busy processes per core compete for the CPU. Every test
must pass every time: a fault point is reached for certain whatever the machine's speed
(harness.checkpoint.faults), so a failure here is a flake, i.e. a false claim.

    .venv/bin/python ci/stress_crash.py --repeats 20 --load 1 --out reports/stress/<date>-crash-cpu

Writes OUT/results.json (machine fingerprint, settings, per-test counts, every session's failures
with the failing test's full report: a hung trial carries its processes' stacks) and OUT/README.md
(the table), rewritten after every session, progress on stderr; exit 0 with 0 flakes, 1 otherwise.
`--parallel N` runs N sessions at once (a machine with many cores; they load each other too);
`--time-limit S` starts no session after S seconds (a bounded run, e.g. on a lent machine);
`--slice I` runs only slice I. Under `taskset -c A,B` the run, its busy processes and its sessions
share those cores only: several such runs on a big machine are several small CI machines.
`--merge A B ... --out C` adds up runs made on several machines into one report, each machine's
fingerprint kept.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
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


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Tally:
    """Per-test outcome counts, failures and sessions, as one run or the sum of several."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.failures: list[dict] = []
        self.sessions: list[dict] = []
        self.runs: list[dict] = []  # each run's settings and machine

    def add_session(self, rep: int, index: int, result: dict) -> None:
        self.sessions.append({"repeat": rep, "slice": index, "exit": result["exit"], "seconds": result["seconds"]})
        if not result["tests"]:
            self.failures.append({"repeat": rep, "nodeid": f"<slice {index} session>", "outcome": "no report",
                                  "message": result["tail"]})
        for nodeid, (outcome, message) in result["tests"].items():
            self.counts[nodeid][outcome] += 1
            if outcome != "passed":
                self.failures.append({"repeat": rep, "nodeid": nodeid, "outcome": outcome, "message": message})

    def add_document(self, document: dict) -> None:
        for nodeid, counts in document["tests"].items():
            self.counts[nodeid].update(counts)
        self.failures += document["failures"]
        self.sessions += document["sessions"]
        self.runs += document.get("runs") or [_run_of(document)]


def _run_of(document: dict) -> dict:
    return {k: document.get(k) for k in ("command", "started", "hours", "load_per_core", "busy_processes",
                                        "parallel", "fingerprint")}


def _write_report(out: Path, tally: Tally, run: dict, *, done: bool) -> int:
    """OUT/results.json and OUT/README.md as they stand (atomically: a stopped run keeps what it
    did); returns the flakes so far."""
    flakes = len(tally.failures)
    per_case = min((sum(c.values()) for c in tally.counts.values()), default=0)
    document = {**run, "runs": tally.runs or [run], "slices": SLICES, "complete": done, "flakes": flakes,
                "repetitions_per_case": per_case,
                "tests": {n: dict(c) for n, c in sorted(tally.counts.items())},
                "failures": tally.failures, "sessions": tally.sessions}
    status = "" if done else " (stopped or still running)"
    lines = [f"# Crash injection under load: {flakes} flakes, at least {per_case} repetitions per case{status}", ""]
    for r in document["runs"]:
        fp = r.get("fingerprint") or {}
        lines.append(f"- `{r.get('command')}` at {str(fp.get('git_commit', '?'))[:12]}"
                     f"{' (dirty)' if fp.get('git_dirty') else ''}, {r.get('started')}, {r.get('hours')} h; "
                     f"{fp.get('cpu_model')} ({fp.get('cpu_count')} cores, {', '.join(fp.get('cpu_flags') or [])}), "
                     f"{r.get('busy_processes')} busy processes competing, {r.get('parallel') or 1} session(s) at once; "
                     f"python {fp.get('python')}, torch {fp.get('torch')}, megatron-core {fp.get('megatron-core')}.")
    lines += ["", "| test | passed | failed/error |", "|---|---|---|"]
    for nodeid, c in sorted(tally.counts.items()):
        lines.append(f"| `{nodeid}` | {c['passed']} | {sum(v for k, v in c.items() if k != 'passed')} |")
    if tally.failures:
        lines += ["", "## Failures", ""] + [f"- repeat {f['repeat']}: `{f['nodeid']}` {f['outcome']}: "
                                            f"{' '.join(f['message'][-600:].split())}" for f in tally.failures]
    out.mkdir(parents=True, exist_ok=True)
    _write_atomically(out / "results.json", json.dumps(document, indent=1, default=str) + "\n")
    _write_atomically(out / "README.md", "\n".join(lines) + "\n")
    return flakes


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _merge(inputs: list[Path], out: Path) -> int:
    sys.path.insert(0, str(REPO))
    from harness.report.packed import read_json, resolve

    tally = Tally()
    for path in inputs:
        path = resolve(path / "results.json" if path.is_dir() else path)  # committed runs: results.json.gz
        if not path.is_file():
            raise SystemExit(f"stress_crash.py: no stress results at {path}")
        tally.add_document(read_json(path))
    run = {"command": "stress_crash.py --merge " + " ".join(str(p) for p in inputs)}
    flakes = _write_report(out, tally, run, done=True)
    print(f"{flakes} flakes; {out}/README.md", file=sys.stderr)
    return 1 if flakes else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--load", type=int, default=1, help="busy processes per core (default 1)")
    parser.add_argument("--parallel", type=int, default=1, help="sessions at once (default 1)")
    parser.add_argument("--time-limit", type=float, default=None, help="start no session after this many seconds")
    parser.add_argument("--slice", type=int, action="append", choices=range(len(SLICES)),
                        help="run only this slice (repeatable; default all)")
    parser.add_argument("--merge", type=Path, nargs="+", help="add up these runs' results (files or folders)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.merge:
        return _merge(args.merge, args.out)
    sys.path.insert(0, str(REPO))
    from harness.report.fingerprint import environment_fingerprint

    tally, lock = Tally(), threading.Lock()
    busy = _busy(args.load * _cores())  # a `taskset` run loads only its own cores
    started = time.time()
    run = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "load_per_core": args.load,
           "busy_processes": len(busy), "parallel": args.parallel,
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
           "fingerprint": environment_fingerprint()}
    jobs = [(rep, index) for rep in range(args.repeats) for index in range(len(SLICES))
            if not args.slice or index in args.slice]

    def one(job: tuple[int, int], tmp: str) -> None:
        rep, index = job
        if args.time_limit is not None and time.time() - started > args.time_limit:
            return
        result = _session(SLICES[index], Path(tmp) / f"r{rep}-s{index}")
        with lock:
            tally.add_session(rep, index, result)
            run["hours"] = round((time.time() - started) / 3600, 2)
            _write_report(args.out, tally, run, done=False)
            print(f"repeat {rep + 1}/{args.repeats} slice {index}: {len(result['tests'])} tests, exit "
                  f"{result['exit']}, {result['seconds']} s, failures so far {len(tally.failures)}", file=sys.stderr)

    try:
        with tempfile.TemporaryDirectory(prefix="mrh-stress-") as tmp, \
                ThreadPoolExecutor(max_workers=args.parallel) as pool:
            for future in [pool.submit(one, job, tmp) for job in jobs]:
                future.result()
    finally:
        for proc in busy:
            proc.kill()
    run["hours"] = round((time.time() - started) / 3600, 2)
    flakes = _write_report(args.out, tally, run, done=True)
    print(f"{flakes} flakes; {args.out}/README.md", file=sys.stderr)
    return 1 if flakes else 0


if __name__ == "__main__":
    raise SystemExit(main())
