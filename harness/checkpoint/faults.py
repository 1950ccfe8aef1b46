"""Named fault points in the save path, for crash injection.

The save path calls `fault(point, iteration)` at each step whose interruption leaves a different
state on disk. Nothing happens unless a `FaultPlan` is active: set in the environment
(`MRH_CKPT_FAULT`, JSON) so that the parent, the rank processes and their forked writers all see
it. A plan names one point, the iteration of the save it applies to, the rank (None: any process)
and what to do there:

- "kill": SIGKILL every process of this session (the whole training job: the driver, its ranks,
  their writers and queue servers), itself last. Only inside the session the plan was made for,
  so a plan leaked into another process can never kill a test runner (`session` must equal
  `os.getsid(0)`).
- "raise": raise `InjectedFault` (an OSError, as a full disk would) at the point.
- "delay": sleep `seconds` there (to hold a write in flight).

The points, in the order a save passes them (`POINTS`):
  before-staging    rank side, before megatron-core stages anything
  shard-writes      a writer process, after its first item is written (the others mid-way)
  writes-done       rank side, every writer joined, before megatron-core's finalize (.metadata)
  metadata-written  parent, megatron-core finalized on every rank, before our manifest
  manifest-write    parent, half of the manifest's temp file written
  before-commit     parent, manifest and every file fsynced, before the rename into place
  tracker-rename    parent, the tracker's temp file written and fsynced, before its rename
  before-rotation   parent, the tracker names the new checkpoint, before old ones are deleted
  rotation-delete   parent, an old checkpoint renamed aside and partly deleted
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass

ENV = "MRH_CKPT_FAULT"
POINTS = ("before-staging", "shard-writes", "writes-done", "metadata-written", "manifest-write",
          "before-commit", "tracker-rename", "before-rotation", "rotation-delete")
ACTIONS = ("kill", "raise", "delay")


class InjectedFault(OSError):
    """Raised at a fault point by a plan with action "raise"."""


@dataclass(frozen=True)
class FaultPlan:
    point: str
    iteration: int  # the save (by iteration) it applies to
    action: str = "kill"
    rank: int | None = None  # None: whichever process reaches the point
    seconds: float = 0.0  # for "delay"
    session: int | None = None  # for "kill": the session id it may kill

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; choose from {', '.join(POINTS)}")
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; choose from {ACTIONS}")

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> "FaultPlan":
        return cls(**json.loads(text))


_plan_cache: tuple[str | None, FaultPlan | None] = (None, None)


def active_plan() -> FaultPlan | None:
    global _plan_cache
    text = os.environ.get(ENV)
    if text != _plan_cache[0]:
        _plan_cache = (text, FaultPlan.from_env(text) if text else None)
    return _plan_cache[1]


def _rank() -> int | None:
    value = os.environ.get("RANK")
    return int(value) if value is not None else None


def fault(point: str, iteration: int | None, *, rank: int | None = None) -> None:
    """Act on the active plan if it names this point and iteration (and rank, if it names one)."""
    plan = active_plan()
    if plan is None or plan.point != point or plan.iteration != iteration:
        return
    if plan.rank is not None and plan.rank != (rank if rank is not None else _rank()):
        return
    if plan.action == "delay":
        time.sleep(plan.seconds)
    elif plan.action == "raise":
        raise InjectedFault(f"injected fault at {point} (save of iteration {iteration})")
    else:
        kill_session(plan.session)


def session_pids(session: int) -> list[int]:
    """Every live process of `session` (psutil; zombies excluded)."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) == session:
                pids.append(proc.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return pids


def kill_session(session: int | None, *, include_self: bool = True, passes: int = 5) -> int:
    """SIGKILL every process of `session` (again until none is left: a process may fork while
    we kill); returns how many were killed. Refuses a session this process is not in."""
    if session is None or os.getsid(0) != session and include_self:
        raise RuntimeError(f"refusing to kill session {session}: this process is in session {os.getsid(0)}")
    me, killed = os.getpid(), 0
    for _ in range(passes):
        others = [pid for pid in session_pids(session) if pid != me]
        if not others:
            break
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    if include_self and os.getsid(0) == session:
        os.kill(me, signal.SIGKILL)
    return killed


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


class injected:
    """`with injected(world, plan):` the plan is active in this process and on every rank of
    `world` (and so in the writers they fork) for the duration. Only "raise" and "delay": a
    "kill" belongs in a job of its own session (harness.checkpoint.crash)."""

    def __init__(self, world, plan: FaultPlan):
        if plan.action == "kill":
            raise ValueError("a kill plan runs only in a crash trial's own session (harness.checkpoint.crash)")
        self.world, self.plan = world, plan

    def __enter__(self) -> FaultPlan:
        self.before = os.environ.get(ENV)
        _set_env(ENV, self.plan.to_env())
        self.world.run(_set_env, ENV, self.plan.to_env())
        return self.plan

    def __exit__(self, *exc) -> None:
        _set_env(ENV, self.before)
        if self.world.alive:
            self.world.run(_set_env, ENV, None)
