"""Rank side of a save, sync or async, on megatron-core's own machinery.

Both modes build the same `AsyncRequest` with `dist_checkpointing.save(..., async_sharded_save=True)`
and run it the same way: stage, write (forked writer processes, one per bucket), then the finalize
functions (`.metadata`, `metadata.json`; collectives). Sync runs it inline (`execute_sync`, as
megatron-core's own sync save does); async schedules it on an `AsyncCallsQueue` with the temporal
caller and returns as soon as the state is staged, and `finalize` later completes it on every rank.

Why the temporal caller (a process forked per save) and not the persistent one: it runs the same
code on CPU/gloo and CUDA/NCCL. The persistent worker is spawned without the harness's CPU patches
and dies on CPU (ZeroDivisionError in `rank % torch.cuda.device_count()`), and has no liveness check,
so the trainer then waits forever; on CPU it would also share, not snapshot, the tensors it writes.
The fork gives the temporal writer a copy-on-write snapshot of the staged state, so training may
change the live tensors while the files are written (`mrh bench ckpt` measures both callers on GPU).

One save in flight per rank: megatron-core 0.16.1 hands every save's write results back through
one process-wide queue in completion order, so two temporal saves in flight can each finalize with
the other's results (both "succeed", neither loads; suites/checkpoint/test_async_save.py shows it).
The parent (harness.checkpoint.checkpointer) therefore finalizes a save before it schedules the
next; `save` refuses a second one here too unless told `allow_overlap` (the upstream behaviour).
"""
from __future__ import annotations

import functools
import os
import resource
import signal
import time
from typing import Any

from harness.checkpoint.faults import awaiting_writes, fault


def _psutil():
    import psutil

    return psutil


