"""Switch Megatron model-parallel state inside a live world, without new processes.

The Megatron-LM `Utils.initialize_model_parallel` pattern: destroy whatever state is there, then
initialize the requested layout; destroy again on exit so the next test starts clean.
"""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from harness.parallel.layout import Layout, parse_layout, resolve, validate

DEFAULT_SEED = 1234


def as_layout(layout: Layout | str) -> Layout:
    return layout if isinstance(layout, Layout) else parse_layout(layout)


@contextmanager
def model_parallel(layout: Layout | str, seed: int = DEFAULT_SEED) -> Iterator[Layout]:
    """Initialize `layout` in Megatron's parallel_state on this rank; destroy it on exit.

    Must run on every rank of the world at once (it creates process groups).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    layout = resolve(as_layout(layout), dist.get_world_size())
    validate(layout, dist.get_world_size())
    parallel_state.destroy_model_parallel()
    existing = _process_groups()
    parallel_state.initialize_model_parallel(**layout.megatron_kwargs())
    try:
        model_parallel_cuda_manual_seed(seed)
        yield layout
    finally:
        parallel_state.destroy_model_parallel()
        # Megatron only drops its references; c10d keeps every group (and gloo its threads, NCCL
        # its communicators) alive. Without this a persistent world gains ~40 groups per switch.
        for group in _process_groups() - existing:
            if _should_destroy(group):
                dist.destroy_process_group(group)


def _should_destroy(group) -> bool:
    """Gloo-only groups always; groups with an NCCL backend unless MRH_KEEP_NCCL_GROUPS=1
    (shutting an NCCL group down can cost a second: a layout creates ~20 of them)."""
    import torch.distributed as dist

    if os.environ.get("MRH_KEEP_NCCL_GROUPS") == "1":
        return "nccl" not in str(dist.get_backend(group))
    return True


def _process_groups() -> set:
    """Every live process group of this rank except the default one."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world  # private, but the only registry of live groups
    return {group for group in world.pg_map if group is not dist.GroupMember.WORLD}


def _call_in_layout(layout: Layout, seed: int, fn: Callable[..., Any], args, kwargs) -> Any:
    with model_parallel(layout, seed) as active:
        return fn(active, *args, **kwargs)


def run_in_layout(world, layout: Layout | str, fn: Callable[..., Any], *args: Any,
                  model: Any = None, seed: int = DEFAULT_SEED, timeout: float | None = None,
                  **kwargs: Any) -> list[Any]:
    """Run `fn(layout, *args, **kwargs)` on every rank of `world` under `layout`.

    The layout is resolved against the world size and validated (against `model` too, when given)
    in the parent first, so a bad layout is one clear error before any rank does work.
    """
    resolved = resolve(as_layout(layout), world.size)
    validate(resolved, world.size, model)
    call = functools.partial(_call_in_layout, resolved, seed, fn, args, kwargs)
    return world.run(call, timeout=timeout)
