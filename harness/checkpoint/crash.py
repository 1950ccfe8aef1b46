"""Crash injection: SIGKILL a whole training job during its saves, then judge what it left.

A trial runs a training job in its own session: a driver process (the trainer's parent side,
started from a forkserver that has imported torch and megatron-core, then `setsid`) with its own
world of rank processes forked from the driver (which never starts CUDA: on CUDA too, each rank
then starts in ~1 s instead of 15-20 s of imports). The job trains
`CrashConfig.steps` steps of the resume-check policy and saves after each through a `Checkpointer`
(sync or async, `keep`). The job dies in one of three ways:

- at a named fault point (harness.checkpoint.faults) of the save of `FAULT_ITERATION`: the process
  that reaches it SIGKILLs every process of the session, itself last (at `shard-writes`, a point
  reached in a writer, once the trainer waits for that write: the faults module says why). The
  point is reached for certain: a job that never reached it is an error (`FaultNotReached`);
- the same with action "kill-driver": only the driver is SIGKILLed, as the OOM killer would, while
  the write is in flight; its ranks must take their writers down themselves (each rank kills its
  process group when its parent is gone);
- at a seeded random time after training started (`kill_after` seconds): this process SIGKILLs
  the session. The instant it hits depends on the machine's speed, so it samples states between
  the named points; what it must leave holds at every instant, so its verdict does not.

`judge` then checks what the issue asks of every crash, as report rows:
  (a) the tracker, if present, names a complete checkpoint, and every save the job saw finalized
      is covered by it (`tracker_names_incomplete`, `finalized_not_tracked`);
  (b) once a save has finalized there is a complete checkpoint (`finalized_but_none_complete`);
  (c) a fresh process resumes from the newest complete one (`resumed_not_newest`) and its next step
      equals the uninterrupted run's bit for bit (`loss_rel_diff`, `grad_norm_rel_diff`,
      `param_max_abs_diff`, the resume table's same-layout bounds);
  (d) no process of the job is left (`orphan_processes`).
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.checkpoint.faults import (ENV, FaultPlan, append_record, dying, kill_session, read_records,
                                      session_pids)
from harness.checkpoint.resume_check import MODEL as _DEFAULT_MODEL
from harness.launch import forkserver

FAULT_ITERATION = 3  # the save a named fault point applies to: two saves exist before it, and
# rotation runs in it at keep=1 and keep=2


@dataclass(frozen=True)
class CrashConfig:
    async_save: bool
    keep: int
    layout: str = "dp2"
    steps: int = 3  # one save after each step: iterations 1..steps (the fault points: the last save)
    device: str = "cpu"
    variant: str | None = None
    dtype: str = "fp32"
    spec: str = "local"  # the layer spec of the job's models (harness.bridge.specs)
    model: str = _DEFAULT_MODEL  # the zoo model it trains (a MoE model too: suites/moe/test_checkpoint.py)

    @property
    def name(self) -> str:
        mode = "async" if self.async_save else "sync"
        return (f"{mode}-keep{self.keep}" + ("" if self.dtype == "fp32" else f"-{self.dtype}")
                + (f"-{self.variant}" if self.variant else "") + ("" if self.model == _DEFAULT_MODEL else f"-{self.model}"))

    @property
    def policy_config(self) -> dict[str, Any]:
        from harness.checkpoint.resume_check import CONFIG

        return {**CONFIG, "dtype": self.dtype, "deterministic": True}  # bit-exact resumes on CUDA


@dataclass
class Outcome:
    """What a trial left: the driver's events, how it ended, and who survived the kill."""

    config: CrashConfig
    root: Path
    how: str  # "point:<name>", "driver-only:<name>", "random:<seconds>", "none"
    events: list[dict[str, Any]]
    exitcode: int | None
    orphans: list[str] = field(default_factory=list)  # "pid cmdline" of processes left behind
    killed_at: float | None = None  # seconds after training started

    @property
    def finalized(self) -> list[int]:
        return [e["iteration"] for e in self.events if e["event"] == "finalized"]

    @property
    def completed(self) -> bool:
        return any(e["event"] == "done" for e in self.events)

    @property
    def crashed(self) -> bool:
        return not self.completed

    def reached(self, point: str) -> bool:
        """Some process of the job reached fault point `point` (of the save of FAULT_ITERATION)."""
        return any(e["event"] == "fault-reached" and e["point"] == point for e in self.events)

    @property
    def error(self) -> str | None:
        """The traceback of a job that failed on its own (not killed)."""
        return next((e["error"] for e in self.events if e["event"] == "error"), None)


