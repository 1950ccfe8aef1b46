"""What every launcher's world is: N ranks started once and reused, calls sent to all, per-rank
results back, a failing rank's exception re-raised with its traceback, a hung or dead rank failing
the call within its timeout with every rank's story, and nothing left behind after `close()`.

A call abandoned mid-flight (a KeyboardInterrupt from SIGINT, or any exception raised in the
parent while it waits) leaves the world "in doubt": its ranks may still be running it and their
replies may still come. The next call first drains them (the abandoned call's replies, until that
call's own deadline), and restarts the ranks instead when the call never fully went out, a rank
does not answer by then, or the drain itself is interrupted: no call is sent out of step.

Two launchers implement it: `World` (local rank processes, harness.launch.world) and `RayWorld`
(one Ray actor per rank, harness.launch.ray_world). They differ in how ranks start, how a call
reaches them and comes back, how stacks are collected and what "kill" means; the bookkeeping and
the failure reports are here, once.
"""
from __future__ import annotations

import itertools
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

import psutil

from harness.launch.errors import RankDied, RankError, RemoteTraceback, WorldStartError, WorldTimeout
from harness.report import buffer as report_buffer

DEVICES = ("cpu", "cuda")
LOG_TAIL_LINES = 30
# A world's directory (rank logs, stack dumps) under the temp dir, per launcher: World, RayWorld.
WORKDIR_PREFIXES = ("mrh-world", "mrh-rayworld")
OWNER_FILE = "owner"  # {"pid", "started"} of the process that made the directory
OWNER_START_SLACK_S = 2.0
LEGACY_MAX_AGE_S = 24 * 3600  # a directory without an owner file (an older harness) is stale after this


@dataclass
class Call:
    """One call in flight: the ranks that have not answered yet, by when they must (a failure
    shortens it to a grace), and whether the message reached every rank."""

    id: Any
    what: str
    deadline: float
    pending: set[int]
    sent: bool = False
    started: float = field(default_factory=time.monotonic)


@dataclass
class Interrupted:
    """A call a KeyboardInterrupt abandoned (SIGINT: a batch's or CI's time limit, Ctrl-C), with what each
    rank that had not answered was doing then. A run cut at its limit has no row for the test it was in, and
    its log said only that the driver was waiting for replies (1x H100, 2026-12-06: a moonlight-shape resume
    interrupted after 266 s with no clue which step it was in); the pytest plugin prints these at the end."""

    what: str
    launcher: str
    size: int
    waited_s: float
    stacks: dict[int, str]

    def describe(self, max_chars: int = 4000) -> str:
        head = (f"interrupted in {self.what} after {self.waited_s:.0f} s, waiting on ranks {sorted(self.stacks)} "
                f"of {self.size} ({self.launcher} world)")
        return "\n".join([head] + [f"--- rank {rank} was in:\n" + (stack[-max_chars:] or "(no stack dumped)")
                                   for rank, stack in sorted(self.stacks.items())])


# Every call this process saw interrupted, oldest first (read by harness.pytest_plugin.reporting).
INTERRUPTED: list[Interrupted] = []


