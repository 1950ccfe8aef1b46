"""Rank-side pieces of a checkpoint that do not depend on whose state it is.

What a policy checkpoint holds is `PolicyWorker.sharded_state_dict` (harness.training.policy);
this module has the format names, Megatron-LM's key names for model chunks, the per-rank RNG
object, and the dist_checkpointing (torch_dist) save and load with their strategies.
"""
from __future__ import annotations

from typing import Any

# DistributedOptimizer state formats: "fully_reshardable" holds per-parameter tensors in model
# space (loadable at any TP/PP/DP); "dp_reshardable" holds the flat buffers of one TP/PP layout
# (reshards across DP only): the shipped buggy variant.
OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")


def model_keys(chunks: int) -> list[str]:
    """Megatron-LM's keys: "model", or "model0", "model1", ... with virtual pipeline chunks."""
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def rng_sharded_object(state: dict[str, Any]):
    """This rank's RNG states as one ShardedObject over (pp, tp, dp): every rank saves its own,
    restorable only at the same layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank())
    return ShardedObject("rng_state", state, shape, offset, replica_id=0)


def _group():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True)


def save_strategy(fully_parallel: bool):
    """torch_dist; fully_parallel spreads the writing of replicated shards over the data-parallel ranks."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy("torch_dist")
    return FullyParallelSaveStrategyWrapper(strategy, _group()) if fully_parallel else strategy


def save_sharded(saver, state: dict[str, Any], directory: str, optimizer_format: str, fully_parallel: bool,
                 *, async_save: bool = False, iteration: int | None = None,
                 allow_overlap: bool = False) -> dict[str, float]:
    """Write this rank's part of `state` (every rank at once) through `saver`
    (harness.checkpoint.async_save.RankSaver): inline, or scheduled with async_save."""
    return saver.save(state, directory, strategy=save_strategy(fully_parallel),
               content_metadata={"distrib_optim_sharding_type": optimizer_format}, async_save=async_save,
               iteration=iteration, allow_overlap=allow_overlap)


def load_sharded(template: dict[str, Any], directory: str, fully_parallel: bool) -> dict[str, Any]:
    """Read `template`'s keys from `directory` (every rank at once). Note: megatron-core's
    torch_dist loader zeroes the template's shape-mismatch-tolerant tensors (the vocab-padded
    embedding and output layer, which alias the live weights) before it validates the load."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    strategy = get_default_load_sharded_strategy(directory)
    if fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(strategy, _group())
    return dist_checkpointing.load(template, directory, sharded_strategy=strategy)
