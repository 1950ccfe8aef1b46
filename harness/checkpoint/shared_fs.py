"""Checkpoints need one directory every rank sees: on more than one node, a shared filesystem.

Each rank writes its own shards into the checkpoint directory and the driver commits it, so a rank
on a node that does not see the driver's directory would write into a local one of the same name:
a checkpoint that looks complete on one node and misses shards everywhere else. `require_shared`
writes a probe (a random token) from the driver and asks every rank to read it back; any rank
that cannot is one clear error before anything is saved or loaded.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

from harness.checkpoint.errors import CheckpointError


def _reads(path: str, token: str) -> bool:
    try:
        with open(path) as f:
            return f.read() == token
    except OSError:
        return False


def require_shared(world, directory: str | os.PathLike, what: str = "a checkpoint") -> None:
    """Raise CheckpointError unless every rank of `world` sees `directory` (or, while it does not
    exist yet, its nearest existing parent)."""
    directory = Path(directory).absolute()
    while not directory.exists():
        directory = directory.parent
    token = uuid.uuid4().hex
    probe = directory / f".mrh-shared-probe-{token[:8]}"
    probe.write_text(token)
    try:
        seen = world.run(_reads, str(probe), token)
    finally:
        probe.unlink(missing_ok=True)
    blind = [rank for rank, ok in enumerate(seen) if not ok]
    if blind:
        nodes = getattr(world, "nodes", None) or []
        where = ", ".join(f"rank {r} on {nodes[r]['host']} ({nodes[r]['ip']})" if r < len(nodes) else f"rank {r}"
                          for r in blind)
        raise CheckpointError(
            f"{directory}: {where} cannot see this directory, so {what} would be split across nodes. "
            "Checkpoints need a shared filesystem, mounted at the same path on every node (NFS, Lustre, ...); "
            "nothing was written.")
