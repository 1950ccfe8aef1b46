"""Training with offload/reload cycles in between equals training without them, bit for bit, with
lr > 0 (so the Adam moments matter: SkyRL's lr=0 check hides corrupted moments), on every rank.

A hypothesis state machine interleaves {offload, reload} x {params, grads, optimizer} (any
subset) with whole steps, steps accumulated micro-batch by micro-batch across calls, and
checkpoint saves. After every rule, on every rank: the residency is what the rules say, each
component holds its theory bytes when resident and none when offloaded, the host shadows never
change. After every step: the weights, main params, moments and steps digest equal the plain
run's after the same step, and so do loss and grad norm. What must be refused is: reading an
offloaded component (`OffloadedError`) and offloading grads inside an open accumulation
(`OffloadRefused`).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness.checkpoint.resume_check import train_batch
from harness.offload import POLICY, OffloadedError, OffloadRefused
from harness.offload.check import MODEL, config_for, digests
from harness.pytest_plugin.worlds import skip_invalid_layout

STEPS = 4  # steps the plain run records (a machine stops stepping there)
SUBSETS = st.sets(st.sampled_from(POLICY), min_size=1)


def _trained(digest_per_rank) -> list[dict[str, str]]:
    """The digests of what training changes (grads are zeros or freed between steps)."""
    return [{k: v for k, v in d.items() if not k.startswith("grads:")} for d in digest_per_rank]


def _plain(policy, layout, dtype, cache) -> list[tuple[dict, list]]:
    """(step stats, digests) after each of STEPS plain steps, once per (layout, dtype) in the
    device's and spec's `reference_runs`."""
    key = ("offload-plain", layout, dtype)
    if key not in cache:
        with skip_invalid_layout():  # pp4vpp2 (8 virtual stages) on a 4-layer model
            plain = policy(layout, MODEL, **config_for(layout), dtype=dtype)
        cache[key] = [(plain.step(train_batch(k)), _trained(plain.apply(digests))) for k in range(STEPS)]
        plain.close()
    return cache[key]


class OffloadMachine(RuleBasedStateMachine):
    make = None  # set per test: () -> (policy handle, the plain run, a checkpoint directory)

    @initialize()
    def start(self):
        self.policy, self.plain, self.ckpt_dir = type(self).make()
        self.offloaded: set[str] = set()
        self.steps = 0
        self.open: list[int] | None = None  # micro-batches accumulated in an open step
        self.shadows: dict = {}
        self.saves = 0

    def teardown(self):
        if getattr(self, "policy", None) is not None:
            self.policy.close()

    # ----------------------------------------------------------------- rules
    @rule(components=SUBSETS)
    def offload(self, components):
        kwargs = {c: c in components for c in POLICY}
        if self.open is not None and "grads" in components and "grads" not in self.offloaded:
            with pytest.raises(OffloadRefused):
                self.policy.offload(**kwargs)
            return
        self.policy.offload(**kwargs)
        self.offloaded |= components

    @rule(components=SUBSETS)
    def reload(self, components):
        self.policy.reload(**{c: c in components for c in POLICY})
        self.offloaded -= components

    @precondition(lambda self: self.steps < STEPS and self.open is None)
    @rule()
    def step(self):
        if self.offloaded:
            with pytest.raises(OffloadedError):
                self.policy.step(train_batch(self.steps))
            return
        self._stepped(self.policy.step(train_batch(self.steps)))

    @precondition(lambda self: self.steps < STEPS and self.open is None)
    @rule()
    def begin(self):
        if self.offloaded:
            with pytest.raises(OffloadedError):
                self.policy.begin_step(train_batch(self.steps))
            return
        self.policy.begin_step(train_batch(self.steps))
        self.open = []

    @precondition(lambda self: self.open is not None)
    @rule()
    def accumulate_or_finish(self):
        # One micro-batch per call; under VPP the fewest the interleaved schedule takes.
        chunk = list(range(len(self.open), len(self.open) + self.policy.layout.micro_batch_multiple))
        if self.offloaded:
            with pytest.raises(OffloadedError):
                self.policy.accumulate(chunk)
            return
        if len(self.open) < self.policy.config["micro_batches"]:
            self.policy.accumulate(chunk)
            self.open += chunk
        else:
            self.open = None
            self._stepped(self.policy.finish_step())

    @precondition(lambda self: self.open is None and self.saves < 2)
    @rule()
    def save(self):
        target = self.ckpt_dir / f"save{self.saves}"
        if self.offloaded & {"params", "optimizer"}:
            with pytest.raises(OffloadedError):
                self.policy.save(target)
            assert not target.exists()
            return
        self.policy.save(target)
        self.saves += 1

    def _stepped(self, stats):
        want_stats, want_digest = self.plain[self.steps]
        assert (stats["loss"], stats["grad_norm"]) == (want_stats["loss"], want_stats["grad_norm"]), self.steps
        assert _trained(self.policy.apply(digests)) == want_digest, f"state after step {self.steps} differs"
        self.steps += 1
        type(self).compared.append((self.steps, sorted(self.offloaded), self.open is not None))

    # ----------------------------------------------------------------- invariants
    @invariant()
    def residency_and_bytes(self):
        if not hasattr(self, "policy"):
            return
        for rank, account in enumerate(self.policy.offload_accounting()):
            for c in POLICY:
                entry = account[c]
                offloaded = c in self.offloaded
                assert entry["state"] == ("offloaded" if offloaded else "resident"), (rank, c)
                assert entry["held_bytes"] == (0 if offloaded else entry["theory_bytes"]), (rank, c, entry)
                ids = tuple(entry["shadow_ids"])
                if ids:  # a shadow, once made, is the one every later cycle uses
                    assert self.shadows.setdefault((rank, c), ids) == ids, (rank, c)
                assert entry["shadow_allocations"] == len(ids), (rank, c)


def _run_machine(policy, layout, dtype, tmp_path_factory, cache, examples, steps):
    plain = _plain(policy, layout, dtype, cache)

    def make():
        return policy(layout, MODEL, **config_for(layout), dtype=dtype), plain, tmp_path_factory.mktemp("sm")

    compared: list = []
    machine = type("Machine", (OffloadMachine,), {"make": staticmethod(make), "compared": compared})
    machine.TestCase.settings = settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                                         database=None, derandomize=True,
                                         suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()
    assert len(compared) >= examples, f"only {len(compared)} steps were compared with the plain run"


@pytest.mark.layouts(cpu=["dp2"], cuda="all")
def test_offload_cycles_change_no_training_step(policy, device, layout, tmp_path_factory, reference_runs):
    _run_machine(policy, layout, "fp32", tmp_path_factory, reference_runs, examples=6, steps=20)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["dp2", "tp2", "pp2"], cuda="all")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offload_cycles_change_no_training_step_nightly(policy, device, layout, dtype, tmp_path_factory,
                                                       reference_runs):
    _run_machine(policy, layout, dtype, tmp_path_factory, reference_runs, examples=12, steps=24)


@pytest.mark.layouts(cpu=["dp2", "tp2", "pp2"], cuda="all")
def test_a_step_accumulated_across_calls_equals_one_call(policy, device, layout):
    """begin_step / accumulate / finish_step is train_step bit for bit (config_for's micro-batches: 2
    wherever the schedule takes 2, so the per-call loss scale is an exact power-of-two rescaling)."""
    config = config_for(layout)
    with skip_invalid_layout():  # pp4vpp2 (8 virtual stages) on a 4-layer model
        whole = policy(layout, MODEL, **config)
    want = [whole.step(train_batch(k)) for k in range(2)]
    want_digest = _trained(whole.apply(digests))
    whole.close()
    split = policy(layout, MODEL, **config)
    got = []
    for k in range(2):
        split.begin_step(train_batch(k))
        chunk = split.layout.micro_batch_multiple  # 1, or pp under VPP
        for first in range(0, config["micro_batches"], chunk):
            split.accumulate(range(first, first + chunk))
        got.append(split.finish_step())
    assert [(g["loss"], g["grad_norm"]) for g in got] == [(w["loss"], w["grad_norm"]) for w in want]
    assert _trained(split.apply(digests)) == want_digest
    with pytest.raises(RuntimeError, match="needs an open step"):
        split.finish_step()
