"""The durability protocol's ORDER, seen by a spy on the parent's filesystem calls.

A SIGKILL cannot show a missing fsync (the page cache survives a process kill; test_crash_safety.py
proves what a crash at each instant leaves). Here the parent's `os.fsync`, `os.replace`,
`os.rename`, `os.remove` and `shutil.rmtree` are recorded, in order, around one save that also
rotates the previous checkpoint away, and `protocol_violations` checks what a power loss at any
instant needs (harness.checkpoint.checkpointer, steps 3-5):

  (a) every file and directory of the checkpoint is fsynced before the rename
      `.iter_N.partial-*` -> `iter_N`; the manifest is written to a temp file, fsynced, then
      os.replace'd onto manifest.json (and the directory fsynced), all before that rename;
  (b) the root is fsynced after that rename and before the tracker's update;
  (c) the tracker: temp file fsynced, os.replace'd onto latest_checkpointed_iteration.txt, root
      fsynced after it;
  (d) the old checkpoint is renamed to `.trash-*` only after (c), the root fsynced after that
      rename, and only then removed (os.remove / shutil.rmtree below the trash name).

The same checker shows the catalog's upstream orders failing (`tracker-in-place`: the tracker is
never os.replace'd; `keep1-deletes-first`: the old checkpoint is trashed before the new one is
even written), and each kind of mistake, edited into a correct recording, is caught.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

from harness.checkpoint.checkpointer import Checkpointer
from harness.checkpoint.durable import TRASH_PREFIX
from harness.checkpoint.manifest import MANIFEST
from harness.checkpoint.resume_check import CONFIG, MODEL, train_batch
from harness.checkpoint.root import TRACKER, iteration_name
from suites.checkpoint.conftest import layout_for

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
# The catalog's upstream orders this checker must reject, and what its complaint must name.
BUGGY = {"tracker-in-place": TRACKER, "keep1-deletes-first": TRASH_PREFIX}


# ---------------------------------------------------------------------- the spy
class Call(NamedTuple):
    op: str  # fsync, replace, rename, remove, rmtree
    path: str  # real path (fsync: of the fd, read before the fsync)
    target: str | None = None  # replace / rename: where to

    def __str__(self) -> str:
        return f"{self.op}({self.path}" + (f" -> {self.target})" if self.target else ")")


def _real(path) -> str:
    return os.path.realpath(os.fspath(path))


@contextlib.contextmanager
def spy() -> Iterator[list[Call]]:
    """Record the process's os.fsync / os.replace / os.rename / os.remove / shutil.rmtree, in order
    (each still does its work: the originals are called after the record)."""
    calls: list[Call] = []
    original = {"fsync": os.fsync, "replace": os.replace, "rename": os.rename, "remove": os.remove,
                "rmtree": shutil.rmtree}

    def fsync(fd, *args, **kwargs):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = f"<fd {fd}>"
        calls.append(Call("fsync", path))
        return original["fsync"](fd, *args, **kwargs)

    def moving(op):
        def move(src, dst, *args, **kwargs):
            calls.append(Call(op, _real(src), _real(dst)))
            return original[op](src, dst, *args, **kwargs)
        return move

    def removing(op):
        def remove(path, *args, **kwargs):
            calls.append(Call(op, _real(path)))
            return original[op](path, *args, **kwargs)
        return remove

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "fsync", fsync)
        mp.setattr(os, "replace", moving("replace"))
        mp.setattr(os, "rename", moving("rename"))
        mp.setattr(os, "remove", removing("remove"))
        mp.setattr(shutil, "rmtree", removing("rmtree"))
        yield calls


# ---------------------------------------------------------------------- the checker
def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory + os.sep)


def protocol_violations(calls: list[Call], root, iteration: int, old_iteration: int | None) -> list[str]:
    """What, in `calls` (recorded by `spy` around the save of `iteration` into `root`), breaks the
    durability order of the module docstring; [] when nothing does. The files the checkpoint must
    have fsynced are those now under root/iter_N (read from disk). `old_iteration`: the checkpoint
    that save rotated away (None: skip (d))."""
    root = _real(root)
    final = os.path.join(root, iteration_name(iteration))
    tracker = os.path.join(root, TRACKER)
    calls = [c for c in calls if _under(c.path, root) or (c.target and _under(c.target, root))]
    bad: list[str] = []

    def first(pred, start: int = 0, stop: int | None = None) -> int | None:
        stop = len(calls) if stop is None else stop
        return next((i for i in range(start, stop) if pred(calls[i])), None)

    def fsynced(path: str, start: int = 0, stop: int | None = None) -> int | None:
        return first(lambda c: c.op == "fsync" and c.path == path, start, stop)

    # (a) the checkpoint, complete and durable before it becomes visible
    commit = first(lambda c: c.op == "rename" and c.target == final)
    if commit is None:
        return bad + [f"(a) no rename of a partial directory onto {final}: {[str(c) for c in calls]}"]
    partial = calls[commit].path
    if not os.path.basename(partial).startswith(f".{iteration_name(iteration)}.partial-"):
        bad.append(f"(a) {final} was renamed from {partial}, not from a hidden .partial- directory")
    names = sorted(p.relative_to(final) for p in Path(final).rglob("*"))
    if not any(n.as_posix() == MANIFEST for n in names):
        bad.append(f"(a) {final} holds no {MANIFEST}")
    for name in names:
        path = os.path.join(partial, name)
        if fsynced(path, 0, commit) is None:
            bad.append(f"(a) {path} ({'directory' if (Path(final) / name).is_dir() else 'file'}) "
                       f"not fsynced before the rename to {final}")
    if fsynced(partial, 0, commit) is None:
        bad.append(f"(a) the partial directory {partial} not fsynced before its rename")
    manifest = os.path.join(partial, MANIFEST)
    put = first(lambda c: c.op == "replace" and c.target == manifest, 0, commit)
    if put is None:
        bad.append(f"(a) {manifest} not os.replace'd from a temp file before the rename to {final}")
    else:
        if fsynced(calls[put].path, 0, put) is None:
            bad.append(f"(a) the manifest's temp file {calls[put].path} not fsynced before its os.replace")
        if fsynced(partial, put + 1, commit) is None:
            bad.append(f"(a) {partial} not fsynced between the manifest's os.replace and the rename")

    # (b) the rename durable before the tracker names it
    update = first(lambda c: c.op == "replace" and c.target == tracker)
    root_after_commit = fsynced(root, commit + 1, update)
    if root_after_commit is None:
        bad.append(f"(b) the root {root} not fsynced after the rename to {final}"
                   + (" and before the tracker's os.replace" if update is not None else ""))

    # (c) the tracker: temp, fsync, os.replace, fsync of the root
    tracked = None
    if update is None:
        touched = [str(c) for c in calls if tracker in (c.path, c.target)]
        bad.append(f"(c) the tracker {tracker} was never os.replace'd (rewritten in place? its calls: {touched})")
    else:
        if update < commit:
            bad.append(f"(c) the tracker {tracker} os.replace'd before the rename to {final}")
        if fsynced(calls[update].path, 0, update) is None:
            bad.append(f"(c) the tracker's temp file {calls[update].path} not fsynced before its os.replace")
        tracked = fsynced(root, update + 1)
        if tracked is None:
            bad.append(f"(c) the root {root} not fsynced after the tracker's os.replace")

    # (d) rotation: hidden first (durably), removed after, and only once the new one is tracked
    if old_iteration is not None:
        old = os.path.join(root, iteration_name(old_iteration))
        hide = first(lambda c: c.op == "rename" and c.path == old)
        early = first(lambda c: c.op in ("remove", "rmtree") and _under(c.path, old))
        if early is not None:
            bad.append(f"(d) {calls[early]}: the old checkpoint removed in place, not renamed aside first")
        if hide is None:
            bad.append(f"(d) the old checkpoint {old} was never renamed aside")
            return bad
        trash = calls[hide].target
        if not os.path.basename(trash).startswith(TRASH_PREFIX):
            bad.append(f"(d) {old} renamed to {trash}, not to a hidden {TRASH_PREFIX} name")
        if hide < commit or (update is not None and hide < update) or (tracked is not None and hide < tracked):
            bad.append(f"(d) {old} renamed to {os.path.basename(trash)} (call {hide}) before the new "
                       f"checkpoint was committed and tracked (rename {commit}, tracker os.replace {update}, "
                       f"root fsync {tracked})")
        removals = [i for i, c in enumerate(calls) if c.op in ("remove", "rmtree") and _under(c.path, trash)]
        hidden = fsynced(root, hide + 1, removals[0] if removals else None)
        if hidden is None:
            bad.append(f"(d) the root {root} not fsynced after the rename to {os.path.basename(trash)}"
                       + (" and before its removal" if removals else ""))
        if not any(calls[i].op == "rmtree" and calls[i].path == trash for i in removals):
            bad.append(f"(d) the trash {trash} was never removed (shutil.rmtree)")
    return bad


# ---------------------------------------------------------------------- on a live policy
def _rotating_save(handle, root: Path, async_save: bool, variant: str | None = None):
    """Save, step, then the spied save (and its finalize) that rotates the first away (keep=1).
    Returns the recorded calls, the spied save's iteration and the previous one's."""
    ckpt = Checkpointer(handle, root, keep=1, async_save=async_save, variant=variant)
    ckpt.save()
    ckpt.wait()  # async: the first save is finalized outside the spy
    old = ckpt.history[-1].iteration
    handle.step(train_batch(old))
    with spy() as calls:
        ckpt.save()
        handle.step(train_batch(old + 1))  # async: while the save may still be writing
        ckpt.wait()
    ckpt.close()
    assert [r.iteration for r in ckpt.history][-2] == old
    return calls, ckpt.history[-1].iteration, old, ckpt


@pytest.mark.parametrize("async_save", MODES)
def test_a_rotating_save_follows_the_durability_order(policy, device, tmp_path, async_save, report):
    layout = layout_for(device)
    handle = policy(layout, MODEL, **CONFIG)
    handle.step(train_batch(0))
    calls, iteration, old, ckpt = _rotating_save(handle, tmp_path / "correct", async_save)
    assert (old, iteration) == (1, 2)
    assert ckpt.history[-1].deleted == [1] and ckpt.root.iterations() == [2] == ckpt.root.complete()
    assert ckpt.root.tracker() == 2 and ckpt.root.hidden() == []
    violations = protocol_violations(calls, ckpt.root.path, iteration, old)
    report.add("durability_violations", len(violations), tolerance=0, passed=not violations, claim="exact",
               layout=layout, variant="", async_save=async_save)
    assert violations == [], "\n".join(violations)
    assert len([c for c in calls if c.op == "fsync"]) > len(list(ckpt.root.directory(2).rglob("*")))

    # The checker catches each kind of mistake, edited into this correct recording.
    root, final = _real(ckpt.root.path), _real(ckpt.root.directory(2))
    commit = next(i for i, c in enumerate(calls) if c.op == "rename" and c.target == final)
    update = next(i for i, c in enumerate(calls) if c.op == "replace" and c.target.endswith(TRACKER))
    hide = next(i for i, c in enumerate(calls) if c.op == "rename" and c.target and TRASH_PREFIX in c.target)
    shard = next(c for c in calls[:commit] if c.op == "fsync" and c.path.endswith(".distcp"))
    edits = {
        "a shard file not fsynced": ([c for c in calls if c != shard], os.path.basename(shard.path)),
        "the root fsync after the commit moved past the tracker": (
            calls[:commit + 1] + [c for c in calls[commit + 1:update] if c.path != root] + [calls[update]]
            + [Call("fsync", root)] + calls[update + 1:], "(b)"),
        "the old checkpoint trashed before the tracker": (
            calls[:update] + [calls[hide]] + [c for i, c in enumerate(calls[update:], update) if i != hide],
            "(d)"),
        "the trash removed before the root fsync": (
            calls[:hide + 1] + [c for c in calls[hide + 1:] if c.op in ("remove", "rmtree")]
            + [c for c in calls[hide + 1:] if c.op not in ("remove", "rmtree")], "(d)"),
    }
    for what, (edited, named) in edits.items():
        found = protocol_violations(edited, ckpt.root.path, iteration, old)
        assert any(named in v for v in found), f"{what}: not caught ({found})"

    # The catalog's upstream orders, on the same policy (other roots): the checker rejects them.
    for variant, named in BUGGY.items():
        calls, iteration, old, ckpt = _rotating_save(handle, tmp_path / variant, async_save, variant)
        violations = protocol_violations(calls, ckpt.root.path, iteration, old)
        report.add("durability_violations", len(violations), tolerance=0, passed=not violations, claim="exact",
                   layout=layout, variant=variant, async_save=async_save)
        assert violations, f"{variant}: the checker saw nothing wrong in {[str(c) for c in calls]}"
        assert any(named in v for v in violations), f"{variant}: {violations}"
