"""What each component of a worker holds, found by walking the live objects (no side effects).

Components of a policy worker (megatron-core 0.16.1, DDP with the distributed optimizer):

- params: each DDP buffer's `param_data` (every model parameter is a view of it);
- grads: each DDP buffer's `grad_data` (`main_grad`, bucket views and, after a step, the main
  params' `.grad` are views of it);
- optimizer: every tensor reachable from the optimizer that is not one of those: the fp32 main
  params of a bf16 model (an fp32 model's main shards are views of `param_data`: they go with the
  params), the Adam moments and `step`, whatever else its state holds. Walked, never listed by key
  (verl PR 6635 missed `master_param` that way), across chained optimizers.

A frozen reference worker has params only: each parameter's own storage.

Two figures per component. `held` measures: the bytes of the distinct storages on the device now,
reached through every view (a buffer rebound to the host while the parameters still view the old
device storage still counts). `theory` is what the component should hold by its shapes: padded
buffer numel x element size; each optimizer tensor's numel x element size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from harness.offload.storages import nbytes, storage_id

POLICY = ("params", "grads", "optimizer")
REFERENCE = ("params",)


def ddp_buffers(models) -> Iterator[tuple[str, Any]]:
    """(name, `_ParamAndGradBuffer`) of every DDP chunk, dense and expert-parallel."""
    from megatron.core.distributed import DistributedDataParallel

    for i, model in enumerate(models):
        if isinstance(model, DistributedDataParallel):  # on others `.buffers` is nn.Module's method
            for j, buf in enumerate(list(model.buffers) + list(model.expert_parallel_buffers)):
                yield f"chunk{i}.buffer{j}", buf


def optimizers(optimizer) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _tensors_in(value, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(item, f"{name}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors_in(item, f"{name}.{index}")


def optimizer_tensors(optimizer) -> Iterator[tuple[str, torch.Tensor]]:
    """(stable slot name, tensor) of everything reachable from the optimizer: each param group's
    params, their `.grad`/`.decoupled_grad`, every tensor in their state (recursively). Names
    survive `load_state_dict`, which replaces the state's tensor objects."""
    for i, opt in enumerate(optimizers(optimizer)):
        inner = getattr(opt, "optimizer", None)
        if inner is None:  # a stub optimizer (a rank without parameters)
            continue
        for g, group in enumerate(inner.param_groups):
            for k, param in enumerate(group["params"]):
                name = f"opt{i}.group{g}.param{k}"
                yield name, param
                for attr in ("grad", "decoupled_grad"):
                    value = getattr(param, attr, None)
                    if isinstance(value, torch.Tensor):
                        yield f"{name}.{attr}", value
                yield from _tensors_in(dict(inner.state.get(param, {})), name)


@dataclass
class Storages:
    """Distinct storages of one component: id -> (slot name, a tensor on it)."""

    by_id: dict[int, tuple[str, torch.Tensor]]

    def on(self, device: torch.device) -> "Storages":
        return Storages({k: v for k, v in self.by_id.items() if v[1].device == device})

    def bytes_held(self) -> int:
        return sum(nbytes(t) for _, t in self.by_id.values())

    def ids(self) -> set[int]:
        return set(self.by_id)


def _collect(pairs) -> Storages:
    found: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in pairs:
        found.setdefault(storage_id(tensor), (name, tensor))
    return Storages(found)


def param_storages(worker) -> Storages:
    if hasattr(worker, "optimizer"):
        pairs = []
        for name, buf in ddp_buffers(worker.models):
            pairs.append((f"{name}.param_data", buf.param_data))
            pairs += [(f"{name}.param", p) for p in buf.params]
        return _collect(pairs)
    return _collect((f"chunk{i}.{n}", p) for i, m in enumerate(worker.models) for n, p in m.named_parameters())


def grad_storages(worker) -> Storages:
    pairs = []
    for name, buf in ddp_buffers(worker.models):
        pairs.append((f"{name}.grad_data", buf.grad_data))
        pairs += [(f"{name}.main_grad", p.main_grad) for p in buf.params if getattr(p, "main_grad", None) is not None]
    return _collect(pairs)


def optimizer_storages(worker, exclude: set[int]) -> Storages:
    """Storages reachable from the optimizer that are not in `exclude` (the params' and grads')."""
    found = _collect(optimizer_tensors(worker.optimizer))
    return Storages({k: v for k, v in found.by_id.items() if k not in exclude})


def storages(worker, component: str) -> Storages:
    """Every storage `component` holds, wherever it is now."""
    if component == "params":
        return param_storages(worker)
    if component == "grads":
        return grad_storages(worker)
    if component == "optimizer":
        return optimizer_storages(worker, param_storages(worker).ids() | grad_storages(worker).ids())
    raise ValueError(f"unknown component {component!r}")


def held(worker, component: str, device: torch.device) -> int:
    """Bytes `component` holds on `device` now: its distinct storages there."""
    return storages(worker, component).on(device).bytes_held()


def theory(worker, component: str, device: torch.device) -> list[int]:
    """The bytes of each storage `component` should hold on the device, by shapes alone (call it
    while the component is resident). Optimizer tensors elsewhere (torch Adam's `step` is a host
    scalar beside CUDA moments) are not device bytes."""
    if component == "params" and hasattr(worker, "optimizer"):
        return [buf.numel * buf.param_dtype.itemsize for _, buf in ddp_buffers(worker.models)]
    if component == "params":
        return [t.numel() * t.element_size() for _, t in param_storages(worker).by_id.values()]
    if component == "grads":
        return [buf.numel * buf.grad_dtype.itemsize for _, buf in ddp_buffers(worker.models)]
    found = storages(worker, "optimizer").on(device)
    return [t.numel() * t.element_size() for _, t in found.by_id.values()]
