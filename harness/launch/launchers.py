"""Which launcher starts a world: local rank processes (`process`, the default) or Ray actors (`ray`).

    world = make_world(2, "cpu", launcher="ray")   # after ensure_ray()

`ensure_ray(address)` attaches to a running cluster (an address, or RAY_ADDRESS) or starts a local
Ray instance once for this process; `shutdown_ray()` stops only an instance started here.
"""
from __future__ import annotations

import os
from typing import Any

LAUNCHERS = ("process", "ray")
_started_here = False


def make_world(size: int, device: str = "cpu", *, launcher: str = "process", **kwargs: Any):
    if launcher == "process":
        from harness.launch.world import World

        return World(size, device, **kwargs)
    if launcher == "ray":
        from harness.launch.ray_world import RayWorld

        return RayWorld(size, device, **kwargs)
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


def ensure_ray(address: str | None = None, *, num_cpus: int | None = None) -> None:
    """Connect to `address` (or $RAY_ADDRESS), else start a local instance with `num_cpus` logical
    CPUs (default: max(8, cores), so a 4-rank CPU world fits on a 2-core machine)."""
    global _started_here
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    quiet = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        return
    ray.init(num_cpus=num_cpus or max(8, os.cpu_count() or 1), **quiet)
    _started_here = True


def shutdown_ray() -> None:
    """Stop the local Ray instance if `ensure_ray` started it (an attached cluster is left running)."""
    global _started_here
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _started_here = False