# ----------------------------------------------------------------------------------- the driver
_event = append_record  # the driver's events and the fault points' records share one file


def _drive(config: dict[str, Any], root: str, events: str, plan: dict[str, Any] | None) -> None:
    """The training job (runs in the trial's own session)."""
    os.setsid()
    import faulthandler

    from harness.launch.rank import STACK_SIGNAL
    from harness.launch.world import World

    # A hung trial is reported with the driver's stack (and its ranks', from their world's files).
    faulthandler.register(STACK_SIGNAL, file=open(f"{events}.driver-stack", "ab", buffering=0), all_threads=True,
                          chain=False)
    from harness.parallel.state import as_layout

    cfg = CrashConfig(**config)
    if cfg.device == "cpu":  # before anything here asks CUDA: the ranks it forks inherit that
        from harness.launch.rank import hide_gpus

        hide_gpus()
    env = {}
    if plan is not None:  # the fault points record into the event file (harness.checkpoint.faults)
        env[ENV] = FaultPlan(**{**plan, "session": os.getsid(0), "log": events}).to_env()
        os.environ[ENV] = env[ENV]  # the parent-side points
    from harness.launch.world import cuda_started_here

    # Fork the ranks: this driver imported everything (the forkserver's preload) and never started
    # CUDA (the forkserver counts GPUs through NVML). Spawn only if something here started CUDA.
    fork = cfg.device == "cpu" or not cuda_started_here()
    world = World(as_layout(cfg.layout).world_size, cfg.device, env=env, echo_output=False,
                  start_method="fork" if fork else "spawn", spec=cfg.spec)
    try:
        _train_and_save(cfg, world, root, events)
    except BaseException as exc:  # the job failed without a crash: say so, leave no rank behind
        import traceback

        text = "".join(traceback.format_exception(exc))  # a rank's traceback comes first (the cause)
        _event(events, event="error", error=text if len(text) < 12000 else f"{text[:8000]}\n[...]\n{text[-4000:]}")
        raise
    finally:
        world.close()


def _train_and_save(cfg: CrashConfig, world, root: str, events: str) -> None:
    from harness.checkpoint.checkpointer import Checkpointer
    from harness.checkpoint.resume_check import train_batch
    from harness.training.handles import PolicyHandle

    world.start()
    policy = PolicyHandle(world, cfg.layout, cfg.model, **cfg.policy_config)
    ckpt = Checkpointer(policy, root, keep=cfg.keep, async_save=cfg.async_save, variant=cfg.variant)
    _event(events, event="ready", pid=os.getpid(), ranks=world.pids, workdir=world.workdir)
    reported = 0

    def report_finalized() -> None:
        nonlocal reported
        for record in ckpt.history[reported:]:
            _event(events, event="finalized", iteration=record.iteration, blocking_s=record.blocking_s,
                   total_s=record.total_s, deleted=record.deleted)
        reported = len(ckpt.history)

    for step in range(cfg.steps):
        stats = policy.step(train_batch(step))
        _event(events, event="step", step=step + 1, loss=stats["loss"], grad_norm=stats["grad_norm"])
        ckpt.maybe_finalize()
        report_finalized()
        _event(events, event="save", iteration=step + 1)
        ckpt.save()
        report_finalized()
    ckpt.close()
    report_finalized()
    _event(events, event="done", writers=ckpt.writers())
    policy.close()


# ----------------------------------------------------------------------------------- a trial
_read_events = read_records


