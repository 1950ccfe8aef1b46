"""ci/gpu_batch.sh, the device-side driver that runs several suites per device call: each job on its own
GPUs with its pytest arguments as written, the benches' JSON kept, everything packed into one file, and
each job's files packed as it ends, no job started past BATCH_LIMIT (a call the device tool kills comes back with nothing). Run with a stub
python3 (nothing is installed and no suite runs), as suites/report/test_git_revision.py runs device_run.sh."""
from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOBS = """# a comment
serial
bench-echo 0 20 echo '{"ok": 1}'
parallel
wide 0,1,2,3 60 suites/x -m gpu -k "cp4 or tp2"
narrow 2,3 60 suites/y
"""


def _batch(tmp_path: Path, limit: int) -> tuple[subprocess.CompletedProcess, Path, Path]:
    (tmp_path / "ci").mkdir()
    for script in ("gpu_batch.sh", "device_run.sh"):
        shutil.copy(REPO / "ci" / script, tmp_path / "ci")
    (tmp_path / "bin").mkdir()
    seen = tmp_path / "seen.txt"
    stub = tmp_path / "bin" / "python3"  # one line per start: the GPUs, then every argument on its own
    stub.write_text(f'#!/bin/sh\n{{ echo "GPUS=${{CUDA_VISIBLE_DEVICES:-}}"; for a in "$@"; do echo "ARG=$a"; done; '
                    f'echo END; }} >> {seen}\n')
    stub.chmod(0o755)
    (tmp_path / "jobs.txt").write_text(JOBS)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MRH_", "CUDA_VISIBLE"))}
    done = subprocess.run(["bash", "ci/gpu_batch.sh", "jobs.txt"], cwd=tmp_path, text=True, capture_output=True,
                          env={**env, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "OUT": str(out),
                               "BATCH_LIMIT": str(limit), "MRH_GIT_COMMIT": "a" * 40, "MRH_GIT_DIRTY": "0",
                               "GIT_DIR": str(tmp_path / "no-such-git-dir")}, timeout=120)
    return done, seen, out


def _pytest_starts(seen: Path) -> list[tuple[str, list[str]]]:
    starts, gpus, args = [], "", []
    for line in seen.read_text().splitlines():
        if line.startswith("GPUS="):
            gpus, args = line[5:], []
        elif line.startswith("ARG="):
            args.append(line[4:])
        elif args[:2] == ["-m", "pytest"]:
            starts.append((gpus, args[2:]))
    return starts


def test_each_job_runs_on_its_gpus_with_its_arguments_and_everything_comes_back_packed(tmp_path):
    done, seen, out = _batch(tmp_path, limit=300)
    assert done.returncode == 0, done.stderr
    starts = dict((args[0], (gpus, args)) for gpus, args in _pytest_starts(seen))
    assert set(starts) == {"suites/x", "suites/y"}
    gpus, args = starts["suites/x"]
    assert gpus == "0,1,2,3" and args[args.index("-k") + 1] == "cp4 or tp2"  # the quoted -k stays one argument
    assert args[args.index("--mrh-report-dir") + 1] == f"{out}/rows-wide"
    assert starts["suites/y"][0] == "2,3"
    assert [p.name for p in out.iterdir()] == ["batch.tgz"]
    with tarfile.open(out / "batch.tgz") as packed:  # a job's files are in its own archive, packed as it ends
        assert sorted(n for n in packed.getnames() if n.endswith(".tgz")) == [
            "./bench-echo.tgz", "./narrow.tgz", "./wide.tgz"]
        with tarfile.open(fileobj=packed.extractfile("./bench-echo.tgz")) as job:
            assert job.extractfile("bench-echo.json").read().decode().strip() == '{"ok": 1}'
        with tarfile.open(fileobj=packed.extractfile("./wide.tgz")) as job:
            assert "wide.log" in job.getnames()


def test_no_job_starts_past_the_batch_limit(tmp_path):
    done, seen, out = _batch(tmp_path, limit=110)  # 110 s - the 90 s margin leaves < 30 s: nothing runs
    assert done.returncode == 0, done.stderr
    assert _pytest_starts(seen) == []
    assert all(f"gpu_batch: {name} skipped" in done.stdout for name in ("bench-echo", "wide", "narrow"))
    assert (out / "batch.tgz").is_file()
