"""The offload manager: move a resident worker's params, grads and optimizer state off the device
and back, separately, with exact accounting.

Colocated RL moves the policy off the GPU while the rollout engine runs and back before training.
How this manager does it, and why:

- Freeing is `untyped_storage().resize_(0)` on each storage a component holds (a DDP buffer's
  `param_data`/`grad_data`, each optimizer storage), reloading `resize_(n)` and a copy back. Every
  view (parameters, `main_grad`, bucket views, fp32 main shards) keeps its storage and offset, so
  aliasing survives; rebinding (`t = t.to("cpu")`) would free nothing while a view lives.
- One host shadow per storage, allocated once (page-locked when the device is a GPU) and reused
  every cycle (verl PR 6193: re-pinning on every offload doubled host memory), always a storage
  of its own (on the CPU tier `t.cpu()` is `t`).
- Gradients are DISCARDED, not copied: they are dead between optimizer steps (a step zeroes them
  first) and reload as zeros, as megatron-core's own `offload_grad_buffers` does. An offload of
  grads inside an open accumulation (`begin_step` .. `finish_step`) would lose them, so it is
  REFUSED (`OffloadRefused`), as NeMo-RL PR 4147 does.
- The residency table here is the only truth for no-ops: offloading what is offloaded and
  reloading what is resident do nothing, whatever the storages look like (SkyRL 905/1266 guessed
  from `hasattr` and sizes and freed live gradients).
- Every method that reads a component calls `require` first and raises `OffloadedError` naming
  it: on the CPU, reading a freed storage segfaults the rank.
- Refused while an async checkpoint save is not finalized (its writer holds this state:
  NeMo-RL PR 3322, SkyRL 565), and with CUDA graphs or NCCL user buffers, which need addresses
  that a reload does not keep (Megatron-LM 3231).

Each offload/reload returns one row per component: the bytes by theory, the bytes measured
(CUDA: the `memory_allocated` delta; CPU: the walked storages' delta), the host shadow bytes.
"""
from __future__ import annotations

import gc
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.offload import inventory
from harness.offload.storages import host_buffer, nbytes, rounded, storage_id, synchronize, whole

# The offload variants of the catalog (harness.variants) this manager implements.
IMPLEMENTED = ("grad-size-not-recorded", "hasattr-guard", "rebind-not-storage", "repin-each-offload",
               "master-params-left", "mcore-optimizer-offload", "expert-buffers-left")
OFFLOAD_ORDER = ("optimizer", "grads", "params")  # the optimizer walk never reads a freed view


class OffloadedError(RuntimeError):
    """An operation needs a component that is offloaded."""


class OffloadRefused(RuntimeError):
    """An offload that would lose state or leave memory held; nothing was changed."""


@dataclass
class Slot:
    """One storage a component frees: `view` is a flat uint8 view of all of it."""

    name: str
    view: torch.Tensor
    copy: bool  # grads are discarded: no host copy
    nbytes: int = 0
    owner: Any = None  # the DDP buffer (variants that work on it)


@dataclass
class Residency:
    offloaded: bool = False
    slots: list[Slot] = field(default_factory=list)
    theory: list[int] = field(default_factory=list)  # bytes per storage, recorded at the offload
    cycles: int = 0


