"""A checkpoint root on disk: numbered checkpoints, the tracker, and which one a resume takes.

    root/
      iter_0000004/                      a complete checkpoint: manifest.json + every file it lists
      iter_0000006/
      latest_checkpointed_iteration.txt  "6": the newest complete checkpoint (Megatron-LM's name)
      .iter_0000008.partial-1a2b3c4d/    a save in progress (or interrupted): never resumed from
      .trash-iter_0000002-5e6f7a8b/      a deletion in progress (or interrupted): never resumed from

A checkpoint is complete when its manifest is present and every file it lists has the recorded
size and sha256. The tracker is written atomically (harness.checkpoint.durable) and only after the
checkpoint it names is complete, so it never names an incomplete one; a resume still verifies the
directory rather than trust it (the tracker can lag the newest complete checkpoint by a save
interrupted between its commit and the tracker update, and files can rot).
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from harness.checkpoint.durable import TRASH_PREFIX, atomic_write_text, fsync_path, fsync_tree, retire, \
    sweep_trash
from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.faults import fault
from harness.checkpoint.manifest import read_manifest, verify_files

TRACKER = "latest_checkpointed_iteration.txt"
_NAME = re.compile(r"^iter_(\d{7})$")
_PARTIAL = ".partial-"


class NothingToResume(CheckpointError):
    """The root holds no complete checkpoint."""


def iteration_name(iteration: int) -> str:
    if iteration < 0:
        raise CheckpointError(f"a checkpoint iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:07d}"


@dataclass
class ResumeChoice:
    iteration: int
    directory: Path
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newer ones passed over, and why
    tracker: int | None = None


class CheckpointRoot:
    """The directory that holds one training run's checkpoints."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"CheckpointRoot({str(self.path)!r})"

    # ------------------------------------------------------------------ what is there
    def directory(self, iteration: int) -> Path:
        return self.path / iteration_name(iteration)

    def iterations(self) -> list[int]:
        """Every visible numbered directory, complete or not (hidden ones are never listed)."""
        if not self.path.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.path.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def problem(self, iteration: int, *, checksums: bool = True) -> str | None:
        """None if the checkpoint of `iteration` is complete, else what is wrong with it."""
        directory = self.directory(iteration)
        try:
            verify_files(directory, read_manifest(directory), checksums=checksums)
        except CheckpointError as exc:
            return str(exc)
        return None

    def complete(self, *, checksums: bool = True) -> list[int]:
        return [i for i in self.iterations() if self.problem(i, checksums=checksums) is None]

    def hidden(self) -> list[str]:
        """Partial saves, interrupted deletions and tracker temp files."""
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if p.name.startswith(".") and
                      (_PARTIAL in p.name or p.name.startswith(TRASH_PREFIX) or ".tmp-" in p.name))

    # ------------------------------------------------------------------ the tracker
    @property
    def tracker_path(self) -> Path:
        return self.path / TRACKER

    def tracker(self) -> int | None:
        """The iteration the tracker names; None without a tracker. Raises CheckpointError for a
        tracker that is not one integer (an interrupted in-place write leaves it empty)."""
        if not self.tracker_path.is_file():
            return None
        text = self.tracker_path.read_text().strip()
        if not text.isdigit():
            raise CheckpointError(f"{self.tracker_path}: unreadable tracker {text!r} (not an iteration)")
        return int(text)

    def write_tracker(self, iteration: int, *, in_place: bool = False) -> None:
        """Name `iteration` as the latest: atomically (temp, fsync, rename, fsync of the root).
        in_place=True is the upstream bug (`tracker-in-place`): truncate and write the file itself."""
        fault_at = lambda: fault("tracker-rename", iteration)  # noqa: E731
        if in_place:
            with open(self.tracker_path, "w") as handle:  # truncated from here until the write
                fault_at()
                handle.write(str(iteration))
            return
        atomic_write_text(self.tracker_path, str(iteration), before_rename=fault_at)

    # ------------------------------------------------------------------ writing and deleting
    def new_partial(self, iteration: int) -> Path:
        """A fresh hidden directory for a save of `iteration` (a new name each attempt: an orphan
        writer of an earlier attempt may still be writing into its own)."""
        self.path.mkdir(parents=True, exist_ok=True)
        partial = self.path / f".{iteration_name(iteration)}{_PARTIAL}{uuid.uuid4().hex[:8]}"
        partial.mkdir()
        return partial

    def commit(self, partial: Path, iteration: int) -> Path:
        """Make a written checkpoint visible: fsync all of it, rename it into place, fsync the root."""
        target = self.directory(iteration)
        if target.exists():
            raise CheckpointError(f"{target} exists; refusing to overwrite it")
        fsync_tree(partial)
        fault("before-commit", iteration)
        os.rename(partial, target)
        fsync_path(self.path)
        return target

    def delete(self, iteration: int, *, during: int | None = None) -> None:
        """Delete a checkpoint crash-safely (renamed aside first); `during`: the save doing it."""
        retire(self.directory(iteration), iteration=during)

    def discard(self, partial: Path) -> None:
        shutil.rmtree(partial, ignore_errors=True)

    def sweep(self) -> list[str]:
        """Remove partial saves and interrupted deletions of earlier runs. Only when no writer of
        theirs can be alive (a new run, after the old one's processes are gone)."""
        removed = sweep_trash(self.path)
        for name in self.hidden():
            if _PARTIAL in name:
                shutil.rmtree(self.path / name, ignore_errors=True)
                removed.append(name)
        for stale in self.path.glob(f".{TRACKER}.tmp-*"):  # a tracker write cut before its rename
            stale.unlink(missing_ok=True)
            removed.append(stale.name)
        return removed

    # ------------------------------------------------------------------ resume
    def choose(self, *, checksums: bool = True, trust_tracker: bool = False) -> ResumeChoice:
        """The newest complete checkpoint, passing over damaged newer ones with a warning.
        trust_tracker=True is the upstream bug (`resume-trusts-tracker`): take what the tracker
        names, without looking at the directory. Raises NothingToResume."""
        try:
            tracker = self.tracker()
        except CheckpointError as exc:
            if trust_tracker:
                raise
            warnings.warn(f"{exc}; ignoring it and scanning {self.path}", stacklevel=2)
            tracker = None
        if trust_tracker:
            if tracker is None:
                raise NothingToResume(f"{self.path}: no tracker ({TRACKER}): nothing to resume")
            return ResumeChoice(tracker, self.directory(tracker), tracker=tracker)
        skipped = []
        for iteration in reversed(self.iterations()):
            problem = self.problem(iteration, checksums=checksums)
            if problem is None:
                if skipped:
                    warnings.warn(f"{self.path}: resuming from iteration {iteration}, passing over newer "
                                  "incomplete or damaged checkpoints: " +
                                  "; ".join(f"{i}: {why}" for i, why in skipped), stacklevel=2)
                return ResumeChoice(iteration, self.directory(iteration), skipped, tracker)
            skipped.append((iteration, problem))
        what = f"{len(skipped)} incomplete or damaged" if skipped else "no"
        raise NothingToResume(f"{self.path}: nothing to resume: {what} checkpoint directories"
                              + (": " + "; ".join(f"{i}: {why}" for i, why in skipped) if skipped else ""))
