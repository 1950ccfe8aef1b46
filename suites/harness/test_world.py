"""The persistent world: start, per-rank results, failure propagation, timeouts, recovery, no orphans."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from harness.launch import RankDied, RemoteTraceback, World, WorldStartError, WorldTimeout, context

pytestmark = pytest.mark.world_size(2)


# --- functions that run on the ranks (module level: they are pickled by reference) ---
def _rank_and_sum(offset: int) -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    t = torch.ones(1, device=context().device) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return dist.get_rank(), t.item() + offset


def _say_hello() -> int:
    print(f"hello from rank {context().rank}")
    return os.getpid()


def _raise_on_rank_one() -> str:
    if context().rank == 1:
        raise ValueError("invalid value on purpose")
    return "fine"


def _raise_then_others_block() -> None:
    import torch.distributed as dist

    if context().rank == 1:
        raise KeyError("rank one gives up")
    dist.barrier()  # rank 0 waits here for rank 1, which never comes


def _stuck_in_here() -> None:
    time.sleep(600)


def _die_on_rank_one() -> None:
    if context().rank == 1:
        os._exit(3)
    time.sleep(600)


def _mark_then_wait(marker: str) -> None:
    """Every rank is mid-call once `marker` has a line per rank; then they wait, as ranks blocked
    on a peer in a collective would."""
    with open(marker, "a") as f:
        f.write(f"{context().rank}\n")
    time.sleep(600)


def _wait_for_release(marker: str, release: str) -> str:
    """Mark the rank as mid-call, then wait until the test creates `release` (no timing involved)."""
    with open(marker, "a") as f:
        f.write(f"{context().rank}\n")
    while not os.path.exists(release):
        time.sleep(0.02)
    return f"abandoned call on rank {context().rank}"


_LEFT_BEHIND: dict = {}


def _raise_holding_a_tensor_in_a_cycle() -> None:
    """Fails with a tensor that only a garbage collection frees (a reference cycle in its frame), with
    the automatic collection off, so that nothing but the rank's own clean-up can free it."""
    import gc
    import weakref

    import torch

    gc.disable()
    held = [torch.ones(1024, device=context().device)]
    held.append(held)
    _LEFT_BEHIND["tensor"] = weakref.ref(held[0])
    raise RuntimeError("failed while holding a tensor")


def _left_behind_is_freed() -> bool:
    import gc

    try:
        return _LEFT_BEHIND.pop("tensor")() is None
    finally:
        gc.enable()


def _unpicklable_result():
    return lambda: None


def _start_grandchild() -> int:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid


def _backend_state() -> tuple[bool, str]:
    import torch.distributed as dist

    from harness.backends import cpu_patches

    return cpu_patches.is_installed(), dist.get_backend()


# --- tests ---
def test_run_returns_every_rank_result_in_rank_order(world):
    assert world.run(_rank_and_sum, 10) == [(0, 13.0), (1, 13.0)]


def test_rank_output_reaches_the_test_prefixed_by_rank(world, capsys):
    pids = world.run(_say_hello)
    out = capsys.readouterr().out
    assert "[rank0] hello from rank 0" in out and "[rank1] hello from rank 1" in out
    assert pids == world.pids


def test_cpu_backend_is_installed_only_in_cpu_ranks(world, device):
    from harness.backends import cpu_patches

    assert not cpu_patches.is_installed(), "the pytest parent must never be patched"
    expected = (True, "gloo") if device == "cpu" else (False, "nccl")
    states = world.run(_backend_state)
    assert all(installed == expected[0] for installed, _ in states)
    assert all(expected[1] in backend for _, backend in states)


def test_rank_exception_is_reraised_with_rank_and_traceback(world):
    pids = world.pids
    with pytest.raises(ValueError, match="invalid value on purpose") as info:
        world.run(_raise_on_rank_one)
    assert any("rank 1 of 2" in note for note in info.value.__notes__)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback) and "_raise_on_rank_one" in cause.tb
    # Every rank answered, so the world is intact and keeps its processes.
    assert world.alive and world.pids == pids
    assert world.run(_rank_and_sum, 0)[0] == (0, 3.0)


def test_a_failed_call_leaves_nothing_it_allocated_behind(world):
    """A rank frees a failed call's objects, cycles included, before the next call (and on CUDA hands its
    cached blocks back): a persistent world must not carry a failed test's memory into the next one."""
    with pytest.raises(RuntimeError, match="failed while holding a tensor"):
        world.run(_raise_holding_a_tensor_in_a_cycle)
    assert world.run(_left_behind_is_freed) == [True] * world.size


