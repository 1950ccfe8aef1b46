"""Named fault points in the save path, for crash injection, reached for certain on any machine.

The save path calls `fault(point, iteration)` at each step whose interruption leaves a different
state on disk. Nothing happens unless a `FaultPlan` is active: set in the environment
(`MRH_CKPT_FAULT`, JSON) so that the parent, the rank processes and their forked writers all see
it. A plan names one point, the iteration of the save it applies to, the rank (None: any process),
what to do there, and a log file every process involved appends its records to:

- "kill": SIGKILL every process of this session (the whole training job: the driver, its ranks,
  their writers and queue servers), itself last. One process kills: the first to reach the point
  (a claim file beside the log); any other that reaches it meanwhile waits to be killed. Only inside the session the plan was made for,
  so a plan leaked into another process can never kill a test runner (`session` must equal
  `os.getsid(0)`).
- "kill-driver": SIGKILL the session's leader only (the driver; the OOM killer's shape): its ranks
  must notice and take their writers down themselves.
- "raise": raise `InjectedFault` (an OSError, as a full disk would) at the point.
- "hold": stay at the point (a write held in flight) until released (below), then go on.

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

Why "held": every point but one is reached by the process that drives the save, so acting there
is deterministic. `shard-writes` is reached in a writer process, concurrently with the trainer,
which goes on training, writing a tracker, rotating, while the write is in flight. A kill fired in
the writer lands wherever the trainer happens to be: on a fast machine before the trainer's
rotation, so a variant that deletes too early did not show (issue 23's flaky
`delete-before-finalize`). So at a concurrent point (`CONCURRENT`) the writer records that it is
there and holds; the rank that next waits for that save's writes records so (`awaiting_writes`,
just before it blocks: an async finalize, or a sync save's join), and only then does the held
writer act: "kill" and "kill-driver" fire, "hold" goes on. The kill therefore lands at the latest
instant the write is still in flight, with everything the trainer does meanwhile done, on any
machine at any speed. Each record is a JSON line in the plan's `log` (the crash trial's event
file): "fault-reached" (who reached the point), "fault-awaited" (the trainer waits for the writes);
a trial whose point was never reached is an error, not a pass (harness.checkpoint.crash).
"""
from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "MRH_CKPT_FAULT"
POINTS = ("before-staging", "shard-writes", "writes-done", "metadata-written", "manifest-write",
          "before-commit", "tracker-rename", "before-rotation", "rotation-delete")
CONCURRENT = ("shard-writes",)  # reached in a writer, while the trainer goes on (module docstring)
ACTIONS = ("kill", "kill-driver", "raise", "hold")
_POLL_S = 0.01


class InjectedFault(OSError):
    """Raised at a fault point by a plan with action "raise"."""


@dataclass(frozen=True)
class FaultPlan:
    point: str
    iteration: int  # the save (by iteration) it applies to
    action: str = "kill"
    rank: int | None = None  # None: whichever process reaches the point
    session: int | None = None  # for the kills: the session id they may kill
    log: str | None = None  # the records file (module docstring); needed by the kills and "hold"

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; choose from {', '.join(POINTS)}")
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; choose from {ACTIONS}")
        if self.action == "hold" and self.point not in CONCURRENT:
            raise ValueError(f"'hold' holds a write in flight: only at {CONCURRENT}, not {self.point!r} "
                             "(the process there drives the save; holding it would hold the trainer)")

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


# ------------------------------------------------------------------------------------- records
def append_record(log: str | os.PathLike, **fields) -> None:
    """One JSON line (O_APPEND: lines of concurrent writers never interleave); the page cache
    survives SIGKILL, so a flush suffices."""
    with open(log, "a") as handle:
        handle.write(json.dumps({**fields, "t": time.monotonic()}) + "\n")
        handle.flush()


def read_records(log: str | os.PathLike) -> list[dict]:
    """The log's records (a line cut by a kill is skipped)."""
    path = Path(log)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records


def _awaited(plan: FaultPlan) -> bool:
    """The trainer waits for this save's writes (or the plan's log is gone: its test is over)."""
    if not Path(plan.log).exists():
        return True
    return any(r.get("event") == "fault-awaited" and r.get("iteration") == plan.iteration
               for r in read_records(plan.log))


# ------------------------------------------------------------------------------------- the points
def fault(point: str, iteration: int | None, *, rank: int | None = None) -> None:
    """Act on the active plan if it names this point and iteration (and rank, if it names one)."""
    plan = active_plan()
    if plan is None or plan.point != point or plan.iteration != iteration:
        return
    if plan.rank is not None and plan.rank != (rank if rank is not None else _rank()):
        return
    if plan.log:
        append_record(plan.log, event="fault-reached", point=point, iteration=iteration, pid=os.getpid(),
                      rank=_rank())
    if plan.action == "raise":
        raise InjectedFault(f"injected fault at {point} (save of iteration {iteration})")
    if point in CONCURRENT:  # hold until the trainer waits for this write (module docstring)
        if not plan.log:
            raise RuntimeError(f"a {plan.action!r} plan at {point} needs a log to be released through")
        while not _awaited(plan):
            time.sleep(_POLL_S)
    if plan.action == "kill":
        if _claim_the_kill(plan):
            kill_session(plan.session)
        else:
            _await_the_killer(plan)
    elif plan.action == "kill-driver":
        kill_driver(plan.session)


KILLER_WAIT_S = 60.0  # far beyond a kill_session's few listings; only a broken killer runs it out


