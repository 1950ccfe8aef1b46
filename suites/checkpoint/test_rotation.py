"""A checkpoint root under a Checkpointer: rotation, the tracker, resume, writer errors, close/abort.

The order of operations itself is proven by crash injection (test_crash_safety.py) and by the
fsync-order spy (test_durability.py); here each promise of harness.checkpoint.checkpointer is
checked on a live policy, sync and async, on CPU/gloo and (-m gpu) CUDA/NCCL.
"""
from __future__ import annotations

import pytest

from harness.checkpoint import CheckpointError
from harness.checkpoint.checkpointer import Checkpointer
from harness.checkpoint.faults import FaultPlan, injected
from harness.checkpoint.resume_check import CONFIG, MODEL, train_batch
from harness.checkpoint.root import TRACKER, NothingToResume
from suites.checkpoint.conftest import layout_for

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def _trained(policy, device, steps: int = 1):
    handle = policy(layout_for(device), MODEL, **CONFIG)
    handle.steps([train_batch(i) for i in range(steps)])
    return handle


@pytest.mark.parametrize("async_save", MODES)
@pytest.mark.parametrize("keep", [1, 2])
def test_rotation_keeps_the_newest_and_the_tracker_names_the_last(policy, device, tmp_path, async_save, keep, report):
    handle = _trained(policy, device)
    ckpt = handle.checkpointer(tmp_path, keep=keep, async_save=async_save)
    for step in range(1, 4):
        ckpt.save()
        handle.step(train_batch(step))  # async: while the save may still be writing
    ckpt.close()
    assert ckpt.root.complete() == list(range(4 - keep, 4)) == ckpt.root.iterations()
    assert ckpt.root.tracker() == 3
    assert ckpt.root.hidden() == [] and ckpt.writers() == []
    deleted = sorted(i for record in ckpt.history for i in record.deleted)
    assert deleted == list(range(1, 4 - keep))
    report.add("complete_checkpoints", len(ckpt.root.complete()), tolerance=keep,
               passed=len(ckpt.root.complete()) == keep, claim="exact",
               layout=layout_for(device), async_save=async_save)


def test_bad_knobs_are_one_clear_error_before_any_work(policy, device, tmp_path):
    handle = policy(layout_for(device), MODEL, **CONFIG)
    with pytest.raises(CheckpointError, match="keep must be an integer >= 1"):
        handle.checkpointer(tmp_path / "a", keep=0)
    with pytest.raises(CheckpointError, match=r"unknown checkpoint knob\(s\) \['asyncsave'\]"):
        handle.checkpointer(tmp_path / "b", asyncsave=True)
    with pytest.raises(CheckpointError, match="is a bridge variant"):
        handle.checkpointer(tmp_path / "c", variant="scaled-norm")
    assert not any(tmp_path.iterdir())


def test_an_existing_iteration_is_never_overwritten(policy, device, tmp_path):
    handle = _trained(policy, device)
    ckpt = Checkpointer(handle, tmp_path)
    ckpt.save()
    before = sorted(p.name for p in (tmp_path / "iter_0000001").iterdir())
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        ckpt.save()
    assert sorted(p.name for p in (tmp_path / "iter_0000001").iterdir()) == before
    assert ckpt.root.hidden() == []


