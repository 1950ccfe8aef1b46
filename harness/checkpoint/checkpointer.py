"""A policy's checkpoints in one root: sync or async saves, a tracker, rotation, resume.

    ckpt = policy.checkpointer("runs/a", keep=2, async_save=True)
    for step in range(N):
        policy.step(batch)
        ckpt.maybe_finalize()                 # commits a finished async save (non-blocking)
        if step % 10 == 0:
            ckpt.save()                       # waits for the previous save, then schedules this one
    ckpt.close()                              # finalizes what is in flight; no writer is left

    info = other_policy.checkpointer("runs/a").resume()   # newest complete checkpoint

The order of a save (each step a fault point, harness.checkpoint.faults):
  1. finalize the previous save (blocking): one save in flight, never two (megatron-core 0.16.1
     swaps the write results of overlapping saves);
  2. the ranks stage and write into a fresh hidden `.iter_N.partial-*` (async: in forked writers,
     while training continues);
  3. finalize, only after every rank's writes have finished: megatron-core's `.metadata`, then the
     manifest (atomic), fsync of every file, rename to `iter_N` (fsync of the root);
  4. the tracker names N (temp, fsync, rename, fsync of the root);
  5. rotation: the oldest complete checkpoints beyond `keep` are deleted (renamed aside first),
     never the one the tracker names, and only now that N is complete and tracked.
A writer error surfaces once, as a CheckpointError at finalize (or the next save or close): the
partial directory is discarded, the tracker stays where it was and nothing is deleted.

Variants (the catalog's "rotation" entries, `IMPLEMENTED`) reproduce upstream orders of operation.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.faults import fault
from harness.checkpoint.knobs import CheckpointKnobs
from harness.checkpoint.manifest import Manifest, write_manifest
from harness.checkpoint.root import CheckpointRoot, NothingToResume
from harness.checkpoint.shared_fs import require_shared
from harness.variants import VariantError, require

# The rotation variants of the catalog this manager implements.
IMPLEMENTED = ("tracker-at-schedule", "delete-before-finalize", "keep1-deletes-first",
               "async-tracker-never-written", "tracker-in-place", "overlapping-async-saves",
               "resume-trusts-tracker")


@dataclass
class PendingSave:
    iteration: int
    partial: Path
    started: float
    blocking_s: float
    position: dict[str, int]
    stages: dict[str, float] = field(default_factory=dict)  # rank 0's: state_dict_s, plan_s, stage_s
    writer_cpu_s: float = 0.0  # all ranks' writers


@dataclass
class SaveRecord:
    """What a finished save did (`Checkpointer.history`)."""

    iteration: int
    async_save: bool
    blocking_s: float  # until training could continue
    total_s: float  # until the checkpoint was committed and tracked
    deleted: list[int] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)  # where the blocking time went (rank 0)
    writer_cpu_s: float = 0.0  # CPU time of the writer processes, summed over the ranks


class Checkpointer:
    """Saves `policy` (a PolicyHandle) into `root` and resumes it from there (module docstring).
    One Checkpointer writes to a root at a time: `sweep=True` (the default) removes the partial
    saves and trash an earlier, dead run left there; pass sweep=False to open a root another live
    Checkpointer is writing to (e.g. to resume from it)."""

    def __init__(self, policy, root: str | os.PathLike, knobs: CheckpointKnobs | None = None, *,
                 variant: str | None = None, sweep: bool = True, **knob_changes: Any) -> None:
        try:
            require(variant, check="crash-safety")
        except VariantError as exc:
            raise CheckpointError(str(exc)) from None
        self.policy = policy
        self.root = CheckpointRoot(root)
        require_shared(policy.world, self.root.path, "every checkpoint in it")
        unknown = sorted(set(knob_changes) - set(CheckpointKnobs.__dataclass_fields__))
        if unknown:
            raise CheckpointError(f"unknown checkpoint knob(s) {unknown}; the knobs are "
                                  f"{sorted(CheckpointKnobs.__dataclass_fields__)}")
        self.knobs = (knobs or CheckpointKnobs()).replace(**knob_changes)
        self.variant = variant
        self.pending: list[PendingSave] = []
        self.history: list[SaveRecord] = []
        self.swept = self.root.sweep() if sweep else []  # an earlier run's partial saves and trash

    def __repr__(self) -> str:
        return f"<Checkpointer {self.root.path} {self.knobs.describe()} pending={len(self.pending)}>"

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # ------------------------------------------------------------------ save
    def save(self, iteration: int | None = None) -> Manifest | PendingSave:
        """Checkpoint the policy as iteration `iteration` (default: its steps done). Sync: returns
        the committed manifest. Async: returns once the state is staged; `maybe_finalize`, the next
        `save` or `close` commits it."""
        if self.variant != "overlapping-async-saves":
            self.wait()  # one save in flight: finalize the previous one first (raises its error)
        position = self.policy.position()
        iteration = position["steps_done"] if iteration is None else int(iteration)
        if iteration in self.root.iterations() or any(p.iteration == iteration for p in self.pending):
            raise CheckpointError(f"{self.root.directory(iteration)} exists; refusing to overwrite it "
                                  "(nothing was written)")
        if self.variant == "keep1-deletes-first":  # verl before PR 4873: make room first
            self._rotate(iteration, keep=self.knobs.keep - 1, upstream_order=True)
        partial = self.root.new_partial(iteration)
        started = time.perf_counter()
        try:
            saved = self.policy.call("save_checkpoint", str(partial), optimizer_format=self.knobs.optimizer_format,
                             fully_parallel=self.knobs.fully_parallel_save, async_save=self.knobs.async_save,
                             iteration=iteration, allow_overlap=self.variant == "overlapping-async-saves")
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            self.root.discard(partial)  # the ranks raised: no writer of this save is left running
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            raise self._failed(iteration, f"{type(exc).__name__}: {' '.join(str(exc).split())[:600]}") from exc
        pending = PendingSave(iteration, partial, started, time.perf_counter() - started, position,
                              stages={k: round(v, 4) for k, v in saved[0]["timings"].items() if k != "writer_cpu_s"},
                              writer_cpu_s=sum(r["timings"].get("writer_cpu_s", 0.0) for r in saved))
        if self.variant == "tracker-at-schedule":  # verl before PR 4638: the trainer wrote it here
            self.root.write_tracker(iteration)
        if self.variant == "delete-before-finalize":  # SkyRL / verl 4667: prune, counting the new one
            self._rotate(iteration, keep=self.knobs.keep - 1, upstream_order=True)
        self.pending.append(pending)
        if not self.knobs.async_save:
            return self._commit(self.pending.pop())
        return pending

    # ------------------------------------------------------------------ finalize
    def maybe_finalize(self, blocking: bool = False) -> list[int]:
        """Commit every pending save whose writes are done on every rank; returns their iterations.
        blocking=True waits for all of them. A writer error raises CheckpointError here, once."""
        committed = []
        while self.pending:
            results = self.policy.call("finalize_checkpoints", blocking)
            errors = [r for r in results if r["error"]]
            if errors:
                failed = self.pending.pop(0)
                self.root.discard(failed.partial)  # its writers have exited: finalize joined them
                raise self._failed(failed.iteration, errors[0]["error"])
            finalized = results[0]["finalized"]
            if not finalized:
                break
            for pending in self.pending:  # the writers reaped by this finalize (one save here, but for
                if str(pending.partial) in finalized:  # the overlapping variant: charged to the first)
                    pending.writer_cpu_s += sum(r["writer_cpu_s"] for r in results)
                    break
            for directory in finalized:
                pending = next(p for p in self.pending if str(p.partial) == directory)
                self.pending.remove(pending)
                self._commit(pending)
                committed.append(pending.iteration)
            if not blocking:
                break
        return committed

    def _failed(self, iteration: int, error: str) -> CheckpointError:
        return CheckpointError(f"the save of iteration {iteration} failed; nothing was committed, the tracker "
                               f"still names {self.root.tracker()}, nothing was deleted: {error}")

    def wait(self) -> list[int]:
        """Commit every pending save (blocking)."""
        return self.maybe_finalize(blocking=True)

    def _commit(self, pending: PendingSave) -> Manifest:
        """Step 3-5 of the module docstring, after every rank's writes and megatron-core's finalize."""
        from harness.checkpoint.manager import policy_manifest

        iteration = pending.iteration
        fault("metadata-written", iteration)
        manifest = policy_manifest(self.policy, pending.partial, pending.position, self.knobs.optimizer_format,
                                   pending.started, iteration=iteration, async_save=self.knobs.async_save,
                                   blocking_s=round(pending.blocking_s, 4))
        write_manifest(pending.partial, manifest)
        self.root.commit(pending.partial, iteration)
        if self.variant not in ("tracker-at-schedule",) and not (
                self.variant == "async-tracker-never-written" and self.knobs.async_save):
            self.root.write_tracker(iteration, in_place=self.variant == "tracker-in-place")
        fault("before-rotation", iteration)
        deleted = [] if self.variant in ("delete-before-finalize", "keep1-deletes-first") else \
            self._rotate(iteration, keep=self.knobs.keep)
        self.history.append(SaveRecord(iteration, self.knobs.async_save, pending.blocking_s,
                                       time.perf_counter() - pending.started, deleted, pending.stages,
                                       round(pending.writer_cpu_s, 4)))
        return manifest

    def _rotate(self, iteration: int, *, keep: int, upstream_order: bool = False) -> list[int]:
        """Delete the oldest complete checkpoints beyond the newest `keep`, never the tracker's.
        upstream_order: the variants' pruning before the new checkpoint is complete (keeps the
        newest `keep` existing ones, room for the coming one; none protected)."""
        if upstream_order:
            existing = self.root.iterations()
            doomed = existing[: max(0, len(existing) - max(keep, 0))]
        else:
            protected = {self.root.tracker()}
            complete = self.root.complete(checksums=False)
            doomed = [i for i in complete[: max(0, len(complete) - keep)] if i not in protected]
        for old in doomed:
            self.root.delete(old, during=iteration)
        return doomed

    # ------------------------------------------------------------------ close / abort
    def close(self) -> None:
        """Commit what is in flight (raises a writer's error); no writer process is left."""
        self.wait()

    def abort(self) -> list[int]:
        """Kill the in-flight writers without committing; discard their partial directories. The
        tracker and every complete checkpoint stay. Returns the killed pids."""
        killed = [pid for pids in self.policy.call("abort_checkpoints") for pid in pids]
        for pending in self.pending:
            self.root.discard(pending.partial)
        self.pending = []
        return killed

    def writers(self) -> list[int]:
        """Live checkpoint writer processes on the ranks."""
        return [pid for pids in self.policy.call("checkpoint_writers") for pid in pids]

    # ------------------------------------------------------------------ resume
    def resume(self, *, checksums: bool = True) -> dict[str, Any]:
        """Load the newest complete checkpoint into the policy (passing over damaged newer ones with
        a warning). Raises NothingToResume when there is none. Returns the load's info with the
        iteration and what was skipped."""
        from harness.checkpoint.manager import load_checkpoint

        trust = self.variant == "resume-trusts-tracker"
        choice = self.root.choose(checksums=checksums, trust_tracker=trust)
        # choose() has just verified every file of its choice (checksums too) unless it trusted the
        # tracker: the load then re-checks sizes only
        info = load_checkpoint(self.policy, choice.directory, load_rng=self.knobs.load_rng,
                               fully_parallel_load=self.knobs.fully_parallel_load,
                               verify_checksums=checksums and trust)
        return {**info, "iteration": choice.iteration, "skipped": choice.skipped, "tracker": choice.tracker}


__all__ = ["Checkpointer", "IMPLEMENTED", "NothingToResume", "PendingSave", "SaveRecord"]
