"""One persistent world per (size, device, layer spec), started on first use and reused until closed."""
from __future__ import annotations

from typing import Any

from harness.launch.base import WorldBase
from harness.launch.launchers import make_world


class WorldPool:
    """Keeps a world per (size, device, spec), started by `launcher` ("process" or "ray"). A world
    torn down by a failure is started afresh by the next `get`. Worlds left open are killed at
    interpreter exit (see `world.py`, `ray_world.py`).

    `spec` (the layer spec the world's ranks build models with, harness.bridge.specs): as asked, or
    the pool's `spec` for that device (the pytest plugin sets it to the running test's), or local."""

    def __init__(self, launcher: str = "process", **world_kwargs: Any):
        self.launcher = launcher
        self.world_kwargs = world_kwargs
        self.spec: dict[str, str] = {}  # device -> the spec a get() without one means
        self._worlds: dict[tuple, WorldBase] = {}

    def get(self, size: int, device: str = "cpu", spec: str | None = None,
            env: dict[str, str] | None = None) -> WorldBase:
        """The world of `size` ranks on `device` and `spec`; `env`: a world of its own whose ranks
        start with these variables (what must be set before CUDA starts, e.g. a precision control)."""
        from harness.bridge import specs

        key = (size, device, specs.for_world(device, spec or self.spec.get(device)), tuple(sorted((env or {}).items())))
        if self.exclusive(device):
            self.release(device, keep=key)
        if key not in self._worlds:
            kwargs = {**self.world_kwargs, "env": {**self.world_kwargs.get("env", {}), **dict(key[3])}}
            self._worlds[key] = make_world(size, device, launcher=self.launcher, spec=key[2], **kwargs)
        return self._worlds[key].start()

    def exclusive(self, device: str) -> bool:
        """Ray reserves each CUDA rank a whole GPU (its bundle), so two CUDA worlds do not fit on
        the GPUs one of them fills; local processes share GPUs, as torchrun jobs would."""
        return self.launcher == "ray" and device == "cuda"

    def release(self, device: str, keep: tuple | None = None) -> None:
        """Close the worlds on `device` (but `keep`): their GPUs go back; the next `get` restarts them."""
        for key, world in self._worlds.items():
            if key[1] == device and key != keep:
                world.close()

    def worlds(self) -> list[WorldBase]:
        return list(self._worlds.values())

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()