class FaultNotReached(RuntimeError):
    """A trial's job ended without reaching its fault point: the trial proves nothing."""


def _describe(pid: int) -> str:
    import psutil

    try:  # parent and group name the survivor: a rank (group = itself) or what a rank started
        proc = psutil.Process(pid)
        return f"{pid} (parent {proc.ppid()}, group {os.getpgid(pid)}) {' '.join(proc.cmdline())[:160]}"
    except (psutil.Error, ProcessLookupError):
        return f"{pid} (gone)"


def run_trial(config: CrashConfig, root: str | os.PathLike, *, point: str | None = None, action: str = "kill",
              kill_after: float | None = None, timeout: float = 240.0, grace: float = 10.0) -> Outcome:
    """One job into `root` (which may hold an earlier job's checkpoints), killed as asked: at a
    fault `point` (`action` "kill" or "kill-driver"), or `kill_after` seconds after training started;
    see the module docstring. A job that ended before its random kill time is judged as it is
    (`how` says so); one that never reached its fault point raises FaultNotReached."""
    if action not in ("kill", "kill-driver") or (action == "kill-driver" and point is None):
        raise ValueError(f"action must be 'kill' or 'kill-driver' (at a point), got {action!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    events = root.parent / f"{root.name}.events-{time.monotonic_ns()}.jsonl"
    plan = None if point is None else {"point": point, "iteration": FAULT_ITERATION, "action": action}
    proc = forkserver.context().Process(target=_drive, args=(asdict(config), str(root), str(events), plan),
                                        name=f"mrh-crash-{config.name}")
    proc.start()
    sid = proc.pid  # the driver's setsid makes its pid the session id
    how, killed_at = "none" if point is None else f"{'point' if action == 'kill' else 'driver-only'}:{point}", None
    deadline = time.monotonic() + timeout
    if kill_after is not None:
        ready = None
        while ready is None and proc.is_alive() and time.monotonic() < deadline:
            ready = next((e for e in _read_events(events) if e["event"] == "ready"), None)
            time.sleep(0.02)
        if ready is not None:
            time.sleep(max(0.0, ready["t"] + kill_after - time.monotonic()))
            killed_at = time.monotonic() - ready["t"]
            how = f"random:{killed_at:.2f}"
            if not kill_session(sid, include_self=False):  # the job had ended: nothing to kill
                how, killed_at = f"ended-before-random-kill:{killed_at:.2f}", None
    proc.join(timeout=max(1.0, deadline - time.monotonic()))
    if proc.is_alive():  # a hung job is a failure of its own: take it down, say where it hung
        stacks = _stacks_of_hung_job(sid, events)
        kill_session(sid, include_self=False)
        proc.join(timeout=10)
        raise TimeoutError(f"crash trial {config.name} ({how}) did not end within {timeout:.0f}s\n{stacks}")
    orphans = _orphans(sid, grace)
    if orphans:
        kill_session(sid, include_self=False)
    outcome = Outcome(config, root, how, _read_events(events), proc.exitcode, orphans, killed_at)
    if point is not None and not outcome.error and not outcome.reached(point):
        raise FaultNotReached(f"crash trial {config.name}: the job ended ({'completed' if outcome.completed else 'killed'}) "
                              f"without reaching fault point {point} of the save of iteration {FAULT_ITERATION}")
    return outcome


def _orphans(sid: int, grace: float, exit_s: float = 120.0) -> list[str]:
    """(d) Nothing of the job may outlive it: the processes of its session still there once every
    process not yet killed had `grace` seconds to go (ranks need ~1 s to notice a driver-only kill
    and kill their writers) and every killed one `exit_s` to finish exiting (a SIGKILLed process
    under load, or in the middle of a disk write, takes its time: that is no survivor)."""
    start = time.monotonic()
    while True:
        left = session_pids(sid)
        waited = time.monotonic() - start
        if not left or waited > exit_s or (waited > grace and not all(dying(pid) for pid in left)):
            return [_describe(pid) for pid in left]
        time.sleep(0.2)


def _stacks_of_hung_job(sid: int, events: Path, wait_s: float = 3.0) -> str:
    """The last events, and the stacks of the driver and its ranks (faulthandler on STACK_SIGNAL;
    the ranks' writers, forked, write into their rank's file)."""
    from harness.launch.rank import STACK_SIGNAL, _read_from

    records = _read_events(events)
    ready = next((e for e in records if e["event"] == "ready"), {})
    files = [f"{events}.driver-stack"] + sorted(str(p) for p in Path(ready.get("workdir") or "/nonexistent").glob("rank*.stack"))
    sizes = {f: os.path.getsize(f) if os.path.exists(f) else 0 for f in files}
    for pid in [sid, *ready.get("ranks", [])]:
        if pid in session_pids(sid):
            os.kill(pid, STACK_SIGNAL)
    time.sleep(wait_s)  # faulthandler writes from the signal handler
    lines = ["last events: " + "; ".join(f"{r['event']}{'@' + str(r['iteration']) if 'iteration' in r else ''}"
                                         for r in records[-12:])]
    lines += [f"--- {Path(f).name}\n{_read_from(f, sizes[f]).strip() or '(nothing written)'}" for f in files]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- judging
@dataclass
class Uninterrupted:
    """The run without any save or crash: stats of steps 1..steps+1 and the weights after each."""

    stats: list[dict[str, float]]
    states: list[dict[str, Any]]


def uninterrupted(make_policy, config: CrashConfig) -> Uninterrupted:
    from harness.checkpoint.resume_check import train_batch

    policy = make_policy(config.layout, config.model, **config.policy_config)
    try:
        stats, states = [], []
        for step in range(config.steps + 1):
            stats.append(policy.step(train_batch(step)))
            states.append(policy.hf_state_dict())
    finally:
        policy.close()
    return Uninterrupted(stats, states)


@dataclass
class Verdict:
    outcome: Outcome
    checks: list[Any] = field(default_factory=list)  # CheckResult
    failures: list[str] = field(default_factory=list)
    resumed: int | None = None
    complete: list[int] = field(default_factory=list)
    tracker: int | str | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    def rows(self, **extra: Any):
        from harness.report import Row

        o = self.outcome
        return [Row(suite="", test="", layout=o.config.layout, metric=c.metric, value=c.value,
                    tolerance=c.tolerance.limit, passed=c.passed, claim=c.claim, device=o.config.device,
                    model=o.config.model, dtype=o.config.dtype,
                    extra=dict(extra, config=o.config.name, crash=o.how, variant=o.config.variant,
                               tolerance_kind=c.tolerance.kind, resumed=self.resumed))
                for c in self.checks]

    def summary(self) -> str:
        o = self.outcome
        state = (f"complete {self.complete}, tracker {self.tracker}, finalized {o.finalized}, "
                 f"resumed {self.resumed}")
        return f"{o.config.name} {o.how}: " + ("; ".join(self.failures) if self.failures else "ok") + f" ({state})"


def judge(outcome: Outcome, reference: Uninterrupted, make_policy, *, resident=None) -> Verdict:
    """Checks (a)-(d) of the module docstring on what `outcome` left. The resume runs on
    `resident` (a PolicyHandle of the job's layout and config, kept open: the load replaces its
    whole state) or on a new policy from `make_policy`."""
    from harness.checkpoint.checkpointer import Checkpointer
    from harness.checkpoint.errors import CheckpointError
    from harness.checkpoint.resume_check import next_step_diffs, train_batch
    from harness.checkpoint.root import CheckpointRoot, NothingToResume
    from harness.checkpoint.tolerances import crash_tolerance
    from harness.tolerance import CheckResult

    verdict = Verdict(outcome)

    def check(metric: str, value: float, what: str) -> None:
        bound = crash_tolerance(metric)
        result = CheckResult.judge(metric, value, bound)
        verdict.checks.append(result)
        if not result.passed:
            verdict.failures.append(f"{what} ({metric} {value:g}, bound {bound.limit:g})")

    root = CheckpointRoot(outcome.root)
    verdict.complete = complete = root.complete()
    try:
        tracker = root.tracker()
    except CheckpointError:
        tracker = "unreadable"
    verdict.tracker = tracker
    finalized = outcome.finalized
    check("tracker_names_incomplete", int(tracker is not None and tracker not in complete),
          f"the tracker names {tracker!r}, not a complete checkpoint")
    covered = isinstance(tracker, int) and all(tracker >= i for i in finalized)
    check("finalized_not_tracked", int(bool(finalized) and not covered),
          f"saves {finalized} finalized but the tracker names {tracker!r}")
    check("finalized_but_none_complete", int(bool(finalized) and not complete),
          f"saves {finalized} finalized, yet no complete checkpoint is left")
    check("orphan_processes", len(outcome.orphans), f"processes outlived the job: {outcome.orphans}")
    if complete or finalized:
        policy = resident or make_policy(outcome.config.layout, outcome.config.model, **outcome.config.policy_config)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # passing over a damaged newest one is expected here
                try:
                    info = Checkpointer(policy, outcome.root, keep=outcome.config.keep, sweep=False,
                                        variant=outcome.config.variant).resume()
                except (CheckpointError, NothingToResume) as exc:
                    info = {"iteration": None, "error": str(exc)}
            verdict.resumed = info["iteration"]
            newest = max(complete) if complete else None
            check("resumed_not_newest", int(info["iteration"] != newest),
                  f"resumed from {info['iteration']} ({info.get('error', 'loaded')}), the newest complete is {newest}")
            if info["iteration"] is not None:
                k = info["iteration"]
                got = policy.step(train_batch(k))
                for metric, (value, what) in next_step_diffs(got, reference.stats[k], policy.hf_state_dict(),
                                                             reference.states[k]).items():
                    check(metric, value, f"resumed from {k}: {what}")
        finally:
            if resident is None:
                policy.close()
    else:
        verdict.resumed = None
        try:
            root.choose()
            check("resumed_not_newest", 1, "a resume found a checkpoint where none is complete")
        except NothingToResume:
            check("resumed_not_newest", 0, "")
    return verdict


def cached_trial(cache: dict, config: CrashConfig, workdir: str | os.PathLike, make_policy, *,
                 resident=None, **how) -> Verdict:
    """`run_trial` + `judge`, once per (config, how) per `cache` (a session's), with the
    uninterrupted reference made once per (layout, device, dtype). `resident`: a callable giving
    the policy the resume loads into, called only when a trial runs."""
    key = ("verdict", config, tuple(sorted(how.items())))
    if key not in cache:
        ref_key = ("reference", config.layout, config.device, config.dtype, config.spec, config.model)
        if ref_key not in cache:
            cache[ref_key] = uninterrupted(make_policy, config)
        label = "-".join(str(v) for v in how.values()) or "clean"
        outcome = run_trial(config, Path(workdir) / f"{config.name}-{label}-{time.monotonic_ns()}", **how)
        if outcome.error:
            raise RuntimeError(f"the {config.name} job failed on its own ({outcome.how}):\n{outcome.error}")
        cache[key] = judge(outcome, cache[ref_key], make_policy, resident=resident() if resident else None)
    return cache[key]


def random_kill_times(seed: int, count: int, span: float) -> list[float]:
    """`count` seeded kill times in [0, span) seconds after training starts."""
    import random

    rng = random.Random(seed)
    return [rng.uniform(0.0, span) for _ in range(count)]


def training_span(outcome: Outcome) -> float:
    """Seconds from 'ready' to 'done' of an uncrashed trial (the window random kills fall in)."""
    times = {e["event"]: e["t"] for e in outcome.events}
    if "ready" not in times or "done" not in times:
        raise ValueError(f"trial {outcome.how} did not complete: no span")
    return times["done"] - times["ready"]


__all__ = ["CrashConfig", "FAULT_ITERATION", "FaultNotReached", "Outcome", "Uninterrupted", "Verdict", "cached_trial", "judge",
           "random_kill_times", "run_trial", "training_span", "uninterrupted"]
