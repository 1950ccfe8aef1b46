"""Distributed launch: a persistent world of ranks reused across tests and layouts, started as
local processes (`World`) or as Ray actors (`RayWorld`); `make_world(..., launcher=...)` picks."""
from harness.launch.errors import (
    RankDied,
    RankError,
    RemoteTraceback,
    WorldError,
    WorldStartError,
    WorldTimeout,
)
from harness.launch.rank import RankContext, context
from harness.launch.launchers import LAUNCHERS, ensure_ray, make_world, shutdown_ray
from harness.launch.pool import WorldPool
from harness.launch.world import World

__all__ = [
    "LAUNCHERS", "World", "WorldPool", "context", "ensure_ray", "make_world", "shutdown_ray", "RankContext", "WorldError", "WorldStartError", "WorldTimeout",
    "RankDied", "RankError", "RemoteTraceback",
]
