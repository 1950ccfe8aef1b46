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


def optimizer_metadata(optimizer_format: str) -> dict[str, Any]:
    """The sharded-state-dict metadata of the optimizer (and the checkpoint's content metadata).
    `chained_optim_avoid_prefix`, as Megatron-LM's and Megatron-Bridge's trainers set it: without
    it a ChainedOptimizer prefixes its state keys with its index (`chained_1.optimizer.state...`),
    and a MoE policy has one optimizer at ep1 but two at ep >= 2 (dense, expert-parallel), so a
    fully_reshardable checkpoint saved at ep2 misses every key at ep1 and the other way round
    (found here: suites/moe/test_checkpoint.py). The dp_reshardable format keeps the prefix
    either way (megatron-core adds it for every non-fully-reshardable format)."""
    return {"distrib_optim_sharding_type": optimizer_format, "chained_optim_avoid_prefix": True}


def regroup_optimizer_state(loaded: dict[str, Any], optimizers: int) -> dict[str, Any]:
    """The loaded optimizer state, shaped for a ChainedOptimizer of `optimizers` optimizers.

    A MoE policy has one optimizer at ep1 and two at ep >= 2 (dense, expert-parallel): megatron-core
    saves a chained optimizer's plain state (param groups, step flags) as {0: ..., 1: ...} and a
    single one's flat, and keys its param groups by `is_expert_parallel` (True only at ep >= 2).
    dist_checkpointing merges the checkpoint's plain state with the target's tensors as they come,
    so across ep1 <-> ep2 `load_state_dict` misses its "optimizer" entry (ep2 -> ep1) or its groups
    (ep1 -> ep2), although the fully_reshardable tensors themselves load (with
    `chained_optim_avoid_prefix`). The hyperparameters of a group do not depend on the layout: each
    target optimizer gets every saved group, under both values of `is_expert_parallel`."""
    indices = sorted(k for k in loaded if isinstance(k, int))
    saved_single = "optimizer" in loaded  # a single optimizer's plain state sits at the top level
    if saved_single == (optimizers == 1):
        return loaded
    saved = [loaded] if saved_single else [loaded[i] for i in indices]
    rest = {k: v for k, v in loaded.items() if not isinstance(k, int)}
    plain = {k: v for k, v in saved[0].items() if k != "optimizer"}
    groups = [g for part in saved for g in part["optimizer"]["param_groups"]]
    groups = [dict(g, is_expert_parallel=flag) for g in groups for flag in (False, True)]
    inner = {**saved[0]["optimizer"], "param_groups": groups}

    def one(tensors: dict[str, Any]) -> dict[str, Any]:
        tensors = {k: v for k, v in tensors.items() if k != "optimizer"}
        return {**plain, **tensors, "optimizer": inner}

    if optimizers == 1:  # saved chained (ep >= 2), loading at ep1: the tensors sit at the top level
        return one(rest)
    # saved single (ep1), loading chained: the tensors sit under each optimizer's index
    return {i: one(loaded[i]) for i in range(optimizers)}


def model_keys(chunks: int) -> list[str]:
    """Megatron-LM's keys: "model", or "model0", "model1", ... with virtual pipeline chunks."""
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def rng_sharded_object(state: dict[str, Any]):
    """This rank's RNG states as one ShardedObject over (pp, tp, dp), and cp under context
    parallelism: every rank saves its own, restorable only at the same layout. (Without the cp
    dimension the CP ranks of one (pp, tp, dp) position wrote the same key: "Duplicate ShardedObject
    keys" at cp2 on 2 H200s. Layouts without CP keep the three dimensions their checkpoints have.)"""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank())
    cp = ps.get_context_parallel_world_size()
    if cp > 1:
        shape, offset = shape + (cp,), offset + (ps.get_context_parallel_rank(),)
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
               content_metadata=optimizer_metadata(optimizer_format), async_save=async_save,
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