def test_failure_while_other_ranks_hang_restarts_the_world(world):
    pids = world.pids
    start = time.monotonic()
    with pytest.raises(KeyError, match="rank one gives up") as info:
        world.run(_raise_then_others_block)
    assert time.monotonic() - start < world.failure_grace + 10
    assert any("hung" in note for note in info.value.__notes__)
    assert world.run(_rank_and_sum, 0) == [(0, 3.0), (1, 3.0)]
    assert world.pids != pids and _survivors(pids) == []


def test_timeout_dumps_every_rank_stack_and_recovers(world):
    pids = world.pids
    with pytest.raises(WorldTimeout) as info:
        world.run(_stuck_in_here, timeout=3)
    message = str(info.value)
    assert info.value.hung_ranks == [0, 1]
    for rank in (0, 1):
        section = message.split(f"--- rank {rank}:")[1].split("--- rank")[0]
        assert "_stuck_in_here" in section, f"rank {rank} stack missing:\n{message}"
    assert _survivors(pids) == []
    assert world.run(_rank_and_sum, 1) == [(0, 4.0), (1, 4.0)]


def test_dead_rank_fails_fast_with_exit_code_and_the_other_stacks(world):
    with pytest.raises(RankDied) as info:
        world.run(_die_on_rank_one, timeout=60)
    # Ray does not report a dead worker's exit code (its message says "connection error code 2")
    assert info.value.rank == 1 and info.value.exitcode == (3 if world.launcher == "process" else None)
    assert "_die_on_rank_one" in str(info.value).split("--- rank 0:")[1]
    assert world.run(_rank_and_sum, 0) == [(0, 3.0), (1, 3.0)]


def test_a_rank_killed_mid_call_fails_the_call_within_seconds(world, tmp_path):
    """A SIGKILLed rank fails the call about a second after its death: the others, surely blocked
    on it, get a short grace (`death_grace`), not the grace an exception gets."""
    marker = tmp_path / "in_call"
    killed_at: list[float] = []

    def kill_rank_one_mid_call() -> None:
        while not (marker.exists() and len(marker.read_text().split()) == world.size):
            time.sleep(0.05)
        killed_at.append(time.monotonic())
        os.kill(world.pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill_rank_one_mid_call, daemon=True)
    killer.start()
    with pytest.raises(RankDied) as info:
        world.run(_mark_then_wait, str(marker), timeout=120)
    failed_after = time.monotonic() - killed_at[0]
    print(f"{world.launcher}: the call failed {failed_after:.2f} s after the kill")
    assert info.value.rank == 1 and "rank 1 died" in str(info.value)
    assert "_mark_then_wait" in str(info.value).split("--- rank 0:")[1], "rank 0's stack is in the report"
    assert failed_after < 4.0, f"the call failed {failed_after:.1f} s after rank 1 was killed"


def test_unpicklable_function_and_result_are_clear_errors(world):
    with pytest.raises(TypeError, match="must be picklable"):
        world.run(lambda: 1)
    with pytest.raises(TypeError, match="cannot be sent back"):
        world.run(_unpicklable_result)


def test_close_leaves_no_rank_or_grandchild_process(fresh_world):
    world = fresh_world(2)
    grandchildren = world.run(_start_grandchild)
    ranks = world.pids
    world.close()
    assert _survivors(ranks + grandchildren) == [], "processes survived World.close()"


@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
def test_a_forked_world_serves_calls_and_closes_without_survivors(monkeypatch, start_method):
    """start_method="fork" (the crash trials' worlds) and "forkserver" (CUDA worlds): the same
    calls, the same teardown, the caller's environment; a CUDA world forks only from a process that
    never started CUDA."""
    monkeypatch.setenv("MRH_TEST_SET_AFTER_IMPORT", start_method)  # after any forkserver started
    world = World(2, "cpu", start_method=start_method).start()
    try:
        assert world.run(_rank_and_size) == [(0, 2), (1, 2)]
        assert world.run(_env, "MRH_TEST_SET_AFTER_IMPORT") == [start_method] * 2
        grandchildren = world.run(_start_grandchild)
        ranks = world.pids
    finally:
        world.close()
    assert _survivors(ranks + grandchildren) == []
    import harness.launch.world as world_module

    monkeypatch.setattr(world_module, "cuda_started_here", lambda: True)
    with pytest.raises(ValueError, match="has not started CUDA"):
        World(1, "cuda", start_method="fork")
    with pytest.raises(ValueError, match="start_method must be one of"):
        World(1, "cpu", start_method="vfork")


def _env(key: str) -> str | None:
    return os.environ.get(key)


