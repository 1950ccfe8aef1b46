"""Parent-side handles on workers that live in a world's rank processes across calls.

A `PolicyHandle` builds a `PolicyWorker` on every rank of a world under one layout and keeps it
there: each later call (a step, logprobs, an export, a checkpoint save or load) runs on the same
rank-side objects, so optimizer state, step counters and RNG streams carry over as in a real
training loop. Each worker owns its RNG streams (`harness.training.rng`), seeded from the handle's
`seed` when it is built: every call on the handle runs with them swapped in and saves them back
after, so another handle's calls, a new handle or a default-seed `run_in_layout` in between
change nothing, and a checkpoint's restored RNG state is what the next step uses.

    policy = PolicyHandle(world, "tp2", "tiny-qwen3", lr=1e-3, micro_batches=2)
    stats = policy.step(train_batch)      # {"loss", "clip_fraction", "grad_norm", "lr", "micro_batches": [...]}
    state = policy.hf_state_dict()        # full HF tensors, for comparisons
    policy.close()

`ReferenceHandle` does the same for the frozen reference/old-policy worker. The pytest fixtures
`policy` and `reference` (harness.pytest_plugin.workers) make these and close them after the test.
"""
from __future__ import annotations

import gc
import itertools
import math
import os
from typing import Any, Callable

import torch

from harness.models import load_hf_config, resolve_model
from harness.parallel.layout import Layout, resolve
from harness.parallel.layout import check_backend
from harness.parallel.state import DEFAULT_SEED, as_layout, run_in_layout
from harness.variants import require

# ----------------------------------------------------------------------------- rank side
_WORKERS: dict[str, Any] = {}  # this rank's live workers, by handle key


def _worker(key: str):
    try:
        return _WORKERS[key]
    except KeyError:
        raise RuntimeError(f"worker {key!r} is not on this rank: it was closed, or the world "
                           "restarted after a failure (make a new handle)") from None


def _create_policy(layout: Layout, key: str, path, config_kwargs: dict[str, Any], seed: int) -> None:
    from harness.training.policy import PolicyConfig, PolicyWorker

    _WORKERS[key] = PolicyWorker(path, PolicyConfig(**config_kwargs),
                                 sequence_parallel=layout.sequence_parallel, seed=seed)


def _create_reference(layout: Layout, key: str, path, dtype: torch.dtype, seed: int) -> None:
    from harness.training.reference import ReferenceWorker

    _WORKERS[key] = ReferenceWorker(path, dtype=dtype, sequence_parallel=layout.sequence_parallel,
                                    seed=seed)


def _apply(layout: Layout, key: str, fn: Callable[..., Any], args, kwargs) -> Any:
    worker = _worker(key)
    with worker.rng.active():  # the worker's own RNG streams for this call, the process's after
        return fn(worker, *args, **kwargs)


def _drop(layout: Layout, key: str) -> None:
    worker = _WORKERS.pop(key, None)
    saver = getattr(worker, "saver", None)
    if saver is not None and saver.pending():  # a save never finalized: no writer outlives its worker
        saver.abort()
    if worker is not None and hasattr(worker, "optimizer"):
        # megatron-core 0.16.1's DDP registers backward hooks that close over the DDP module on
        # AccumulateGrad nodes its parameters keep alive: a cycle through C++ autograd nodes that
        # the gc cannot collect (found here: every policy the persistent world built stayed
        # allocated). The objects leak; their device memory does not: free every storage now.
        worker.offloader.discard()
    del worker
    # What else the worker held in collectable cycles (Megatron's model config holds bound methods
    # of the model and the optimizer) goes now, not in an automatic gc during a later call: on the
    # H100 such a gc freed 512 bytes in the middle of the next test's exact offload measurement.
    gc.collect()
    if torch.cuda.is_initialized():  # a CUDA rank (a CPU rank on a GPU host must not touch CUDA)
        torch.cuda.empty_cache()  # hand the freed model and optimizer memory back


# Rank functions a handle applies to its worker (module-level: they travel by reference).
def _call_method(worker, method: str, *args, **kwargs):
    return getattr(worker, method)(*args, **kwargs)


def _export(worker):
    import torch.distributed as dist

    state = worker.export()
    return state if dist.get_rank() == 0 else None


