"""Rank side of the checkpoint manager: the policy's sharded state dict, save and load.

A checkpoint holds, through `megatron.core.dist_checkpointing` (torch_dist backend):

- ``model`` / ``model0..`` (one per virtual pipeline chunk): the model's sharded state dict;
- ``optimizer``: DistributedOptimizer state (fp32 main params, Adam moments) in the
  ``fully_reshardable`` format: per-parameter tensors in model space, loadable at any TP/PP/DP
  (``dp_reshardable`` is the shipped buggy variant: its flat buffers only reshard across DP);
- ``rng_state``: python, numpy, torch, CUDA and Megatron's RNG-tracker states of every rank, a
  ShardedObject over (pp, tp, dp), restorable only at the same layout;
- common (saved once): scheduler state, steps done, consumed samples.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")


def _chunks(worker) -> list[torch.nn.Module]:
    from mbridge.core.util import unwrap_model

    return unwrap_model(list(worker.models))


def _model_keys(chunks: list) -> list[str]:
    """Megatron-LM's keys: "model", or "model0", "model1", ... with virtual pipeline chunks."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    return {"random": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank())
    return ShardedObject("rng_state", state, shape, offset, replica_id=0)


def sharded_state_dict(worker, optimizer_format: str, *, is_loading: bool,
                       with_rng: bool = True) -> dict[str, Any]:
    """The whole policy state as Megatron's sharded state dict (Megatron-LM's layout of keys)."""
    from megatron.core import parallel_state as ps

    if optimizer_format not in OPTIMIZER_FORMATS:
        raise ValueError(f"unknown optimizer format {optimizer_format!r}; choose from {OPTIMIZER_FORMATS}")
    chunks = _chunks(worker)
    state: dict[str, Any] = {}
    for i, (name, chunk) in enumerate(zip(_model_keys(chunks), chunks)):
        if len(chunks) > 1:
            ps.set_virtual_pipeline_model_parallel_rank(i)
        state[name] = chunk.sharded_state_dict()
    if len(chunks) > 1:
        ps.set_virtual_pipeline_model_parallel_rank(0)
    state["optimizer"] = worker.optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": optimizer_format})
    state["scheduler"] = worker.scheduler.state_dict()
    state["position"] = {"steps_done": worker.steps_done, "consumed_samples": worker.consumed_samples}
    if with_rng:
        state["rng_state"] = _rng_sharded_object(_rng_state())
    return state


def _ensure_optimizer_state(worker) -> None:
    """Give a never-stepped optimizer its state tensors, which a load overwrites.

    Without Apex/TE, DistributedOptimizer.state_dict() (called by sharded_state_dict when loading)
    asserts that every parameter's state has one common "step"; a fresh torch Adam has no state
    at all, and Megatron's init_state_fn adds the moments but no step.
    """
    for inner in (o.optimizer for o in _distributed_optimizers(worker.optimizer)):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.data),
                                          exp_avg_sq=torch.zeros_like(p.data))


def _distributed_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


class _StepAside:
    """megatron-core 0.16.1 without Apex/TE (torch Adam): `load_parameter_state_from_fully_reshardable`
    copies every key of a parameter's optimizer state from the checkpoint, but the checkpoint's
    per-parameter state has no "step" (torch Adam keeps one per parameter; Megatron restores it from
    the param groups in `load_state_dict`), so the load dies with KeyError: 'step'. Hold "step" aside
    while the parameter state is copied, then put it back."""

    def __init__(self, optimizer):
        self.inner = [o.optimizer for o in _distributed_optimizers(optimizer)]
        self.held: list[tuple[dict, Any]] = []

    def __enter__(self):
        for inner in self.inner:
            for state in inner.state.values():
                if "step" in state:
                    self.held.append((state, state.pop("step")))
        return self

    def __exit__(self, *exc) -> None:
        for state, step in self.held:
            state["step"] = step


def _unshare_steps(optimizer) -> None:
    """megatron-core 0.16.1 without Apex/TE: `DistributedOptimizer.load_state_dict` gives every
    parameter's torch-Adam state the SAME "step" tensor, and torch Adam increments each parameter's
    step in place, so the first step after a load advances it once per parameter (2 -> 37 with 35
    parameters): wrong bias correction, and the resumed weights drift from an uninterrupted run
    (2.5e-4 after one step on tiny-qwen3). Give each parameter its own copy."""
    for dist_opt in _distributed_optimizers(optimizer):
        for state in dist_opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _load_optimizer(optimizer, state_dict, unshare_steps: bool = True) -> None:
    """`optimizer.load_state_dict`, with the two torch-Adam "step" workarounds (see above)."""
    for dist_opt in _distributed_optimizers(optimizer):
        original = dist_opt.load_parameter_state_from_fully_reshardable

        def load_param_state(param_state, _original=original, _opt=dist_opt):
            with _StepAside(_opt):
                _original(param_state)

        dist_opt.load_parameter_state_from_fully_reshardable = load_param_state
    try:
        with torch.no_grad():  # the dp_reshardable path copies into leaf main params without it
            optimizer.load_state_dict(state_dict)
    finally:
        for dist_opt in _distributed_optimizers(optimizer):
            del dist_opt.load_parameter_state_from_fully_reshardable  # back to the class method
    if unshare_steps:
        _unshare_steps(optimizer)


def _strategies(directory: str, group, fully_parallel: bool, loading: bool):
    from megatron.core.dist_checkpointing.serialization import (
        get_default_load_sharded_strategy, get_default_save_sharded_strategy)
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper)

    if loading:
        strategy = get_default_load_sharded_strategy(directory)
        return FullyParallelLoadStrategyWrapper(strategy, group) if fully_parallel else strategy
    strategy = get_default_save_sharded_strategy("torch_dist")
    return FullyParallelSaveStrategyWrapper(strategy, group) if fully_parallel else strategy


def save(worker, directory: str, optimizer_format: str, fully_parallel_save: bool) -> dict[str, int]:
    """Write this rank's part of `worker` into `directory` (every rank at once, through
    `PolicyHandle.apply`); returns the data position it saved."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    state = sharded_state_dict(worker, optimizer_format, is_loading=False)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    dist_checkpointing.save(state, directory,
                            sharded_strategy=_strategies(directory, group, fully_parallel_save, False),
                            content_metadata={"distrib_optim_sharding_type": optimizer_format})
    return dict(state["position"])


# Upstream bugs, shipped as selectable wrong variants of the load (see harness.checkpoint.manager).
LOAD_VARIANTS = {
    "shared-adam-step": "megatron-core 0.16.1 (no Apex/TE): one Adam step tensor shared by every "
                        "parameter after a load",
}


def load(worker, directory: str, optimizer_format: str, fully_parallel_load: bool,
         load_rng: bool, variant: str | None = None) -> dict[str, Any]:
    """Replace `worker`'s whole state by the checkpoint's (every rank at once, through
    `PolicyHandle.apply`); returns the data position it loaded."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    _ensure_optimizer_state(worker)
    template = sharded_state_dict(worker, optimizer_format, is_loading=True, with_rng=load_rng)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    loaded = dist_checkpointing.load(template, directory,
                                     sharded_strategy=_strategies(directory, group, fully_parallel_load, True))
    for name, chunk in zip(_model_keys(_chunks(worker)), _chunks(worker)):
        chunk.load_state_dict(loaded[name])
    _load_optimizer(worker.optimizer, loaded["optimizer"], unshare_steps=variant != "shared-adam-step")
    worker.scheduler.load_state_dict(loaded["scheduler"])
    worker.steps_done = int(loaded["position"]["steps_done"])
    worker.consumed_samples = int(loaded["position"]["consumed_samples"])
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    return dict(loaded["position"])