def _rank_and_size():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def test_cuda_world_without_enough_gpus_is_one_clear_error():
    import torch

    too_many = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
    with pytest.raises(WorldStartError, match=f"needs {too_many} GPUs"):
        World(too_many, "cuda")


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_parent_killed_hard_leaves_no_orphans(tmp_path, start_method):
    """Also when the ranks came from a forkserver, whose children have it, not the world's process,
    as their parent."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time
        from harness.launch import World

        def _start_grandchild():
            return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid

        if __name__ == "__main__":
            world = World(2, start_method=sys.argv[1])
            kids = world.run(_start_grandchild)
            print(*world.pids, *kids, flush=True)
            time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script), start_method], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
    finally:
        proc.kill()  # SIGKILL: no atexit, no finalizers - only the ranks' own watchdog can act
        proc.wait()
    assert len(pids) == 4, pids
    assert _survivors(pids, wait_s=15) == []


def test_session_end_leaves_no_orphans(pytester):
    """A whole pytest session (plugin loaded from its entry point) cleans up its worlds."""
    pids_file = pytester.path / "pids.txt"
    pytester.makepyfile(test_inner=f"""
        import subprocess, sys, pytest

        def _start_grandchild():
            return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid

        @pytest.mark.world_size(2)
        def test_uses_a_world(world):
            kids = world.run(_start_grandchild)
            with open({str(pids_file)!r}, "w") as f:
                f.write(" ".join(map(str, world.pids + kids)))
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--mrh-devices=cpu", "-q")
    result.assert_outcomes(passed=1)
    pids = [int(p) for p in pids_file.read_text().split()]
    assert len(pids) == 4 and _survivors(pids) == []


@pytest.fixture(autouse=True)
def _interrupts_stay_here(monkeypatch):
    """The calls these tests interrupt on purpose are recorded in a list of their own, not the session's
    (harness.launch.base.INTERRUPTED, printed at the session's end as what a time limit cut)."""
    from harness.launch import base

    monkeypatch.setattr(base, "INTERRUPTED", [])


def _interrupt_the_wait(world, monkeypatch) -> None:
    """The next wait for replies raises KeyboardInterrupt, as a SIGINT would: after the call was
    sent, before any reply was read (once; later waits are the world's own)."""
    poll = world._poll

    def interrupted(pending, timeout):
        monkeypatch.setattr(world, "_poll", poll)
        raise KeyboardInterrupt

    monkeypatch.setattr(world, "_poll", interrupted)


@pytest.fixture
def restartable_world(request, world_pool, device, fresh_world):
    """A world of 2 for the tests that restart or close theirs: local CPU ranks forked in a private
    world ((re)start in about a second, spawned ones in 5 on 2 cores); else the session's world,
    restarted in place as the timeout tests do (a private Ray world would cost a start more)."""
    if world_pool.launcher == "process" and device == "cpu":
        return fresh_world(2, start_method="fork").start()
    return request.getfixturevalue("world")