class WorldBase:
    """`size` ranks on `device` ("cpu": gloo, "cuda": NCCL); see the module docstring."""

    launcher = "?"

    def __init__(self, size: int, device: str = "cpu", *, timeout: float = 300.0, start_timeout: float = 180.0,
                 failure_grace: float = 5.0, death_grace: float = 1.0, env: dict[str, str] | None = None,
                 echo_output: bool = True, echo_to: TextIO | None = None, spec: str | None = None):
        if size < 1:
            raise ValueError(f"world size must be >= 1, got {size}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        self.size = size
        self.device = device
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.failure_grace = failure_grace
        self.death_grace = death_grace
        from harness.backends import cpu_arithmetic
        from harness.bridge import backends, specs

        self.spec = specs.for_world(device, spec)  # the layer spec its ranks build models with
        self.bridge = backends.for_world(os.environ.get(backends.ENV))  # the bridge its ranks load models with
        # The ranks compute with the CPU kernels this process pinned, wherever they run (a Ray node
        # does not inherit this environment): harness.backends.cpu_arithmetic.
        self.env = {**cpu_arithmetic.env(), **(env or {}), specs.ENV: self.spec, backends.ENV: self.bridge}
        self.echo_output = echo_output
        self.echo_to = echo_to  # where echoed rank output goes: a file, or None for this process's stdout
        self.facts: dict[str, Any] = {}  # what rank 0 computes with (harness.launch.facts), per start
        self.starts = 0  # how many times the ranks were (re)started
        self.calls = 0  # how many calls were sent to the ranks
        self._call_ids = itertools.count()
        self._call: Call | None = None  # the call in flight; still set after run() left: in doubt
        self.abandoned = 0  # calls left in flight by an exception in this process (drained or restarted)

    # ------------------------------------------------------------------ to implement
    @property
    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def pids(self) -> list[int]:
        raise NotImplementedError

    def _start_ranks(self) -> None:
        """Start the ranks and have them join (raise on failure; the caller kills and reports)."""
        raise NotImplementedError

    def _send(self, message: tuple) -> None:
        raise NotImplementedError

    def _poll(self, pending: set[int], timeout: float) -> list[tuple[int, str, Any]]:
        """Wait up to `timeout` for news of the `pending` ranks: (rank, "reply", reply tuple),
        (rank, "died", exit code or None) or (rank, "error", traceback text); [] if none came."""
        raise NotImplementedError

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        raise NotImplementedError

    def _log_tail(self, rank: int) -> str:
        raise NotImplementedError

    def _kill(self) -> None:
        """Kill the ranks; also forget the call in flight (`_forget_call`)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "alive" if self.alive else "stopped"
        return (f"{type(self).__name__}(size={self.size}, device={self.device!r}, spec={self.spec!r}, {state}, "
                f"starts={self.starts})")

    def start(self):
        """Start the ranks (no-op when already alive) and wait until all joined."""
        if self.alive:
            return self
        self._kill()
        self.starts += 1
        try:
            self._start_ranks()
        except Exception as exc:
            self._kill()
            remote = f"\n{exc.__cause__}" if isinstance(exc.__cause__, RemoteTraceback) else ""
            raise WorldStartError(
                f"world of {self.size} {self.device} ranks ({self.launcher}) failed to start: {exc}{remote}"
            ) from exc
        except BaseException:  # interrupted mid-start: no half-started world is kept
            self._kill()
            raise
        from harness.launch.facts import rank_facts

        self.facts = self.run(rank_facts)[0]
        return self

    # ------------------------------------------------------------------ calls
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the per-rank results in rank order.

        `fn` must be picklable (a module-level function or a functools.partial of one). The first
        exception raised on any rank is re-raised here with its rank and remote traceback attached.
        """
        self._settle()
        self.start()
        try:
            payload = pickle.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(f"{fn!r} and its arguments must be picklable to run on ranks: {exc}") from exc
        call_id = next(self._call_ids)
        self.calls += 1
        timeout = self.timeout if timeout is None else timeout
        call = self._open_call(call_id, timeout, describe(fn))
        self._send((call_id, list(sys.path), payload))
        call.sent = True
        return self._collect(call, timeout)

    def _open_call(self, call_id: Any, timeout: float, what: str, sent: bool = False) -> Call:
        """Put a call in flight (before its message goes out: an interrupt may come at any point)."""
        self._call = Call(call_id, what, time.monotonic() + timeout, set(range(self.size)), sent=sent)
        return self._call

    def _forget_call(self) -> None:
        """The ranks are gone (`_kill`): nothing is in flight any more."""
        self._call = None

    def _settle(self) -> None:
        """Before a call: if the last one was abandoned mid-flight (in doubt), drain its replies
        until its own deadline, or restart the ranks (the next `start`) where that cannot be done."""
        call = self._call
        if call is None:
            return
        self.abandoned += 1
        if not call.sent:  # a rank may have half a message, or none: it cannot answer in step
            self._kill()
            return
        try:
            _, _, died, hung = self._gather(call, draining=True)
        except Exception:  # a pipe left mid-message, a reply that does not unpickle: restart
            self._kill()
            return
        except BaseException:  # interrupted again while draining: stop waiting, kill, propagate
            self._kill()
            raise
        if died or hung:
            self._kill()

    def _gather(self, call: Call, draining: bool = False) -> tuple[dict, dict, dict, set]:
        """(results, errors, died, hung) of one call: results[rank] = pickled value,
        errors[rank] = (pickled exception or None, traceback), died[rank] = exit code or None,
        hung = ranks that did not answer in time. Once a rank raised, the others get
        `failure_grace` seconds (they may be stuck waiting for it, or about to raise too); once a
        rank died, only `death_grace`: the others of a collective call are almost surely blocked on
        it, and waiting longer only delays the report (their stacks are collected after the wait).
        The call stays in flight (`self._call`) until every rank's outcome is in: whatever ends
        the wait early (an interrupt) leaves the world in doubt, for the next call to settle."""
        results: dict[int, bytes] = {}
        errors: dict[int, tuple[bytes | None, str]] = {}
        died: dict[int, int | None] = {}
        while call.pending:
            remaining = call.deadline - time.monotonic()
            if remaining <= 0:
                break
            news = self._poll(set(call.pending), remaining)
            call.pending.difference_update(rank for rank, _, _ in news)  # read: no longer in flight
            for rank, outcome, value in news:
                if outcome == "reply":
                    if self._accept(rank, value, call.id, results, errors, draining=draining):
                        continue
                elif outcome == "died":
                    died[rank] = value
                else:
                    errors[rank] = (None, value)
                grace = self.death_grace if outcome == "died" else self.failure_grace
                call.deadline = min(call.deadline, time.monotonic() + grace)  # a later failure never extends it
        if not call.pending and self._call is call:
            self._call = None  # every rank's outcome is in: the world is in step again
        return results, errors, died, set(call.pending)

    def _collect(self, call: Call, timeout: float) -> list[Any]:
        what = call.what
        try:
            results, errors, died, hung = self._gather(call)
        except KeyboardInterrupt:
            self._record_interrupt(call)
            raise
        if hung or died:
            self._fail_hard(what, timeout, hung, died, errors)
        if errors:
            self._raise_rank_error(errors, what)
        return [pickle.loads(results[r]) if results[r] is not None else None for r in range(self.size)]

    def _record_interrupt(self, call: Call) -> None:
        """What the ranks still busy in `call` were doing when it was interrupted (INTERRUPTED). The world
        stays in doubt as before: the next call drains the replies or restarts the ranks."""
        pending = sorted(call.pending)
        try:
            stacks = self._stacks(pending) if pending else {}
        except Exception as exc:  # a rank gone mid-dump: say so rather than mask the interrupt
            stacks = {}
            note = f"(no stack: {type(exc).__name__}: {exc})"
        else:
            note = "(no stack dumped)"
        INTERRUPTED.append(Interrupted(call.what, self.launcher, self.size, time.monotonic() - call.started,
                                       {rank: stacks.get(rank) or note for rank in pending}))

    def _accept(self, rank: int, reply: tuple, call_id: Any, results: dict, errors: dict,
                draining: bool = False) -> bool:
        """File one rank's reply; True when it is a success. A drained reply (of an abandoned
        call) has its output echoed but its report rows dropped: no test asked for them."""
        from harness.launch.errors import WorldError

        reply_id, status, payload, tb, output, rows = reply
        if reply_id != call_id:
            self._kill()  # out of step: no later call could trust its replies
            raise WorldError(f"rank {rank} answered call {reply_id!r}, expected {call_id!r}; world torn down")
        self._echo(rank, output)
        if not draining:
            report_buffer.extend([{**row, "rank": rank} for row in rows])
        if status == "ok":
            results[rank] = payload
            return True
        errors[rank] = (payload, tb)
        return False

    def _echo(self, rank: int, output: str) -> None:
        if output and self.echo_output:
            for line in output.rstrip("\n").split("\n"):
                print(f"[rank{rank}] {line}", file=self.echo_to)

    # ------------------------------------------------------------------ failures
    def _raise_rank_error(self, errors: dict[int, tuple[bytes | None, str]], what: str) -> None:
        rank = min(errors)  # deterministic: the lowest failing rank
        payload, tb = errors[rank]
        others = sorted(set(errors) - {rank})
        note = f"raised on rank {rank} of {self.size} ({self.device}) in {what}"
        if others:
            note += f"; ranks {others} failed too"
        if payload is None:
            raise RankError(f"{note}:\n{tb}", rank)
        exc = pickle.loads(payload)
        exc.add_note(note)
        raise exc from RemoteTraceback(f"\n--- rank {rank} traceback ---\n{tb}")

    def _fail_hard(self, what, timeout, hung, died, errors) -> None:
        """A rank died or hung: gather every rank's story, tear the world down, raise."""
        stacks = self._stacks(sorted(hung))
        sections = []
        for rank in range(self.size):
            if rank in died:
                story = f"died with exit code {died[rank]}"
            elif rank in hung:
                story = "still running; its Python stack:\n" + (stacks.get(rank) or "(no stack dumped)")
            elif rank in errors:
                story = "raised:\n" + errors[rank][1]
            else:
                story = "finished"
            sections.append(f"--- rank {rank}: {story}\n{self._log_tail(rank)}")
        detail = "\n".join(sections)
        self._kill()
        if died:
            rank = min(died)
            raise RankDied(f"rank {rank} died (exit code {died[rank]}) during {what}\n{detail}", rank, died[rank])
        if errors:
            self._raise_rank_error(errors, what + " (other ranks hung after it; world restarted)")
        raise WorldTimeout(
            f"{what} timed out after {timeout:.1f}s on ranks {sorted(hung)} of {self.size}; "
            f"world torn down, the next call starts a fresh one\n{detail}",
            sorted(hung),
        )


def make_workdir(prefix: str) -> str:
    """A new world directory under the temp dir, naming this process as its owner; first removes
    the directories that killed jobs left behind (only `close()` removes a world's own)."""
    sweep_stale_workdirs()
    path = tempfile.mkdtemp(prefix=prefix)
    me = psutil.Process()
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        # The start time tells the owner from a later process that got its pid.
        json.dump({"pid": me.pid, "started": me.create_time()}, f)
    return path


def sweep_stale_workdirs() -> None:
    """Remove this user's world directories in the temp dir whose owner is dead."""
    for entry in os.scandir(tempfile.gettempdir()):
        if entry.name.startswith(WORKDIR_PREFIXES) and _own_directory(entry) and _stale(entry.path):
            shutil.rmtree(entry.path, ignore_errors=True)  # another world's sweep may be at it too


def _own_directory(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid()
    except OSError:  # removed meanwhile by another world's sweep
        return False


def _stale(path: str) -> bool:
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            owner = json.load(f)
        pid, started = int(owner["pid"]), float(owner["started"])
    except (OSError, ValueError, KeyError, TypeError):
        # No owner (an older harness) or one being written right now: judge by age alone.
        return time.time() - _last_modified(path) > LEGACY_MAX_AGE_S
    return not _running(pid, started)


def _running(pid: int, started: float) -> bool:
    try:
        proc = psutil.Process(pid)
        # psutil derives a start time from the boot time, which a clock step may shift a little;
        # a pid reused within seconds of its first owner's start is not a real case.
        same = abs(proc.create_time() - started) < OWNER_START_SLACK_S
        return same and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # someone's live process we may not inspect: keep its directory
        return True


def _last_modified(path: str) -> float:
    """The newest mtime of the directory and its files (a rank log keeps growing in a live world)."""
    try:
        return max([os.path.getmtime(path)] + [e.stat().st_mtime for e in os.scandir(path)])
    except OSError:  # removed meanwhile
        return time.time()


def tail(text: str) -> str:
    """The last lines of a rank's log, indented for a failure report."""
    lines = text.rstrip("\n").split("\n")[-LOG_TAIL_LINES:] if text else []
    return "".join(f"    | {line}\n" for line in lines)


def describe(fn: Callable[..., Any]) -> str:
    """How failures name a call: `fn.mrh_name` when a wrapper set one, else the function's path."""
    named = getattr(fn, "mrh_name", None)
    if named:
        return named
    inner = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}"
