"""Each resident worker's own RNG streams (rank-side).

A rank process hosts several resident workers (policies, references) and runs other calls between
theirs; a default-seed `run_in_layout` reseeds Megatron's RNG, and so does building a new handle.
So that a worker's dropout stream carries over between its calls whatever runs in between, each
worker keeps its own states and `RNGStreams.active()` swaps them in for one call on it, saves them
back after, and gives the process back the states it had before (callers outside handles see no
change). The states (`capture`):

- "random", "numpy": python's and numpy's global generators;
- "torch": torch's CPU generator;
- "cuda": the current CUDA device's default generator (None without CUDA): Megatron's default
  stream, used e.g. by dropout outside tensor-parallel regions;
- "tracker": Megatron's `get_cuda_rng_tracker()` named states (model-parallel, data-parallel and
  expert streams, forked e.g. for dropout inside tensor-parallel regions).

On the CPU backend (`harness.backends.cpu_patches`) Megatron's CUDA generator IS torch's CPU
generator and the tracker's states are CPU-generator states: "torch" then covers Megatron's
default stream and "cuda" is None.
"""
from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def capture() -> dict[str, Any]:
    """This process's RNG states now (copies: later draws do not change them)."""
    from megatron.core import tensor_parallel

    return {"random": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,  # a CUDA rank
            "tracker": {name: _clone(state) for name, state
                        in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}


def restore(state: dict[str, Any]) -> None:
    """Make `state` (from `capture`) this process's RNG states."""
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if state["tracker"]:
        # A copy: the tracker keeps the dict it is given and replaces its entries as it forks.
        tracker.set_states({name: _clone(s) for name, s in state["tracker"].items()})
    else:  # a process whose tracker was never seeded
        tracker.reset()


def seed_all(seed: int) -> None:
    """Seed every stream from `seed` alone (call inside a Megatron layout: the tracker's
    tensor-parallel stream depends on the TP rank)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that seeds every GPU too
    model_parallel_cuda_manual_seed(seed)  # the current CUDA device's generator and the tracker


class RNGStreams:
    """A worker's own RNG states. `active()` makes them the process's for one call."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self._active = False

    @classmethod
    def seeded(cls, seed: int) -> RNGStreams:
        """Streams that depend on `seed` (and the layout) only; the process's are untouched."""
        outside = capture()
        try:
            seed_all(seed)
            return cls(capture())
        finally:
            restore(outside)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Swap these states in; on exit keep where they got to and restore the process's."""
        if self._active:  # a nested call on the same worker: already in
            yield
            return
        outside = capture()
        restore(self.state)
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self.state = capture()
            restore(outside)

    def current(self) -> dict[str, Any]:
        """The worker's states as of now (live while active)."""
        return capture() if self._active else self.state

    def replace(self, state: dict[str, Any]) -> None:
        """Make `state` the worker's (e.g. a checkpoint's), live at once while active."""
        if self._active:
            restore(state)
        else:
            self.state = state
