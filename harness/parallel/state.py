"""Switch Megatron model-parallel state inside a live world, without new processes.

The Megatron-LM `Utils.initialize_model_parallel` pattern (destroy, then init) with one change: the
process groups of each layout are created once per rank process and reused whenever that layout
comes back. Megatron's `destroy_model_parallel` only drops its references (c10d keeps the groups,
gloo their threads, NCCL their communicators), and destroying the groups ourselves costs ~1 s per
NCCL group that has communicated (measured on H200: parity tests took ~18 s each instead of ~2 s).
Re-creating them per switch instead exhausted the GPUs' resources after ~100 switches ("NCCL
Error 1: unhandled cuda error", 4x H200). Caching bounds the groups by the number of distinct
layouts a world ever sees.
"""
from __future__ import annotations

import functools
import os
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from harness.parallel.layout import Layout, parse_layout, resolve, validate

DEFAULT_SEED = 1234

_pristine: dict[str, Any] | None = None  # parallel_state's globals before any layout
_by_layout: dict[tuple, dict[str, Any]] = {}  # parallel_state's globals, per initialized layout


def as_layout(layout: Layout | str) -> Layout:
    return layout if isinstance(layout, Layout) else parse_layout(layout)


def _state_names(module: types.ModuleType) -> list[str]:
    """parallel_state's module-level data (groups, ranks, buffers), not its functions/imports."""
    return [name for name, value in vars(module).items()
            if name.startswith("_") and not name.startswith("__")
            and not isinstance(value, (types.FunctionType, types.ModuleType, type))]


def _snapshot(module: types.ModuleType) -> dict[str, Any]:
    return {name: getattr(module, name) for name in _state_names(module)}


def _restore(module: types.ModuleType, state: dict[str, Any]) -> None:
    for name, value in state.items():
        setattr(module, name, value)


def _layout_key(layout: Layout) -> tuple:
    # Sequence parallelism is a model setting: it does not change the groups.
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in layout.megatron_kwargs().items()))


@contextmanager
def model_parallel(layout: Layout | str, seed: int | None = DEFAULT_SEED) -> Iterator[Layout]:
    """Make `layout` Megatron's parallel state on this rank; leave the previous state on exit.

    Must run on every rank of the world at once (a layout's first use creates process groups).
    `seed` reseeds Megatron's RNG tracker; None keeps every RNG as it is (a persistent worker's
    later calls, whose dropout stream must continue, or come from a checkpoint).
    """
    global _pristine
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    layout = resolve(as_layout(layout), dist.get_world_size())
    validate(layout, dist.get_world_size())
    if _pristine is None:
        _pristine = _snapshot(parallel_state)
    previous = _snapshot(parallel_state)
    key = _layout_key(layout)
    if key in _by_layout:
        _restore(parallel_state, _by_layout[key])
    else:
        _restore(parallel_state, _pristine)
        parallel_state.initialize_model_parallel(**layout.megatron_kwargs())
        _by_layout[key] = _snapshot(parallel_state)
    try:
        if seed is not None:
            model_parallel_cuda_manual_seed(seed)
        yield layout
    finally:
        _restore(parallel_state, previous)


def _call_in_layout(layout: Layout, seed: int | None, fn: Callable[..., Any], args, kwargs) -> Any:
    with model_parallel(layout, seed) as active:
        return fn(active, *args, **kwargs)


def run_in_layout(world, layout: Layout | str, fn: Callable[..., Any], *args: Any,
                  model: Any = None, seed: int | None = DEFAULT_SEED, timeout: float | None = None,
                  **kwargs: Any) -> list[Any]:
    """Run `fn(layout, *args, **kwargs)` on every rank of `world` under `layout`.

    The layout is resolved against the world size and validated (against `model` too, when given)
    in the parent first, so a bad layout is one clear error before any rank does work. `model` is
    a config object, or a zoo name / HF checkpoint dir whose config is read; an HF model (name,
    dir or PretrainedConfig) must also pass harness.bridge.preflight.check_model_supported.
    """
    resolved = resolve(as_layout(layout), world.size)
    if isinstance(model, (str, os.PathLike)):  # a zoo name or checkpoint dir: materialized once, here
        from harness.models import resolve_model

        model = resolve_model(model)
    from transformers import PretrainedConfig

    if isinstance(model, (os.PathLike, PretrainedConfig)):  # an HF model (not e.g. a ProbeSpec):
        from harness.bridge.preflight import check_model_supported

        model = check_model_supported(model)  # refuse what the bridge would not convert; its config
    validate(resolved, world.size, model)
    from harness.parallel.layout import check_backend

    check_backend(resolved, world.device, getattr(world, "spec", "local"))  # CP: TE on CUDA only
    call = functools.partial(_call_in_layout, resolved, seed, fn, args, kwargs)
    call.mrh_name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)} under {resolved}"
    return world.run(call, timeout=timeout)