def test_an_interrupted_call_is_drained_before_the_next_call(world, tmp_path, monkeypatch):
    """Issue 36: a SIGINT inside `world.run` left the call's replies in flight; the next call (a
    test's `finally: policy.close()`) read them and failed "rank 1 answered call N, expected N+1".
    Now the next call first drains the abandoned call's replies (same ranks, same state), then runs."""
    marker, release = tmp_path / "in_call", tmp_path / "release"
    pids, starts, abandoned = world.pids, world.starts, world.abandoned
    _interrupt_the_wait(world, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        world.run(_wait_for_release, str(marker), str(release))
    release.touch()  # the abandoned call now finishes: its replies are on their way, or already there
    assert world.run(_rank_and_sum, 5) == [(0, 8.0), (1, 8.0)]  # no "rank 0 answered call N, expected N+1"
    assert sorted(marker.read_text().split()) == ["0", "1"], "both ranks ran the abandoned call"
    assert world.run(_rank_and_sum, 6) == [(0, 9.0), (1, 9.0)]
    assert world.pids == pids and world.starts == starts, "drained, not restarted"
    assert world.abandoned == abandoned + 1


def test_an_interrupted_call_records_where_every_busy_rank_was(world, tmp_path, monkeypatch):
    """A run cut at its time limit (SIGINT) says what each rank was doing: the interrupted call, with every
    unanswered rank's Python stack, is recorded for the session's summary (1x H100, 2026-12-06: a resume
    interrupted after 266 s left a log that said only that the driver was waiting). The world is then drained
    as before."""
    from harness.launch import base

    marker, release = tmp_path / "in_call", tmp_path / "release"
    poll = world._poll

    def interrupted_mid_call(pending, timeout):
        # interrupt once both ranks are inside the call (each marks it), so both stacks must show it
        while not marker.exists() or len(marker.read_text().split()) < world.size:
            time.sleep(0.02)
        monkeypatch.setattr(world, "_poll", poll)
        raise KeyboardInterrupt

    monkeypatch.setattr(world, "_poll", interrupted_mid_call)
    with pytest.raises(KeyboardInterrupt):
        world.run(_wait_for_release, str(marker), str(release))
    assert len(base.INTERRUPTED) == 1
    record = base.INTERRUPTED[0]
    assert "_wait_for_release" in record.what and record.size == world.size
    assert sorted(record.stacks) == list(range(world.size))
    for rank, stack in record.stacks.items():
        assert "_wait_for_release" in stack, f"rank {rank}'s stack does not show the call:\n{stack}"
    assert "waiting on ranks [0, 1] of 2" in record.describe()
    release.touch()
    assert world.run(_rank_and_sum, 5) == [(0, 8.0), (1, 8.0)]  # drained, in step


def test_an_interrupted_call_that_never_ends_restarts_the_world(restartable_world, tmp_path, monkeypatch):
    """The abandoned call does not finish within its own timeout: the next call kills the ranks
    (none survives) and runs on a fresh world."""
    world = restartable_world
    marker, release = tmp_path / "in_call", tmp_path / "never"
    pids, starts = world.pids, world.starts
    _interrupt_the_wait(world, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        world.run(_wait_for_release, str(marker), str(release), timeout=1.0)
    assert world.run(_rank_and_sum, 5) == [(0, 8.0), (1, 8.0)]
    assert world.starts == starts + 1 and _survivors(pids) == []
    assert world.run(_rank_and_sum, 6) == [(0, 9.0), (1, 9.0)]


def test_an_interrupt_while_draining_restarts_the_world(restartable_world, tmp_path, monkeypatch):
    """A second interrupt, while the next call drains the first one's replies, kills the ranks and
    propagates; the call after it starts a fresh world."""
    world = restartable_world
    marker, release = tmp_path / "in_call", tmp_path / "never"
    pids, starts = world.pids, world.starts
    _interrupt_the_wait(world, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        world.run(_wait_for_release, str(marker), str(release))
    _interrupt_the_wait(world, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        world.run(_rank_and_sum, 5)
    assert not world.alive and _survivors(pids) == []
    assert world.run(_rank_and_sum, 6) == [(0, 9.0), (1, 9.0)]
    assert world.starts == starts + 1


def test_an_interrupt_while_sending_restarts_the_world(restartable_world, monkeypatch):
    """A call interrupted before it reached every rank (a pipe may hold half a message): the next
    call restarts the ranks rather than wait for replies that may never come."""
    world = restartable_world
    pids, starts = world.pids, world.starts
    send = world._send

    def interrupted(message):
        monkeypatch.setattr(world, "_send", send)
        raise KeyboardInterrupt

    monkeypatch.setattr(world, "_send", interrupted)
    with pytest.raises(KeyboardInterrupt):
        world.run(_rank_and_sum, 5)
    assert world.run(_rank_and_sum, 5) == [(0, 8.0), (1, 8.0)]
    assert world.starts == starts + 1 and _survivors(pids) == []


def test_closing_a_world_in_doubt_kills_it_at_once(restartable_world, tmp_path, monkeypatch):
    """`close()` (a session's end after Ctrl-C) does not wait for ranks busy in an abandoned call
    to see an orderly stop: it kills them, and nothing survives."""
    world = restartable_world
    pids = world.pids
    _interrupt_the_wait(world, monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        world.run(_wait_for_release, str(tmp_path / "in_call"), str(tmp_path / "never"))
    start = time.monotonic()
    world.close()
    assert time.monotonic() - start < 5.0 and _survivors(pids) == []


def _survivors(pids: list[int], wait_s: float = 5.0) -> list[int]:
    """The pids still running after up to `wait_s` (SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + wait_s
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _running(p)]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _fork_a_lingering_child_then_die_on_rank_one(pid_file: str) -> None:
    """Rank 1 forks a process that outlives it holding its pipe and sentinel (as the dist-ckpt writer's
    `Manager`, forked mid-save, does), then dies."""
    import multiprocessing

    if context().rank == 1:
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=False)
        child.start()
        Path(pid_file).write_text(str(child.pid))
        os._exit(3)
    time.sleep(600)


def test_a_rank_dead_while_its_child_lives_is_reported_dead_not_hung(world, tmp_path):
    """An OOM-killed rank whose forked helper lived on was a 1200 s "hang" (the pipe and the sentinel stay
    open while the child holds them): its exit status, read on every poll, reports the death, with its code,
    and the teardown takes the child down with it (the rank's process group)."""
    if world.launcher != "process":
        pytest.skip("Ray reports a dead worker by its actor, not its pipe")
    pid_file = tmp_path / "child.pid"
    with pytest.raises(RankDied) as info:
        world.run(_fork_a_lingering_child_then_die_on_rank_one, str(pid_file), timeout=60)
    assert info.value.rank == 1 and info.value.exitcode == 3, info.value
    # the teardown SIGKILLed the rank's process group: the child is gone, or going
    assert _survivors([int(pid_file.read_text())], wait_s=30.0) == [], "the dead rank's child outlived the teardown"
    assert world.run(_rank_and_sum, 0) == [(0, 3.0), (1, 3.0)]
