"""Two async saves in flight: what megatron-core 0.16.1 does, and why the Checkpointer waits.

megatron-core 0.16.1 hands every temporal async save's write results (which file and offset holds
each tensor) back through one process-wide queue (`filesystem_async._get_write_results_queue`),
and each finalize takes whatever result is first in it. Schedule a second save before the first
finalized and let the second finish writing first: the first save's `.metadata` is built from
the second save's results and the other way round. When the two plans have the same number of write
buckets on a rank, both finalize without an error and a checkpoint loads wrong tensors or fails to
load; when the counts differ, save 1 - written completely - fails at finalize ("Incomplete worker
results") and is lost. Either way a save does not give back what it saved.

`overlapping_saves` makes exactly that happen, in that order on any machine: save 1 (fully parallel
writes, held in its writers at the `shard-writes` fault point), a step, save 2 (serial writes:
another plan); once save 2's writers have exited on every rank, save 1's go on - and then it loads
both into a fresh policy and compares with the weights each save was made from.
With `variant="overlapping-async-saves"` the Checkpointer schedules save 2 at once (as Megatron-LM's
training loop allows, with a warning); the fixed path finalizes save 1 first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.checkpoint.errors import CheckpointError

WRITES_TIMEOUT_S = 120.0  # save 2's writes take well under a second here; a bound, not a timing


@dataclass
class OverlapResult:
    layout: str
    dtype: str
    variant: str | None
    checks: list[Any] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    loads: dict[int, str] = field(default_factory=dict)  # iteration -> what its load gave

    @property
    def passed(self) -> bool:
        return not self.failures

    def rows(self, **extra: Any):
        from harness.checkpoint.resume_check import MODEL
        from harness.report import Row

        return [Row(suite="", test="", layout=self.layout, metric=c.metric, value=c.value, tolerance=c.tolerance.limit,
                    passed=c.passed, claim=c.claim, model=MODEL, dtype=self.dtype,
                    extra=dict(extra, variant=self.variant, loads=self.loads, tolerance_kind=c.tolerance.kind))
                for c in self.checks]

    def summary(self) -> str:
        state = ", ".join(f"iteration {i}: {what}" for i, what in sorted(self.loads.items()))
        return ("; ".join(self.failures) if self.failures else "both checkpoints load their own weights") + f" ({state})"


def overlapping_saves(make_policy, layout: str, root: str | Path, *, dtype: str = "fp32",
                      variant: str | None = None) -> OverlapResult:
    from harness.checkpoint.checkpointer import Checkpointer
    from harness.checkpoint.faults import FaultPlan, injected
    from harness.checkpoint.manager import load_checkpoint
    from harness.checkpoint.resume_check import CONFIG, MODEL, train_batch
    from harness.checkpoint.tolerances import crash_tolerance
    from harness.tolerance import CheckResult

    config = {**CONFIG, "dtype": dtype, "deterministic": True}
    policy = make_policy(layout, MODEL, **config)
    policy.step(train_batch(0))
    ckpt = Checkpointer(policy, root, keep=2, async_save=True, fully_parallel_save=True, variant=variant)
    want = {}
    with injected(policy.world, FaultPlan("shard-writes", iteration=1, action="hold")) as held:
        want[1] = policy.hf_state_dict()
        ckpt.save()
        policy.step(train_batch(1))
        want[2] = policy.hf_state_dict()
        ckpt.knobs = ckpt.knobs.replace(fully_parallel_save=False)  # save 2 writes another plan
        ckpt.save()  # the fixed path waits for save 1 first (which releases its writers)
        if len(ckpt.pending) == 2:  # both in flight: save 2 finishes writing first, then save 1
            _wait_for_writes(policy, 2)
            held.release()
        finalize_errors = []
        while ckpt.pending:  # a failed finalize raises once per save
            try:
                ckpt.wait()
            except CheckpointError as exc:
                finalize_errors.append(' '.join(str(exc).split())[:300])
    result = OverlapResult(str(policy.layout), dtype, variant)
    policy.close()
    bad = 0
    for iteration in (1, 2):
        if iteration not in ckpt.root.iterations():
            failed = next((e for e in finalize_errors if f"iteration {iteration} " in e), "never committed")
            result.loads[iteration] = f"not committed: {failed}"
            bad += 1
            continue
        target = make_policy(layout, MODEL, **config)
        try:
            load_checkpoint(target, ckpt.root.directory(iteration))
            got = target.hf_state_dict()
            worst = max((got[n].float() - t.float()).abs().max().item() for n, t in want[iteration].items())
            result.loads[iteration] = f"loaded, max |diff| {worst:.3g} from its own weights"
            bad += worst != 0.0
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            result.loads[iteration] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            bad += 1
        finally:
            target.close()
    bound = crash_tolerance("checkpoints_unloadable")
    result.checks.append(CheckResult.judge("checkpoints_unloadable", bad, bound))
    if bad:
        result.failures.append(f"{bad} of 2 checkpoints do not load the weights they were saved from "
                               f"(checkpoints_unloadable {bad}, bound 0)")
    return result


def _wait_for_writes(policy, iteration: int) -> None:
    """Until the writers of the save of `iteration` have exited on every rank (a condition, not a
    delay: its outcome does not depend on the machine's speed)."""
    import time

    deadline = time.monotonic() + WRITES_TIMEOUT_S
    while not all(policy.call("checkpoint_writes_done", iteration)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the writes of save {iteration} did not finish within {WRITES_TIMEOUT_S:.0f}s")
        time.sleep(0.05)