class RankSaver:
    """One rank's checkpoint writes: at most one async save in flight (see the module docstring)."""

    def __init__(self) -> None:
        self._queue = None
        self._pending: list[dict[str, Any]] = []  # {"call": megatron-core's call index, "directory", "iteration"}

    # ------------------------------------------------------------------ saving
    def save(self, state: dict[str, Any], directory: str, *, strategy, content_metadata: dict[str, Any],
             async_save: bool, iteration: int | None, allow_overlap: bool = False) -> dict[str, float]:
        """Plan and write (sync) or stage and schedule (async) `state`. Returns where the time went:
        plan_s (megatron-core's save(): validation, planning collectives, common.pt) and stage_s
        (async: the copy to host and the fork of the writer; sync: the whole write and finalize),
        and, for sync, writer_cpu_s (CPU time of the forked per-bucket writers)."""
        from megatron.core import dist_checkpointing

        from harness.compat.megatron_core import fork_results_queue, instrument_writes, mcore_async_strategy

        if self._pending and not allow_overlap:
            raise RuntimeError(f"a save into {self._pending[0]['directory']} is still in flight on this rank; "
                               "finalize it first (megatron-core 0.16.1 would swap the two saves' results)")
        fault("before-staging", iteration)
        fork_results_queue()
        instrument_writes(iteration)  # the fault point inside the forked writers
        started = time.perf_counter()
        request = dist_checkpointing.save(state, directory, sharded_strategy=strategy,
                                          content_metadata=content_metadata, async_sharded_save=True,
                                          **mcore_async_strategy())
        request = request._replace(finalize_fns=[functools.partial(fault, "writes-done", iteration),
                                                 *request.finalize_fns])
        planned = time.perf_counter()
        timings = {"plan_s": planned - started}
        if not async_save:
            cpu = _children_cpu_s()
            awaiting_writes(iteration)  # a sync save waits for its writers at once
            request.execute_sync()
            return {**timings, "stage_s": time.perf_counter() - planned, "writer_cpu_s": _children_cpu_s() - cpu}
        if self._queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue(persistent=False)
        call = self._queue.schedule_async_request(request)
        self._pending.append({"call": call, "directory": directory, "iteration": iteration})
        return {**timings, "stage_s": time.perf_counter() - planned}

    # ------------------------------------------------------------------ finalizing
    def finalize(self, blocking: bool) -> dict[str, Any]:
        """Finalize the saves whose writes are done on every rank (collective: every rank calls it
        at the same point). Returns {"finalized": [directories], "pending": n, "error": text or None,
        "failed": directory or None, "writer_cpu_s": CPU time of the writers reaped here}: a writer's
        error is returned, not raised, so the world stays usable and the parent raises it once.
        The writer is this rank's child, its per-bucket writers its children: their CPU time
        reaches RUSAGE_CHILDREN when finalize joins the writer (verl PR 4638: a writer can burn CPU
        the training step needs)."""
        if not self._pending:
            return {"finalized": [], "pending": 0, "error": None, "failed": None, "writer_cpu_s": 0.0}
        cpu = _children_cpu_s()
        if blocking:  # this rank now blocks on the writers: a writer held at a fault point may act
            for pending in self._pending:
                awaiting_writes(pending["iteration"])
        try:
            calls = self._queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException as exc:  # CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            failed = self._pending.pop(0)  # megatron-core popped the request before it raised
            return {"finalized": [], "pending": len(self._pending), "failed": failed["directory"],
                    "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}",
                    "writer_cpu_s": _children_cpu_s() - cpu}
        done = [p for p in self._pending if p["call"] in calls]
        self._pending = [p for p in self._pending if p["call"] not in calls]
        return {"finalized": [p["directory"] for p in done], "pending": len(self._pending), "error": None,
                "failed": None, "writer_cpu_s": _children_cpu_s() - cpu}

    def abort(self) -> list[int]:
        """Kill this rank's in-flight writers (and their forked children) without finalizing;
        returns the killed pids. The partial directories are the parent's to discard. A writer
        may be forking its per-bucket children as it is killed, so whatever is left of this rank's
        process group (its long-lived helpers aside) is killed again until nothing is."""
        killed = []
        if self._queue is not None:
            for active in list(self._queue.async_calls):
                process = active.async_caller.process
                if process is not None and process.pid is not None:
                    killed += _kill_tree(process.pid)
        for _ in range(10):
            left = writer_processes()
            if not left:
                break
            for pid in left:
                killed += _kill_tree(pid)
        if self._queue is not None:
            for active in list(self._queue.async_calls):
                if active.async_caller.process is not None:
                    active.async_caller.process.join(timeout=10)  # reap it
                    active.async_caller.process = None
            self._queue.async_calls.clear()
        self._pending = []
        return sorted(set(killed))

    def pending(self) -> int:
        return len(self._pending)

    def writes_done(self, iteration: int) -> bool:
        """The writer of this rank's pending save of `iteration` has exited (its writes are on disk
        or failed; finalize has not run yet). True when no such save is pending."""
        for pending in self._pending:
            if pending["iteration"] == iteration:
                active = next((a for a in self._queue.async_calls if a.idx == pending["call"]), None)
                process = active.async_caller.process if active is not None else None
                return process is None or not process.is_alive()
        return True


# ---------------------------------------------------------------------- processes
def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _kill_tree(pid: int) -> list[int]:
    psutil = _psutil()
    try:
        root = psutil.Process(pid)
        tree = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return []
    killed = []
    for proc in tree:
        try:
            proc.send_signal(signal.SIGKILL)
            killed.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=5)
    return killed


def _helper_pids() -> set[int]:
    """Long-lived helpers multiprocessing starts for the writes: the results queue's Manager
    server (one per rank process) and the resource tracker. They live as long as the rank."""
    helpers = set()
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        queue = filesystem_async._results_queue
        manager = getattr(queue, "_manager", None) if queue is not None else None
        if manager is not None and getattr(manager, "_process", None) is not None:
            helpers.add(manager._process.pid)
    except ImportError:
        pass
    from multiprocessing import resource_tracker

    tracker_pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    if tracker_pid:
        helpers.add(tracker_pid)
    return helpers


def writer_processes() -> list[int]:
    """Live processes of this rank's process group other than the rank and its long-lived helpers:
    checkpoint writers (forked per save, and their per-bucket children), wherever they were reparented."""
    psutil = _psutil()
    me, group, helpers = os.getpid(), os.getpgid(0), _helper_pids()
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if (proc.pid != me and proc.pid not in helpers and os.getpgid(proc.pid) == group
                    and proc.info["status"] != psutil.STATUS_ZOMBIE and proc.ppid() not in helpers):
                found.append(proc.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found
