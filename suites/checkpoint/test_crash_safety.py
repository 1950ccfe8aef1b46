"""Crash safety: a training job SIGKILLed anywhere in its saves leaves a root it can resume from.

For each configuration (sync/async save, keep=1/2) a job trains and saves after every step in its
own session (harness.checkpoint.crash) and is killed: at each named fault point of the save of
iteration 3 (harness.checkpoint.faults.POINTS; each reached for certain, whatever the machine's
speed: the trial fails when its point was not reached), the driver alone while that save's writes
are in flight (the OOM-killer shape), or at N seeded random times after training started. After each kill: (a) the tracker, if present, names a
complete checkpoint and covers every save the job saw finalized; (b) once a save finalized, a
complete checkpoint exists; (c) a fresh process resumes from the newest complete one and its next
step equals the uninterrupted run's bit for bit; (d) no process of the job is left. Every check is
a report row, per crash point.

CI runs every fault point for async keep=1, a clean run, one random kill and a driver-only kill
(sync saves and keep=2 are crashed in CI by the rotation variants' fixed paths, suites/sensitivity);
`--mrh-nightly` runs the whole matrix (4 configurations x 9 points, 20 random kills each, a
driver-only kill each). The rotation variants of the catalog fail these checks: suites/sensitivity.
"""
from __future__ import annotations

import dataclasses

import pytest

from harness.checkpoint.crash import CrashConfig, cached_trial, random_kill_times, training_span
from harness.checkpoint.faults import POINTS
from suites.checkpoint.conftest import layout_for

pytestmark = pytest.mark.crash_injection  # on CUDA with both specs: TE's in the tier (harness.pytest_plugin.collection)
CONFIGS = {c.name: c for c in (CrashConfig(False, 1), CrashConfig(False, 2), CrashConfig(True, 1),
                               CrashConfig(True, 2))}
CI_CONFIG = "async-keep1"
RANDOM_KILLS = 20
NIGHTLY = pytest.mark.nightly


def _params(values, ci):
    return [pytest.param(*v, marks=[] if ci(*v) else [NIGHTLY], id="-".join(str(x) for x in v)) for v in values]


class Bench:
    """Trials on one device through the session's crash cache (harness.checkpoint.crash.cached_trial):
    the uninterrupted reference once per session, a clean trial once per configuration (its training
    span is the window of the random kills), and one resident policy that every resume loads into."""

    def __init__(self, device: str, spec: str, make_policy, world_pool, workdir, cache: dict):
        self.device, self.spec, self.make_policy, self.world_pool = device, spec, make_policy, world_pool
        self.workdir, self.cache = workdir, cache

    def config(self, name: str) -> CrashConfig:
        return dataclasses.replace(CONFIGS[name], layout=layout_for(self.device), device=self.device, spec=self.spec)

    def resident(self, config: CrashConfig):
        from harness.checkpoint.resume_check import MODEL
        from harness.parallel.state import as_layout
        from harness.training.handles import PolicyHandle

        key = ("resident", config.layout, config.device, config.dtype, config.spec)
        world = self.world_pool.get(as_layout(config.layout).world_size, config.device, config.spec)
        handle, starts = self.cache.get(key, (None, None))
        if handle is None or handle.world is not world or starts != world.starts:  # a restarted world lost it
            handle = PolicyHandle(world, config.layout, MODEL, **config.policy_config)
            self.cache[key] = (handle, world.starts)
        return handle

    def trial(self, config: CrashConfig, **how):
        return cached_trial(self.cache, config, self.workdir, self.make_policy,
                            resident=lambda: self.resident(config), **how)

    def clean(self, config: CrashConfig):
        return self.trial(config)


@pytest.fixture
def bench(policy, device, spec, world_pool, tmp_path_factory, crash_cache):
    return Bench(device, spec, policy, world_pool, tmp_path_factory.mktemp("crash"), crash_cache)


def _record(report, verdict, **extra) -> None:
    report.extend(verdict.rows(**extra))
    assert verdict.passed, verdict.summary()


@pytest.mark.parametrize("name", _params([(n,) for n in CONFIGS], lambda n: n == CI_CONFIG))
def test_an_uninterrupted_job_leaves_keep_checkpoints_and_resumes_exactly(bench, name, report):
    config = bench.config(name)
    verdict = bench.clean(config)
    outcome = verdict.outcome
    assert outcome.completed and outcome.finalized == list(range(1, config.steps + 1))
    assert verdict.complete == list(range(config.steps - config.keep + 1, config.steps + 1))
    assert verdict.tracker == config.steps and verdict.resumed == config.steps
    assert [e for e in outcome.events if e["event"] == "done"][0]["writers"] == []
    report.add("training_span_s", training_span(outcome), tolerance=None, passed=True, claim="timing",
               layout=config.layout, config=config.name, units="s")
    _record(report, verdict)


@pytest.mark.parametrize(("name", "point"), _params([(n, p) for n in CONFIGS for p in POINTS],
                                                    lambda n, p: n == CI_CONFIG))
def test_a_kill_at_each_fault_point_leaves_a_resumable_root(bench, name, point, report):
    config = bench.config(name)
    verdict = bench.trial(config, point=point)
    assert verdict.outcome.crashed and verdict.outcome.exitcode == -9, verdict.summary()
    _record(report, verdict, point=point)


@pytest.mark.parametrize(("name", "seed"), _params([(n, s) for n in CONFIGS for s in range(RANDOM_KILLS)],
                                                   lambda n, s: s == 0 and n == CI_CONFIG))
def test_a_kill_at_a_random_time_leaves_a_resumable_root(bench, name, seed, report):
    config = bench.config(name)
    span = training_span(bench.clean(config).outcome)
    (kill_after,) = random_kill_times(seed, 1, span)
    verdict = bench.trial(config, kill_after=kill_after)
    _record(report, verdict, seed=seed, kill_after_s=round(kill_after, 3), span_s=round(span, 3))


@pytest.mark.parametrize("name", _params([(n,) for n in CONFIGS], lambda n: n == CI_CONFIG))
def test_killing_only_the_driver_leaves_no_writer_behind(bench, name, report):
    """The OOM-killer shape: the driver alone is SIGKILLed while the writes of the save of iteration
    3 are in flight (a writer held at `shard-writes` until the trainer waits for it, then it kills
    the driver); the ranks see their parent gone and take their process groups (their forked
    writers and queue servers) down with them."""
    config = bench.config(name)
    verdict = bench.trial(config, point="shard-writes", action="kill-driver")
    assert verdict.outcome.how == "driver-only:shard-writes" and verdict.outcome.exitcode == -9, verdict.summary()
    _record(report, verdict, kill="driver only, the save of iteration 3 in flight")
