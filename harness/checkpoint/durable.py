"""Durable file operations: what must survive a crash is written, renamed and deleted in an order
that a crash at any instant, or a power loss after it, cannot turn into a half state.

- `atomic_write_text`: temp file, write, fsync, rename over the target, fsync of the directory.
  A reader sees the old content or the new one, never a truncated file.
- `fsync_tree`: fsync every file and directory under a checkpoint before it is renamed into place
  (megatron-core fsyncs its shard files but not `common.pt` or `metadata.json`).
- `retire`: delete a directory crash-safely: rename it to a hidden `.trash-*` name first (fsync of
  the parent), then remove it. A crash mid-delete leaves a hidden directory nothing resumes from.

Every call goes through `os` (os.fsync, os.replace, os.rename, os.remove, shutil.rmtree), so a test can record
their order (suites/checkpoint/test_durability.py): SIGKILL cannot show a missing fsync, as the
page cache survives a process kill.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from harness.checkpoint.faults import fault

TRASH_PREFIX = ".trash-"


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory's fsync makes its renames and removals durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | os.PathLike) -> None:
    """fsync every file below `directory`, then every directory bottom-up, `directory` last."""
    directory = Path(directory)
    dirs = []
    for root, subdirs, files in os.walk(directory):
        for name in files:
            fsync_path(os.path.join(root, name))
        dirs.append(root)
    for root in reversed(dirs):
        fsync_path(root)


def atomic_write_text(path: str | os.PathLike, text: str, *,
                      midway: Callable[[], None] | None = None,
                      before_rename: Callable[[], None] | None = None) -> None:
    """Replace `path` by `text` atomically and durably. `midway` runs after half the bytes are in
    the temp file, `before_rename` after the temp file is fsynced (fault points)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    data = text.encode()
    with open(tmp, "wb") as handle:
        handle.write(data[: len(data) // 2])
        if midway is not None:
            handle.flush()
            midway()
        handle.write(data[len(data) // 2:])
        handle.flush()
        os.fsync(handle.fileno())
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    fsync_path(path.parent)


def retire(directory: str | os.PathLike, *, iteration: int | None = None) -> None:
    """Delete `directory` crash-safely: hide it under a `.trash-*` name (durably), then remove it.
    `iteration` names the save this deletion belongs to (the fault point `rotation-delete`)."""
    directory = Path(directory)
    trash = directory.with_name(f"{TRASH_PREFIX}{directory.name}-{uuid.uuid4().hex[:8]}")
    os.rename(directory, trash)
    fsync_path(directory.parent)
    files = sorted(p for p in trash.rglob("*") if p.is_file())
    for path in files[: len(files) // 2]:  # a crash from here on leaves a half-deleted hidden dir
        os.remove(path)
    fault("rotation-delete", iteration)
    shutil.rmtree(trash)


def sweep_trash(root: str | os.PathLike) -> list[str]:
    """Remove what interrupted deletions left (`.trash-*`) under `root`; returns their names.
    Only call this when no writer of an earlier run can still be alive (after its session is gone)."""
    removed = []
    for path in Path(root).glob(f"{TRASH_PREFIX}*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed
