"""A rank process's RNG states (rank-side): what a checkpoint saves per rank and restores.

The states (`capture`):

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
from typing import Any

import numpy as np
import torch


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def capture() -> dict[str, Any]:
    """This process's RNG states now (copies: later draws do not change them)."""
    from megatron.core import tensor_parallel

    return {"random": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": {name: _clone(state) for name, state
                        in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}


def restore(state: dict[str, Any]) -> None:
    """Make `state` (from `capture`) this process's RNG states."""
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if state["tracker"]:
        # A copy: the tracker keeps the dict it is given and replaces its entries as it forks.
        tracker.set_states({name: _clone(s) for name, s in state["tracker"].items()})
    else:  # a process whose tracker was never seeded
        tracker.reset()