class OffloadManager:
    """Offload and reload of one worker's components (policy: params, grads, optimizer;
    reference: params). `variant` is an offload variant of the catalog (a known bug, on purpose)."""

    def __init__(self, worker, device: torch.device, variant: str | None = None) -> None:
        self._worker = weakref.ref(worker)  # no cycle: a dropped worker frees its device memory at once
        self.device = torch.device(device)
        self.variant = variant
        self.components = inventory.POLICY if hasattr(worker, "optimizer") else inventory.REFERENCE
        self.table = {c: Residency() for c in self.components}
        # (component, slot name) -> its host bytes, allocated once; and how many were allocated
        self.shadows: dict[tuple[str, str], torch.Tensor] = {}
        self.allocations: Counter = Counter()
        self.peak_host_bytes = 0

    @property
    def worker(self):
        return self._worker()

    # ----------------------------------------------------------------- residency
    def require(self, *components: str, what: str) -> None:
        """Raise OffloadedError when any of `components` is offloaded (before `what` reads it)."""
        missing = [c for c in components if c in self.table and self.table[c].offloaded]
        if missing:
            raise OffloadedError(f"{what} needs the {', '.join(missing)} on the device, and they are offloaded: "
                                 f"reload({', '.join(f'{c}=True' for c in missing)}) first")

    def _check(self, components: tuple[str, ...]) -> None:
        unknown = [c for c in components if c not in self.components]
        if unknown:
            raise ValueError(f"a {'policy' if len(self.components) > 1 else 'reference'} worker has no "
                             f"{', '.join(unknown)} to offload; it has {', '.join(self.components)}")

    def _refuse(self, components: tuple[str, ...]) -> None:
        worker = self.worker
        if "grads" in components and getattr(worker, "accumulating", None) is not None \
                and not self.table["grads"].offloaded:
            raise OffloadRefused("the grads hold an open gradient accumulation (begin_step .. finish_step): an "
                                 "offload discards grads, so finish the step first")
        saver = getattr(worker, "saver", None)
        if saver is not None and saver.pending():
            raise OffloadRefused("an async checkpoint save is not finalized: its writer still holds this state "
                                 "(finalize the checkpoint first)")
        for model in worker.models:
            ddp_config = getattr(model, "ddp_config", None)
            config = getattr(model, "config", None)
            if getattr(ddp_config, "nccl_ub", False) or getattr(config, "cuda_graph_impl", "none") != "none" \
                    or getattr(config, "enable_cuda_graph", False):
                raise OffloadRefused("CUDA graphs or NCCL user buffers keep device addresses that a reload "
                                     "does not preserve (Megatron-LM issue 3231)")

    # ----------------------------------------------------------------- offload / reload
    def offload(self, components: tuple[str, ...]) -> list[dict[str, Any]]:
        self._check(components)
        self._refuse(components)
        return [self._offload(c) for c in OFFLOAD_ORDER if c in components]

    def reload(self, components: tuple[str, ...]) -> list[dict[str, Any]]:
        self._check(components)
        return [self._reload(c) for c in reversed(OFFLOAD_ORDER) if c in components]

    def _offload(self, component: str) -> dict[str, Any]:
        entry = self.table[component]
        before = self._measure(component)
        if entry.offloaded:
            return self._row(component, "offload", before, entry.theory, noop=True)
        theory = inventory.theory(self.worker, component, self.device)
        if component == "optimizer" and self.variant == "mcore-optimizer-offload":
            self.worker.optimizer.offload_to_cpu()  # megatron-core 0.16.1 optimizer.py:344
            slots = []
        elif component == "params" and self.variant == "rebind-not-storage":
            slots = self._rebind(to=torch.device("cpu"))
        else:
            slots = self._slots(component)
            for slot in slots:
                slot.nbytes = nbytes(slot.view)
                if slot.copy:
                    self._shadow(component, slot).copy_(slot.view, non_blocking=True)
            synchronize(self.device)  # the host copies are valid only now; free after them
            for slot in slots:
                self._free(component, slot)
        synchronize(self.device)
        entry.offloaded, entry.slots, entry.theory = True, slots, theory
        entry.cycles += 1
        return self._row(component, "offload", before, theory)

    def _reload(self, component: str) -> dict[str, Any]:
        entry = self.table[component]
        before = self._measure(component)
        if component == "grads" and self.variant == "hasattr-guard":
            self._hasattr_reload()  # decides by an attribute, not by this table
        elif not entry.offloaded:
            return self._row(component, "reload", before, entry.theory or
                             inventory.theory(self.worker, component, self.device), noop=True)
        elif component == "optimizer" and self.variant == "mcore-optimizer-offload":
            self.worker.optimizer.restore_from_cpu()
        elif component == "params" and self.variant == "rebind-not-storage":
            self._rebind(to=self.device)
        else:
            for slot in entry.slots:
                if component == "grads" and self.variant == "grad-size-not-recorded" and nbytes(slot.view) == 0:
                    continue  # SkyRL PR 563 (intermediate): only non-empty storages were restored
                slot.view.untyped_storage().resize_(slot.nbytes)
                if slot.copy:
                    slot.view.copy_(self.shadows[component, slot.name], non_blocking=True)
                else:
                    slot.view.zero_()
        synchronize(self.device)
        theory = entry.theory
        entry.offloaded, entry.slots = False, []
        return self._row(component, "reload", before, theory)

    def _slots(self, component: str) -> list[Slot]:
        worker = self.worker
        if component in ("params", "grads") and hasattr(worker, "optimizer"):
            attr = "param_data" if component == "params" else "grad_data"
            buffers = inventory.ddp_buffers(worker.models)
            if self.variant == "expert-buffers-left":  # verl PR 1766: DDP's `buffers` only
                experts = {id(b) for m in worker.models for b in getattr(m, "expert_parallel_buffers", [])}
                buffers = [(name, buf) for name, buf in buffers if id(buf) not in experts]
            return [Slot(f"{name}.{attr}", whole(getattr(buf, attr)), component == "params", owner=buf)
                    for name, buf in buffers]
        found = inventory.storages(worker, component).on(self.device).by_id.values()
        if component == "optimizer" and self.variant == "master-params-left":
            # verl PR 6635: offload by a key list; the fp32 master params are not in it
            found = [(n, t) for n, t in found if n.endswith((".exp_avg", ".exp_avg_sq"))]
        return [Slot(name, whole(t), True) for name, t in found]

    def _free(self, component: str, slot: Slot) -> None:
        if component == "grads" and self.variant == "grad-size-not-recorded":
            slot.nbytes = 0  # the size is not recorded
        if component == "grads" and self.variant == "hasattr-guard":
            slot.owner.grad_data_size = slot.nbytes // slot.owner.grad_data.element_size()
        slot.view.untyped_storage().resize_(0)

    def _shadow(self, component: str, slot: Slot) -> torch.Tensor:
        """The slot's host shadow: allocated at its first offload (or when its size changed),
        then reused; `repin-each-offload` allocates one every time, while the old one lives."""
        key = (component, slot.name)
        old = self.shadows.get(key)
        if old is not None and old.numel() == slot.nbytes and self.variant != "repin-each-offload":
            return old
        new = host_buffer(slot.nbytes, pinned=self.device.type == "cuda")
        self.allocations[key] += 1
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes() + new.numel())
        self.shadows[key] = new
        return new

    def _rebind(self, to: torch.device) -> list[Slot]:
        """`rebind-not-storage` (SkyRL PR 223, verl PR 6447): `buf.param_data = buf.param_data.to(...)`."""
        slots = []
        for name, buf in inventory.ddp_buffers(self.worker.models):
            buf.param_data = buf.param_data.to(to)
            if to.type == "cpu":
                self.shadows["params", f"{name}.param_data"] = buf.param_data
                self.allocations["params", f"{name}.param_data"] += 1
                slots.append(Slot(f"{name}.param_data", buf.param_data, True, owner=buf))
        return slots

    def _hasattr_reload(self) -> None:
        """`hasattr-guard` (SkyRL 905): megatron-core 0.16 sets `grad_data_size = 0` in __init__,
        so the guard is always true and a reload with no offload before it frees live grads."""
        for _, buf in inventory.ddp_buffers(self.worker.models):
            if hasattr(buf, "grad_data_size"):
                size = buf.grad_data_size * buf.grad_data.element_size()
                buf.grad_data.untyped_storage().resize_(size)
                if size:
                    buf.grad_data.zero_()

    # ----------------------------------------------------------------- accounting
    def _measure(self, component: str) -> dict[str, int]:
        synchronize(self.device)
        measured = {"held": inventory.held(self.worker, component, self.device)}
        if self.device.type == "cuda":
            measured["allocated"] = torch.cuda.memory_allocated(self.device)
        return measured

    def _row(self, component: str, op: str, before: dict[str, int], theory: list[int],
             noop: bool = False) -> dict[str, Any]:
        after = self._measure(component)
        sign = 1 if op == "offload" else -1  # offload: bytes freed; reload: bytes restored
        walked = sign * (before["held"] - after["held"])
        measured = sign * (before["allocated"] - after["allocated"]) if "allocated" in after else walked
        shadows = self._shadows_of(component)
        return {"component": component, "op": op, "noop": noop, "theory_bytes": sum(theory),
                "theory_device_bytes": sum(rounded(n, self.device) for n in theory), "storages": len(theory),
                "measured_bytes": measured, "walked_bytes": walked, "held_bytes": after["held"],
                "host_shadow_bytes": sum(s.numel() for s in shadows.values()),
                "pinned": self.device.type == "cuda" and bool(shadows) and all(s.is_pinned() for s in shadows.values()),
                "state": "offloaded" if self.table[component].offloaded else "resident"}

    def _shadows_of(self, component: str) -> dict[tuple[str, str], torch.Tensor]:
        return {key: shadow for key, shadow in self.shadows.items() if key[0] == component}

    def host_bytes(self) -> int:
        return sum(s.numel() for s in self.shadows.values())

    def accounting(self) -> dict[str, Any]:
        """Per component: state, device bytes held now, bytes by theory, host shadow bytes, the
        shadows' storage ids and allocation counts; and the host totals."""
        out: dict[str, Any] = {}
        for component in self.components:
            entry = self.table[component]
            shadows = self._shadows_of(component)
            theory = entry.theory if entry.offloaded else inventory.theory(self.worker, component, self.device)
            out[component] = {
                "state": "offloaded" if entry.offloaded else "resident",
                "held_bytes": inventory.held(self.worker, component, self.device),
                "theory_bytes": sum(theory), "theory_device_bytes": sum(rounded(n, self.device) for n in theory),
                "host_shadow_bytes": sum(s.numel() for s in shadows.values()),
                "shadow_ids": sorted(storage_id(s) for s in shadows.values()),
                "shadow_allocations": sum(self.allocations[n] for n in shadows), "cycles": entry.cycles}
        out["host_bytes"] = self.host_bytes()
        out["peak_host_bytes"] = self.peak_host_bytes
        if self.device.type == "cuda":
            out["allocated_bytes"] = torch.cuda.memory_allocated(self.device)
        return out

    def discard(self) -> None:
        """Free every device storage of every component, without a copy, for a worker being
        dropped (a reference cycle in megatron-core's DDP keeps the objects alive). The worker
        is unusable after this."""
        for component in self.components:
            for _, tensor in inventory.storages(self.worker, component).on(self.device).by_id.values():
                tensor.untyped_storage().resize_(0)
            self.table[component].offloaded = True
        self.shadows.clear()

    def clear_caches(self) -> None:
        """Drop the device caches no component owns (before measuring the residual of a full
        offload): RoPE's per-length cache, Megatron's global memory buffer, cuBLAS workspaces
        (torch's, and Transformer Engine's: harness.compat.transformer_engine)."""
        from megatron.core import parallel_state

        from harness.compat.transformer_engine import release_workspaces

        try:
            from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

            RotaryEmbedding.forward.cache_clear()
        except AttributeError:  # no lru_cache on this version
            pass
        buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
        if buffer is not None:
            buffer.buffer.clear()
        release_workspaces()
        gc.collect()
        if self.device.type == "cuda":
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()
