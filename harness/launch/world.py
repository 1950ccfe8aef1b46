"""The parent side of the persistent world: N rank processes started once, reused by every call.

Follows torch's `MultiProcContinuousTest`: workers live across tests, a call is sent to all ranks,
per-rank results come back, and a worker's exception is re-raised in the parent with its rank and
traceback. A call that outlives its timeout, or a rank that dies, collects every live rank's Python
stack (faulthandler on SIGUSR1), tears the world down and leaves it to be started fresh.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import shutil
import signal
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, TextIO

from harness.launch import forkserver
from harness.launch.base import DEVICES, WorldBase, make_workdir, tail
from harness.launch.errors import WorldStartError
from harness.launch.rank import STACK_SIGNAL, RankSpec, _read_from, rank_main

__all__ = ["DEVICES", "START_METHODS", "World", "cuda_started_here"]
# spawn: each rank imports everything afresh (safe anywhere; the CPU default). fork: ranks start in
# a fraction of a second from a parent that has imported torch and megatron-core but run nothing;
# on CUDA only from a parent that never started CUDA (`cuda_started_here`); the crash-injection
# driver (harness.checkpoint.crash) starts a world per trial this way. forkserver (the CUDA default):
# ranks fork from this process's preloaded forkserver (harness.launch.forkserver), which never starts
# CUDA, whatever this process did: a spawned CUDA rank spends 15-20 s importing torch, megatron-core
# and Transformer Engine (H100 host), a forked one starts in ~1 s.
START_METHODS = ("spawn", "fork", "forkserver")
_live_worlds: "weakref.WeakSet[World]" = weakref.WeakSet()  # killed at exit: no orphan ranks


class World(WorldBase):
    """A persistent group of `size` rank processes on `device` ("cpu": gloo, "cuda": NCCL).

    >>> with World(2) as world:
    ...     world.run(torch.distributed.get_rank)
    [0, 1]
    """

    launcher = "process"
    DEATH_POLL_S = 1.0  # how often a call in flight checks each rank's exit status (`_poll`)

    def __init__(
        self,
        size: int,
        device: str = "cpu",
        *,
        timeout: float = 300.0,
        start_timeout: float = 180.0,
        failure_grace: float = 5.0,
        death_grace: float = 1.0,
        env: dict[str, str] | None = None,
        echo_output: bool = True,
        echo_to: TextIO | None = None,
        start_method: str | None = None,
        spec: str | None = None,
    ):
        start_method = start_method or ("forkserver" if device == "cuda" else "spawn")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        if device == "cuda" and start_method == "fork":
            os.environ[forkserver.NVML_CHECK] = "1"  # counting the GPUs below must not start CUDA here
            if cuda_started_here():
                raise ValueError("a cuda world forks its ranks only from a process that has not started CUDA "
                                 "(CUDA does not survive a fork); use spawn")
        super().__init__(size, device, timeout=timeout, start_timeout=start_timeout, failure_grace=failure_grace,
                         death_grace=death_grace, env=env, echo_output=echo_output, echo_to=echo_to, spec=spec)
        if device == "cuda":
            _require_gpus(size)
        self.start_method = start_method
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Any] = []
        self._store = None
        self._workdir: str | None = None
        _live_worlds.add(self)

    # ----------------------------------------------------------------- lifecycle
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def workdir(self) -> str | None:
        return self._workdir

    def _start_ranks(self) -> None:
        import torch.distributed as dist

        self._workdir = make_workdir(f"mrh-world{self.size}-{self.device}-")
        self._store = dist.TCPStore(  # port 0: the OS picks a free port, no race between workers
            "127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=self.start_timeout),
        )
        # A forkserver's child has the forkserver's environment and parent: hand it ours, and let it
        # watch the forkserver, which exits when this process does (harness.launch.forkserver).
        served = self.start_method == "forkserver"
        ctx = forkserver.context() if served else mp.get_context(self.start_method)
        env = {**os.environ, **self.env} if served else self.env
        parent_pid = None if served else os.getpid()
        for rank in range(self.size):
            parent_conn, child_conn = ctx.Pipe()
            spec = RankSpec(
                rank=rank, world_size=self.size, device=self.device, store_host="127.0.0.1",
                store_port=self._store.port, workdir=self._workdir, parent_pid=parent_pid,
                pg_timeout_s=max(self.timeout, self.start_timeout), env=env,
            )
            # Not daemonic: a rank may start helpers of its own (the dist-ckpt writer does).
            proc = ctx.Process(target=rank_main, args=(spec, child_conn), name=f"mrh-rank{rank}")
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self._collect(self._open_call("start", self.start_timeout, "start", sent=True), self.start_timeout)

    def close(self) -> None:
        """Stop every rank (orderly if possible) and remove the world's files. A world left in doubt
        by an abandoned call is killed outright: its ranks would see the stop only after that call."""
        if self._call is None:
            for conn in self._conns:
                try:
                    conn.send(None)
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + 10.0
            for proc in self._procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        """Kill every rank's process group (the rank and anything it started) and reap it."""
        self._forget_call()
        for proc in self._procs:
            if proc.pid is None:
                continue
            for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: os.kill(proc.pid, signal.SIGKILL)):
                try:
                    kill()
                except (ProcessLookupError, PermissionError):
                    pass
            proc.join(timeout=10.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None
        if self._workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    # ----------------------------------------------------------------- calls
    def _send(self, message: tuple) -> None:
        for conn in self._conns:
            conn.send(message)

    def _poll(self, pending: set[int], timeout: float) -> list[tuple[int, str, Any]]:
        waitables = {self._conns[r]: r for r in pending}
        waitables.update({self._procs[r].sentinel: r for r in pending})
        news: dict[int, tuple[int, str, Any]] = {}
        # A slice at a time: a rank's pipe and sentinel stay open after its death while a process it forked
        # lives on (the dist-ckpt writer's `Manager`, forked mid-save, holds both): an OOM-killed rank was a
        # 1200 s "hang" (CPU tier, 2026-12-08). Its exit status (waitpid) tells the death at once.
        for ready in wait(list(waitables), timeout=min(timeout, self.DEATH_POLL_S)):
            rank = waitables[ready]
            if rank in news:  # its pipe and its sentinel both fired
                continue
            reply = self._receive(rank)
            if reply is not None:
                news[rank] = (rank, "reply", reply)
            else:  # its sentinel fired: the process is gone
                self._procs[rank].join(timeout=1.0)
                news[rank] = (rank, "died", self._procs[rank].exitcode)
        for rank in pending - set(news):
            if self._procs[rank].exitcode is not None:  # gone, its pipe held open by a descendant
                reply = self._receive(rank)  # a reply it sent before dying still counts
                news[rank] = (rank, "reply", reply) if reply is not None else \
                    (rank, "died", self._procs[rank].exitcode)
        return list(news.values())

    def _receive(self, rank: int) -> tuple | None:
        """The rank's reply, or None when its pipe is closed (the process is gone)."""
        try:
            return self._conns[rank].recv() if self._conns[rank].poll() else None
        except (EOFError, OSError):
            return None

    # ----------------------------------------------------------------- failures
    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        return self._dump_stacks(ranks)

    def _dump_stacks(self, ranks: list[int], wait_s: float = 3.0) -> dict[int, str]:
        if not ranks or not self._workdir:
            return {}
        sizes = {r: _size(self._stack_path(r)) for r in ranks}
        for rank in ranks:
            try:
                os.kill(self._procs[rank].pid, STACK_SIGNAL)
            except ProcessLookupError:
                pass
        # faulthandler writes from a signal handler: wait until each file stops growing.
        deadline = time.monotonic() + wait_s
        last = dict(sizes)
        settled: set[int] = set()
        while time.monotonic() < deadline and len(settled) < len(ranks):
            time.sleep(0.2)
            for rank in ranks:
                size = _size(self._stack_path(rank))
                if size > sizes[rank] and size == last[rank]:
                    settled.add(rank)
                last[rank] = size
        return {r: _read_from(self._stack_path(r), sizes[r]) for r in ranks}

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._workdir or "", f"rank{rank}.stack")

    def _log_tail(self, rank: int) -> str:
        return tail(_read_from(os.path.join(self._workdir or "", f"rank{rank}.log"), 0))


def cuda_started_here() -> bool:
    """Whether this process has initialized the CUDA driver (cuInit), after which a forked child
    cannot use CUDA. The driver library answers without starting anything: cuDeviceGetCount
    returns CUDA_ERROR_NOT_INITIALIZED (3) until cuInit."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False  # no CUDA driver on this machine: nothing can have started
    count = ctypes.c_int()
    return driver.cuDeviceGetCount(ctypes.byref(count)) != 3


def _require_gpus(size: int) -> None:
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < size:
        raise WorldStartError(f"a cuda world of {size} ranks needs {size} GPUs; this machine has {found}")


def _kill_live_worlds() -> None:
    for world in list(_live_worlds):
        world._kill()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


atexit.register(_kill_live_worlds)
