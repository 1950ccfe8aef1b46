"""Distributed launch: a persistent world of rank processes reused across tests and layouts."""
from harness.launch.errors import (
    RankDied,
    RankError,
    RemoteTraceback,
    WorldError,
    WorldStartError,
    WorldTimeout,
)
from harness.launch.rank import RankContext, context
from harness.launch.pool import WorldPool
from harness.launch.world import World

__all__ = [
    "World", "WorldPool", "context", "RankContext", "WorldError", "WorldStartError", "WorldTimeout",
    "RankDied", "RankError", "RemoteTraceback",
]