def _claim_the_kill(plan: FaultPlan) -> bool:
    """Whether this process is the one to kill the session: the first to create the plan's claim
    file (O_EXCL: exactly one process wins). Needed because every rank of a sync save reaches a
    rank-side point at about the same instant: two concurrent killers could SIGKILL each other
    before either reached the processes later in the listing (a rank's write-results Manager, in
    its own process group, lived on: stack B nightly at 8990971, 75 of 100 trials of two ranks
    started on one instant in a reproduction)."""
    if plan.session is None or os.getsid(0) != plan.session:
        raise RuntimeError(f"refusing to kill session {plan.session}: this process is in session {os.getsid(0)}")
    if not plan.log:
        raise RuntimeError("a 'kill' plan needs a log: its claim file sits beside it")
    try:
        handle = os.open(f"{plan.log}.killer", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(handle, str(os.getpid()).encode())
    os.close(handle)
    return True


def _await_the_killer(plan: FaultPlan) -> None:
    """Another process claimed the kill: wait for its SIGKILL instead of racing it."""
    append_record(plan.log, event="fault-deferred", pid=os.getpid(), rank=_rank())
    deadline = time.monotonic() + KILLER_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(_POLL_S)
    raise RuntimeError(f"the process that claimed the kill of session {plan.session} "
                       f"({Path(f'{plan.log}.killer').read_text()}) did not kill this one within {KILLER_WAIT_S:.0f}s")


def awaiting_writes(iteration: int | None) -> None:
    """Rank side, just before it blocks on the writes of the save of `iteration`: releases a
    writer held at a concurrent point (module docstring). No-op without such a plan."""
    plan = active_plan()
    if plan is None or plan.point not in CONCURRENT or plan.iteration != iteration or not plan.log:
        return
    append_record(plan.log, event="fault-awaited", iteration=iteration, pid=os.getpid(), rank=_rank())


# ------------------------------------------------------------------------------------- killing
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


PF_EXITING = 0x4  # the kernel's task flag: do_exit has begun (include/linux/sched.h)


def dying(pid: int) -> bool:
    """`pid` is on its way out: a SIGKILL pending, or exiting (PF_EXITING), or its memory already
    let go. Under load, or while the kernel finishes its disk writes, a killed process can take
    seconds to go; once it has taken the SIGKILL off its pending set it shows only as exiting
    (a stress run at 8f9615e counted such a writer, its exit held up for over 10 s, as a survivor)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        with open(f"/proc/{pid}/stat") as handle:
            flags = stat_flags(handle.read())
    except OSError:
        return True  # gone
    pending = int(fields.get("SigPnd", "0").strip(), 16) | int(fields.get("ShdPnd", "0").strip(), 16)
    return bool(pending & (1 << (signal.SIGKILL - 1)) or flags & PF_EXITING) or fields.get("VmSize") is None


def stat_flags(stat: str) -> int:
    """The task flags of a /proc/PID/stat line (its 9th field; the command name, 2nd, is in
    parentheses and may hold spaces and parentheses itself)."""
    return int(stat[stat.rindex(")") + 1:].split()[6])


def kill_session(session: int | None, *, include_self: bool = True, within_s: float = 30.0) -> int:
    """SIGKILL every process of `session`, again until every one left is dying (a process may
    fork while we kill: its child is in the next listing); returns how many were killed. Refuses
    a session this process is not in."""
    if session is None or os.getsid(0) != session and include_self:
        raise RuntimeError(f"refusing to kill session {session}: this process is in session {os.getsid(0)}")
    me, killed = os.getpid(), 0
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        others = [pid for pid in session_pids(session) if pid != me and not dying(pid)]
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


def kill_driver(session: int | None) -> None:
    """SIGKILL the leader of `session` (the crash trial's driver: its pid is the session id), from
    inside that session only."""
    if session is None or os.getsid(0) != session:
        raise RuntimeError(f"refusing to kill the leader of session {session}: this process is in "
                           f"session {os.getsid(0)}")
    os.kill(session, signal.SIGKILL)


# ------------------------------------------------------------------------------------- in a test
def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


class injected:
    """`with injected(world, plan) as active:` the plan is active in this process and on every rank
    of `world` (and so in the writers they fork) for the duration, with a log of its own unless
    the plan names one (`active.log`, `reached()`). "raise" and "hold" only: a kill belongs in a job
    of its own session (harness.checkpoint.crash). A held write goes on when the trainer waits for
    it (a finalize, or the next save)."""

    def __init__(self, world, plan: FaultPlan):
        if plan.action in ("kill", "kill-driver"):
            raise ValueError("a kill plan runs only in a crash trial's own session (harness.checkpoint.crash)")
        self.world, self._tmp = world, None
        if plan.log is None:
            self._tmp = tempfile.NamedTemporaryFile(prefix="mrh-fault-", suffix=".jsonl", delete=False)
            self._tmp.close()
            plan = FaultPlan(**{**asdict(plan), "log": self._tmp.name})
        self.plan = plan

    def release(self) -> None:
        """Let a write held at the plan's point go on now, before the trainer waits for it."""
        append_record(self.plan.log, event="fault-awaited", iteration=self.plan.iteration)

    def reached(self) -> list[dict]:
        """The "fault-reached" records so far."""
        return [r for r in read_records(self.plan.log) if r.get("event") == "fault-reached"]

    def __enter__(self) -> "injected":
        self.before = os.environ.get(ENV)
        _set_env(ENV, self.plan.to_env())
        self.world.run(_set_env, ENV, self.plan.to_env())
        return self

    def __exit__(self, *exc) -> None:
        self.release()  # a writer still held goes on: the plan is over
        _set_env(ENV, self.before)
        if self.world.alive:
            self.world.run(_set_env, ENV, None)
        if self._tmp is not None:
            Path(self._tmp.name).unlink(missing_ok=True)
