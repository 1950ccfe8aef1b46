"""One persistent world per (size, device), started on first use and reused until closed."""
from __future__ import annotations

from typing import Any

from harness.launch.world import World


class WorldPool:
    """Keeps a world per (size, device). A world torn down by a failure is started afresh by
    the next `get`. Worlds left open are killed at interpreter exit (see `world.py`)."""

    def __init__(self, **world_kwargs: Any):
        self.world_kwargs = world_kwargs
        self._worlds: dict[tuple[int, str], World] = {}

    def get(self, size: int, device: str = "cpu") -> World:
        key = (size, device)
        if key not in self._worlds:
            self._worlds[key] = World(size, device, **self.world_kwargs)
        return self._worlds[key].start()

    def worlds(self) -> list[World]:
        return list(self._worlds.values())

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
