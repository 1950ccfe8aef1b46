"""The fault points themselves: a plan acts where it says, a write held at a concurrent point waits
for the trainer (a condition, never a delay), and a trial whose point is never reached is an error.
The first tests run in this process (threads stand in for the writer); the last runs a crash trial."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading

import pytest

from harness.checkpoint import faults
from harness.checkpoint.faults import ENV, FaultPlan, InjectedFault, awaiting_writes, fault, read_records


@pytest.fixture
def plan_env(monkeypatch, tmp_path):
    def activate(**fields) -> FaultPlan:
        plan = FaultPlan(**{"log": str(tmp_path / "faults.jsonl"), **fields})
        monkeypatch.setenv(ENV, plan.to_env())
        return plan
    return activate


def _events(plan, event):
    return [r for r in read_records(plan.log) if r["event"] == event]


def test_a_plan_acts_only_at_its_point_and_iteration(plan_env):
    plan = plan_env(point="tracker-rename", iteration=3, action="raise")
    fault("tracker-rename", 2)
    fault("before-commit", 3)
    assert _events(plan, "fault-reached") == []
    with pytest.raises(InjectedFault, match="tracker-rename"):
        fault("tracker-rename", 3)
    assert [r["point"] for r in _events(plan, "fault-reached")] == ["tracker-rename"]


def test_hold_is_only_for_a_point_reached_concurrently_with_the_trainer():
    with pytest.raises(ValueError, match="only at"):
        FaultPlan("before-commit", 3, action="hold")
    with pytest.raises(ValueError, match="unknown fault action"):
        FaultPlan("shard-writes", 3, action="delay")


def test_a_held_write_goes_on_once_the_trainer_waits_for_that_save(plan_env):
    plan = plan_env(point="shard-writes", iteration=3, action="hold")
    writer = threading.Thread(target=fault, args=("shard-writes", 3), daemon=True)
    writer.start()
    while not _events(plan, "fault-reached"):  # the writer is at the point...
        writer.join(0.01)
    awaiting_writes(2)  # ...a wait for another save does not release it...
    writer.join(0.3)
    assert writer.is_alive()
    awaiting_writes(3)  # ...the trainer's wait for this one does
    writer.join(30)
    assert not writer.is_alive()
    assert [r["iteration"] for r in _events(plan, "fault-awaited")] == [3]


def test_a_kill_at_a_concurrent_point_waits_for_the_trainer(plan_env, monkeypatch):
    """The kill fires only after awaiting_writes: here kill_session is stood in for."""
    import os

    plan = plan_env(point="shard-writes", iteration=3, action="kill", session=os.getsid(0))
    killed = threading.Event()
    monkeypatch.setattr(faults, "kill_session", lambda session: killed.set())
    writer = threading.Thread(target=fault, args=("shard-writes", 3), daemon=True)
    writer.start()
    while not _events(plan, "fault-reached"):
        writer.join(0.01)
    writer.join(0.3)
    assert not killed.is_set()
    awaiting_writes(3)
    writer.join(30)
    assert killed.is_set()


def test_kills_refuse_a_session_this_process_is_not_in():
    import os

    with pytest.raises(RuntimeError, match="refusing"):
        faults.kill_driver(os.getsid(0) + 1)
    with pytest.raises(RuntimeError, match="refusing"):
        faults.kill_session(os.getsid(0) + 1)


def test_a_killed_process_is_dying_until_gone_and_a_live_one_is_not():
    """What the orphan check waits for instead of counting it as a survivor: a process that was
    SIGKILLed is on its way out (stopped first, so it cannot be gone before we look)."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert not faults.dying(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)
        assert faults.dying(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert faults.dying(proc.pid)  # gone


def test_an_exiting_process_is_dying_by_its_task_flags():
    """A killed process that already took its SIGKILL off the pending set shows only as exiting
    (PF_EXITING in /proc/PID/stat): the flags are read past the command name, whatever it holds."""
    assert faults.stat_flags("123 (a) b (c)) S 1 123 123 0 -1 4194564 0 0") == 4194564
    assert faults.stat_flags("123 (a) b (c)) S 1 123 123 0 -1 4194564 0 0") & faults.PF_EXITING
    with open(f"/proc/{os.getpid()}/stat") as handle:
        assert not faults.stat_flags(handle.read()) & faults.PF_EXITING  # this process is not exiting
    assert not faults.dying(os.getpid())


def test_a_trial_whose_point_is_never_reached_is_an_error(device, tmp_path):
    """A job of 2 saves never reaches the save of iteration 3: no verdict, an error."""
    if device != "cpu":
        pytest.skip("the trial machinery is device-blind; the CPU tier shows it")
    from harness.checkpoint.crash import CrashConfig, FaultNotReached, run_trial

    config = dataclasses.replace(CrashConfig(True, 1), steps=2)
    with pytest.raises(FaultNotReached, match="without reaching fault point before-commit"):
        run_trial(config, tmp_path / "root", point="before-commit")