def test_resume_takes_the_newest_complete_and_passes_over_a_damaged_one(policy, device, tmp_path):
    handle = _trained(policy, device)
    ckpt = Checkpointer(handle, tmp_path, keep=3)
    for step in range(1, 3):
        ckpt.save()
        handle.step(train_batch(step))
    ckpt.save()  # iterations 1, 2, 3
    shard = next((tmp_path / "iter_0000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])  # the newest loses its tail
    (tmp_path / ".iter_0000004.partial-deadbeef").mkdir()  # an interrupted save
    (tmp_path / "iter_0000005").mkdir()  # a visible dir without a manifest
    target = policy(layout_for(device), MODEL, **CONFIG)
    with pytest.warns(UserWarning, match="passing over newer incomplete or damaged checkpoints"):
        info = Checkpointer(target, tmp_path, sweep=False).resume()
    assert info["iteration"] == 2 and [i for i, _ in info["skipped"]] == [5, 3]
    assert info["tracker"] == 3 and info["steps_done"] == 2


def test_nothing_to_resume_says_so(policy, device, tmp_path):
    target = policy(layout_for(device), MODEL, **CONFIG)
    with pytest.raises(NothingToResume, match="nothing to resume: no checkpoint directories"):
        Checkpointer(target, tmp_path / "empty").resume()
    (tmp_path / "half" / "iter_0000002").mkdir(parents=True)
    with pytest.raises(NothingToResume, match="1 incomplete or damaged"):
        Checkpointer(target, tmp_path / "half").resume()


def test_an_unreadable_tracker_is_ignored_with_a_warning(policy, device, tmp_path):
    handle = _trained(policy, device)
    Checkpointer(handle, tmp_path).save()
    (tmp_path / TRACKER).write_text("")
    with pytest.warns(UserWarning, match="unreadable tracker"):
        assert Checkpointer(policy(layout_for(device), MODEL, **CONFIG), tmp_path).resume()["iteration"] == 1


@pytest.mark.parametrize("async_save", MODES)
def test_a_writer_error_surfaces_once_and_changes_nothing(policy, device, tmp_path, async_save):
    handle = _trained(policy, device)
    ckpt = Checkpointer(handle, tmp_path, keep=1, async_save=async_save)
    ckpt.save()
    ckpt.wait()
    handle.step(train_batch(1))
    plan = FaultPlan("shard-writes", iteration=2, action="raise", rank=handle.world.size - 1)  # the last rank only
    with injected(handle.world, plan):
        # megatron-core 0.19 reports a failed writer by its exception's class only
        with pytest.raises(CheckpointError, match="save of iteration 2 failed.*(injected fault|InjectedFault)"):
            ckpt.save()
            ckpt.wait()  # async: the error surfaces at finalize
    assert ckpt.root.tracker() == 1 and ckpt.root.complete() == [1] == ckpt.root.iterations()
    assert ckpt.root.hidden() == [] and ckpt.pending == [] and ckpt.writers() == []
    ckpt.wait()  # raised once: nothing left to raise
    ckpt.save()  # and the next save works
    ckpt.close()
    assert ckpt.root.complete() == [2] and ckpt.root.tracker() == 2


def test_a_second_save_waits_for_the_first(policy, device, tmp_path):
    handle = _trained(policy, device)
    ckpt = Checkpointer(handle, tmp_path, keep=2, async_save=True)
    with injected(handle.world, FaultPlan("shard-writes", iteration=1, action="hold")):
        ckpt.save()
        assert ckpt.pending and ckpt.writers()  # the first is still writing
        handle.step(train_batch(1))
        ckpt.save()  # must finalize the first before it schedules the second
        assert [r.iteration for r in ckpt.history] == [1] and [p.iteration for p in ckpt.pending] == [2]
    ckpt.close()
    assert ckpt.root.complete() == [1, 2]


def test_abort_kills_the_writers_and_keeps_what_is_complete(policy, device, tmp_path):
    handle = _trained(policy, device)
    ckpt = Checkpointer(handle, tmp_path, keep=1, async_save=True)
    ckpt.save()
    ckpt.wait()
    with injected(handle.world, FaultPlan("shard-writes", iteration=2, action="hold")):
        handle.step(train_batch(1))
        ckpt.save()
        writers = ckpt.writers()
        assert writers
        killed = ckpt.abort()
    assert set(writers) <= set(killed) and ckpt.writers() == []
    assert not any(_alive(pid) for pid in writers)
    assert ckpt.root.complete() == [1] and ckpt.root.tracker() == 1 and ckpt.root.hidden() == []


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