def _position(worker):
    return {**worker.position(), "lr": worker.lr}


# ----------------------------------------------------------------------------- parent side
_keys = itertools.count()


def _components(params: bool, grads: bool, optimizer: bool) -> list[str]:
    chosen = [name for name, on in (("params", params), ("grads", grads), ("optimizer", optimizer)) if on]
    if not chosen:
        raise ValueError("name at least one component: params=, grads= or optimizer=")
    return chosen


class _Handle:
    kind = "worker"

    def __init__(self, world, layout: Layout | str, model, seed: int) -> None:
        self.world = world
        self.layout = resolve(as_layout(layout), world.size)
        self.path = resolve_model(model)  # materialize a zoo model once, in the parent
        self.key = f"{self.kind}-{os.getpid()}-{next(_keys)}"
        self.seed = seed
        self.closed = False

    def apply(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
              **kwargs: Any) -> list[Any]:
        """`fn(worker, *args, **kwargs)` on every rank, under this handle's layout with the worker's
        own RNG streams swapped in; returns each rank's result. `fn` must be a module-level function."""
        if self.closed:
            raise RuntimeError(f"{self} is closed")
        return run_in_layout(self.world, self.layout, _apply, self.key, fn, args, kwargs,
                             seed=None, timeout=timeout)

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """`worker.<method>(*args, **kwargs)` on every rank; returns each rank's result."""
        return self.apply(_call_method, method, *args, timeout=timeout, **kwargs)

    def logprobs(self, batch, micro_batches: int | None = None, temperature: float = 1.0) -> torch.Tensor:
        """[B, S] logprobs of `batch` under the current weights (0 where undefined), assembled from
        the ranks; `micro_batches` per data-parallel rank, by default the fewest the layout takes; the
        logits divided by `temperature` (a rollout engine's sampling temperature)."""
        from harness.logprobs.megatron import assemble

        micro_batches = micro_batches or self.layout.micro_batch_multiple
        self.layout.check_micro_batches(micro_batches, "micro_batches")
        logprobs, _ = assemble(self.call("logprobs", batch, micro_batches, temperature))
        return logprobs

    def offload_accounting(self) -> list[dict[str, Any]]:
        """Each rank's `OffloadManager.accounting()`: per component its state, device bytes held
        now, bytes by theory, host shadow bytes (harness.offload)."""
        return self.call("offload_accounting")

    def close(self) -> None:
        """Free the rank-side worker (idempotent; a restarted world has nothing to free)."""
        if self.closed:
            return
        self.closed = True
        if self.world.alive:
            run_in_layout(self.world, self.layout, _drop, self.key, seed=None)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.key} {self.layout} {self.path.name}>"


