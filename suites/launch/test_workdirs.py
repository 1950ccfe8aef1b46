"""A world's directory under the temp dir (rank logs, stack dumps) names its owner, and a world
start removes the directories whose owner is gone: a SIGKILLed job leaves nothing behind for long."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from harness.launch import World
from harness.launch.base import OWNER_FILE, make_workdir, sweep_stale_workdirs


@pytest.fixture
def tmpdir_root(tmp_path, monkeypatch) -> Path:
    """A private temp dir: the sweep only ever sees this test's directories."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _world_dir(root: Path, name: str, owner: tuple[int, float] | None = None, age_s: float = 0.0) -> Path:
    path = root / name
    path.mkdir()
    (path / "rank0.log").write_text("a rank's log\n")
    if owner is not None:
        (path / OWNER_FILE).write_text(json.dumps({"pid": owner[0], "started": owner[1]}))
    if age_s:
        then = time.time() - age_s
        for entry in (*path.iterdir(), path):
            os.utime(entry, (then, then))
    return path


def _dead_process() -> tuple[int, float]:
    """The pid and start time of a process that has finished."""
    probe = "import os, psutil; print(os.getpid(), psutil.Process().create_time())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    pid, started = done.stdout.split()
    return int(pid), float(started)


def test_the_sweep_removes_exactly_the_directories_of_dead_owners(tmpdir_root):
    me = (os.getpid(), psutil.Process().create_time())
    day = 24 * 3600
    gone = [
        _world_dir(tmpdir_root, "mrh-world2-cpu-dead", owner=_dead_process()),
        _world_dir(tmpdir_root, "mrh-rayworld2-cpu-dead", owner=_dead_process()),
        _world_dir(tmpdir_root, "mrh-world2-cpu-recycled", owner=(me[0], me[1] - 60)),  # a recycled pid
        _world_dir(tmpdir_root, "mrh-world2-cpu-legacy-old", age_s=day + 3600),
    ]
    kept = [
        _world_dir(tmpdir_root, "mrh-world2-cpu-live", owner=me, age_s=3 * day),
        _world_dir(tmpdir_root, "mrh-rayworld1-cpu-live", owner=me),
        _world_dir(tmpdir_root, "mrh-world2-cpu-legacy-new", age_s=day - 3600),
        _world_dir(tmpdir_root, "someone-elses-dir", age_s=3 * day),
    ]
    sweep_stale_workdirs()
    assert [p.name for p in gone if p.exists()] == []
    assert [p.name for p in kept if not p.exists()] == []


def test_a_new_world_directory_names_its_creator(tmpdir_root):
    path = Path(make_workdir("mrh-world1-cpu-"))
    owner = json.loads((path / OWNER_FILE).read_text())
    assert path.parent == tmpdir_root and path.name.startswith("mrh-world1-cpu-")
    assert owner == {"pid": os.getpid(), "started": psutil.Process().create_time()}


def test_a_sigkilled_jobs_world_directory_goes_at_the_next_world_start(tmpdir_root):
    script = tmpdir_root / "job.py"
    script.write_text(textwrap.dedent("""
        import time
        from harness.launch import World

        if __name__ == "__main__":
            world = World(1).start()
            print(world.workdir, flush=True)
            time.sleep(600)
    """))
    job = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        left = Path(job.stdout.readline().strip())
    finally:
        job.send_signal(signal.SIGKILL)  # no atexit, no close(): the directory stays
        job.wait()
    assert left.parent == tmpdir_root and left.is_dir()
    # Forked from this process (torch and megatron-core imported): the sweep is the world start's,
    # whatever starts the ranks, and a fork does not import them again (seconds of a spawned rank).
    with World(1, start_method="fork") as world:
        assert not left.exists(), "the next world start removes the dead job's directory"
        assert Path(world.workdir).is_dir()