class PolicyHandle(_Handle):
    """A Megatron policy (DDP + DistributedOptimizer) resident on every rank of `world`.

    `config` are `PolicyConfig` fields (lr, micro_batches, dtype, dropout, loss_kwargs, variant...).
    The layout is validated against the world and the model before any rank builds anything.
    """

    kind = "policy"

    def __init__(self, world, layout: Layout | str, model="tiny-qwen3", *,
                 seed: int = DEFAULT_SEED, **config: Any) -> None:
        from harness.training.policy import PolicyConfig

        unknown = sorted(set(config) - set(PolicyConfig.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unknown PolicyConfig field(s) {unknown}")
        super().__init__(world, layout, model, seed)
        require(config.get("variant"), check="training", layout=self.layout,
                config=load_hf_config(self.path))
        require(config.get("offload_variant"), check="offload")
        self.layout.check_micro_batches(config.get("micro_batches", 1), "micro_batches")
        if config.get("dtype", "fp32") not in ("fp32", "bf16"):
            raise ValueError(f"unknown policy dtype {config['dtype']!r}; choose from ['bf16', 'fp32']")
        check_backend(self.layout, world.device, world.spec, config.get("dtype", "fp32"))  # CP: TE, bf16
        if config.get("batch_invariant"):
            from harness.backends.batch_invariant import check

            check(world.device)  # before any rank builds anything
        self.config = dict(config)
        run_in_layout(world, self.layout, _create_policy, self.key, self.path, self.config, seed,
                      model=self.path, seed=None)  # the worker seeds its own streams

    def step(self, train_batch) -> dict[str, Any]:
        """One optimizer step on the global batch: loss, grad_norm, lr, micro_batches."""
        return self._agreed(self.call("train_step", train_batch))

    @staticmethod
    def _agreed(results: list[dict[str, Any]]) -> dict[str, Any]:
        # Every rank reduces the same global loss and grad norm; a rank that disagrees has trained
        # on something else (a broken group, a wrong shard): fail loudly rather than report rank 0's.
        for rank, result in enumerate(results[1:], start=1):
            if not all(math.isclose(result[k], results[0][k], rel_tol=1e-12) for k in ("loss", "grad_norm")):
                raise RuntimeError(f"rank {rank} reports loss {result['loss']!r}, grad norm "
                                   f"{result['grad_norm']!r}; rank 0 {results[0]['loss']!r}, "
                                   f"{results[0]['grad_norm']!r}")
        return results[0]

    def steps(self, train_batches) -> list[dict[str, Any]]:
        return [self.step(tb) for tb in train_batches]

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full HF state dict of the current weights."""
        return self.apply(_export)[0]

    def save(self, directory, **options: Any):
        """Checkpoint the whole state (`harness.checkpoint.save_checkpoint`); returns the manifest."""
        from harness.checkpoint import save_checkpoint

        return save_checkpoint(self, directory, **options)

    def checkpointer(self, root, knobs=None, **options: Any):
        """A `harness.checkpoint.checkpointer.Checkpointer` of this policy into `root`: numbered
        checkpoints, a tracker, `keep` rotation, sync or async saves, resume. `options` are
        CheckpointKnobs fields (async_save, keep, fully_parallel_save, ...) and `variant`."""
        from harness.checkpoint.checkpointer import Checkpointer

        return Checkpointer(self, root, knobs, **options)

    def load(self, directory, **options: Any) -> dict[str, Any]:
        """Replace the whole state by a checkpoint's (`harness.checkpoint.load_checkpoint`)."""
        from harness.checkpoint import load_checkpoint

        return load_checkpoint(self, directory, **options)

    def position(self) -> dict[str, Any]:
        """steps_done, consumed_samples and the current lr (rank 0's; all ranks agree)."""
        return self.apply(_position)[0]

    # A step in pieces (gradient accumulation across calls): begin_step, accumulate, finish_step.
    def begin_step(self, train_batch) -> None:
        self.call("begin_step", train_batch)

    def accumulate(self, indices) -> None:
        """Forward and backward of micro-batches `indices` of each rank's share (under VPP a
        multiple of pp of them per call: `Layout.micro_batch_multiple`)."""
        indices = list(indices)
        self.layout.check_micro_batches(len(indices), "micro-batches per accumulate call")
        self.call("accumulate", indices)

    def finish_step(self) -> dict[str, Any]:
        return self._agreed(self.call("finish_step"))

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> list[list[dict]]:
        """Free the chosen components on the device (harness.offload: params and optimizer state
        to one host shadow per storage; grads discarded, refused inside an open accumulation);
        each rank's rows: component, theory and measured bytes, host shadow bytes."""
        return self.call("offload", _components(params, grads, optimizer))

    def reload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> list[list[dict]]:
        """Bring the chosen components back (grads as zeros); each rank's rows."""
        return self.call("reload", _components(params, grads, optimizer))


class ReferenceHandle(_Handle):
    """A frozen Megatron model (old-policy or reference logprobs) resident on every rank."""

    kind = "reference"

    def __init__(self, world, layout: Layout | str, model="tiny-qwen3", *,
                 dtype: torch.dtype = torch.float32, seed: int = DEFAULT_SEED) -> None:
        super().__init__(world, layout, model, seed)
        check_backend(self.layout, world.device, world.spec, "fp32" if dtype == torch.float32 else None)
        run_in_layout(world, self.layout, _create_reference, self.key, self.path, dtype, seed,
                      model=self.path, seed=None)  # the worker seeds its own streams

    def offload(self, params: bool = True) -> list[list[dict]]:
        """Free the frozen params on the device (one host shadow per storage); each rank's rows."""
        return self.call("offload", _components(params, False, False))

    def reload(self, params: bool = True) -> list[list[dict]]:
        return self.call("reload", _components(params, False, False))
