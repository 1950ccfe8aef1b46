"""The offload round trip: one check of the manager's promises, on every rank, as report rows.

After one training step (so the Adam state exists) a policy goes through: a reload with nothing
offloaded (a no-op), each component offloaded and reloaded alone, then everything twice, with a
second offload of what is offloaded in between (a no-op). Measured against theory
(harness.offload.inventory) on every rank: bytes freed and restored, bytes left on the device,
the device after the round trip against before, aliasing, contents bit for bit, host shadows
allocated once. suites/offload runs it per layout and dtype; `mrh repro` runs it on each offload
variant of the catalog beside the fixed path.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from harness.offload import inventory
from harness.offload.storages import readable, storage_id, whole
from harness.offload.tolerances import offload_tolerance
from harness.report import Row
from harness.tolerance import CheckResult, Judged

MODEL = "tiny-qwen3-kv4"
CONFIG = dict(lr=1e-3, weight_decay=0.01, clip_grad=1.0, eps=1e-6, micro_batches=2, deterministic=True,
              loss_kwargs=dict(kl_coef=0.05, clip_eps_high=0.28))
COMPONENTS = inventory.POLICY


def config_for(layout) -> dict:
    """CONFIG with as many micro-batches as `layout`'s schedule takes: 2, or a multiple of pp under
    the interleaved (VPP) schedule (pp4vpp2 on 4 GPUs refused 2, 2026-11-27)."""
    from harness.parallel.state import as_layout

    return dict(CONFIG, micro_batches=as_layout(layout).fitted_micro_batches(CONFIG["micro_batches"]))


REFERENCE_PROMPTS, REFERENCE_RESPONSES = (3, 6), (9, 5)  # token lengths of the reference batch's rows, cycled


def reference_batch(layout):
    """The reference round trip's batch (suites/offload/test_reference.py) at `layout` (resolved):
    2 rows, or as many as its data-parallel ranks split into the fewest micro-batches its schedule
    runs (what `ReferenceHandle.logprobs` feeds): 4 at dp4 and pp2vpp2dp2, which refused 2 (2026-11-27)."""
    from harness.models import TINY_VOCAB_SIZE
    from harness.parallel.state import as_layout
    from harness.training import make_rl_train_batch

    layout = as_layout(layout)
    rows = layout.fitted_rows(len(REFERENCE_PROMPTS), layout.micro_batch_multiple)
    cycled = lambda lengths: [lengths[i % len(lengths)] for i in range(rows)]  # noqa: E731
    return make_rl_train_batch(TINY_VOCAB_SIZE, batch_size=rows, seed=3, prompt_lengths=cycled(REFERENCE_PROMPTS),
                               response_lengths=cycled(REFERENCE_RESPONSES)).batch


# ------------------------------------------------------------------------------ rank side
def digests(worker) -> dict[str, str]:
    """sha256 of every storage of every component, by slot name: "freed" when it holds no bytes,
    "zeros"/"nonzero" for grads (a reload brings them back as zeros)."""
    out = {}
    for component in worker.offloader.components:
        for name, tensor in inventory.storages(worker, component).by_id.values():
            key = f"{component}:{name}"
            if not readable(tensor) or tensor.untyped_storage().nbytes() == 0:
                out[key] = "freed"
            elif component == "grads":
                out[key] = "nonzero" if bool(whole(tensor).any()) else "zeros"
            else:
                # a copy: .numpy() makes the storage it views non-resizable for good
                out[key] = hashlib.sha256(whole(tensor).cpu().clone().numpy().tobytes()).hexdigest()
    return out


def aliasing(worker) -> list[str]:
    """What is broken of the aliasing a round trip must keep (empty when intact)."""
    broken = []
    param_ids, shadow_ids = set(), {storage_id(s) for s in worker.offloader.shadows.values()}
    for name, buf in inventory.ddp_buffers(worker.models):
        pid, gid = storage_id(buf.param_data), storage_id(buf.grad_data)
        param_ids.add(pid)
        if buf.param_data.device != worker.offloader.device:
            broken.append(f"{name}.param_data is on {buf.param_data.device}")
        broken += [f"{name}: a parameter is not a view of param_data" for p in buf.params if storage_id(p) != pid][:1]
        broken += [f"{name}: a main_grad is not a view of grad_data" for p in buf.params
                   if storage_id(p.main_grad) != gid][:1]
        if pid in shadow_ids or gid in shadow_ids:
            broken.append(f"{name}: a host shadow is the device storage itself")
    fp32 = worker.config.dtype == "fp32"
    for opt in inventory.optimizers(worker.optimizer):
        for group in getattr(getattr(opt, "optimizer", None), "param_groups", []):
            for param in group["params"]:
                if param.device != worker.offloader.device:
                    broken.append(f"a main param is on {param.device}")
                elif fp32 and storage_id(param) not in param_ids:
                    broken.append("an fp32 main shard is no longer a view of param_data")
    return broken


# ------------------------------------------------------------------------------ parent side
@dataclass
class RoundTrip(Judged):
    layout: str
    dtype: str
    device: str
    variant: str | None
    checks: list[CheckResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    byte_rows: list[Row] = field(default_factory=list)  # per rank, component and operation
    model: str = MODEL

    def check(self, metric: str, value: float, detail: str = "") -> None:
        self.judge(metric, value, offload_tolerance(metric, self.dtype),
                   f"{metric}={value:g}" + (f" ({detail})" if detail else ""))

    def rows(self, **fields: Any) -> list[Row]:
        for row in self.byte_rows:
            row.extra.update(fields)
        return self.check_rows(self.layout, self.model, **fields, variant=self.variant) + self.byte_rows

    def summary(self) -> str:
        what = f"{self.layout} {self.dtype}" + (f" variant={self.variant}" if self.variant else "")
        return f"{what}: " + ("; ".join(self.failures) if self.failures else "every byte accounted for")


def byte_rows(result: RoundTrip, ranks: list[list[dict]], phase: str) -> list[dict]:
    """Flatten each rank's offload/reload rows, and record one report row per (rank, component, op):
    theory bytes, measured delta, host shadow bytes, pinned."""
    flat = []
    for rank, rows in enumerate(ranks):
        for r in rows:
            flat.append(dict(r, rank=rank))
            metric = "freed_minus_theory_bytes" if r["op"] == "offload" else "restored_minus_theory_bytes"
            value = 0 if r["noop"] else abs(r["measured_bytes"] - r["theory_device_bytes"])
            if r["noop"]:
                metric, value = "noop_changed_bytes", abs(r["measured_bytes"])
            bound = offload_tolerance(metric, result.dtype)
            result.byte_rows.append(Row(
                suite="", test="", layout=result.layout, metric=metric, value=value, tolerance=bound.limit,
                passed=bound.passes(value), claim=bound.claim, model=result.model, dtype=result.dtype, device=result.device, units="bytes",
                extra={"variant": result.variant, "rank": rank, "phase": phase, "component": r["component"],
                       "op": r["op"], "theory_bytes": r["theory_bytes"],
                       "theory_device_bytes": r["theory_device_bytes"], "measured_bytes": r["measured_bytes"],
                       "held_bytes": r["held_bytes"], "host_shadow_bytes": r["host_shadow_bytes"],
                       "pinned": r["pinned"], "storages": r["storages"], "per_rank": True}))
    return flat


def residual(worker) -> dict[str, Any]:
    """After a full offload and `clear_caches`: the device bytes still allocated, and the live
    device tensors that explain them (a gc census of distinct storages, largest first)."""
    import gc

    from harness.offload.storages import rounded

    worker.offloader.clear_caches()
    device = worker.offloader.device
    seen: dict[int, torch.Tensor] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device == device and obj.untyped_storage().nbytes():
                seen.setdefault(storage_id(obj), obj)
        except Exception:  # objects that fail isinstance/attribute access mid-teardown
            continue
    # Plain ints and strings: what a rank sends back must pickle, whatever tensor the census met
    items = sorted(((int(rounded(t.untyped_storage().nbytes(), device)), str(t.dtype), [int(d) for d in t.shape])
                    for t in seen.values()), reverse=True)
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else sum(i[0] for i in items)
    from harness.compat.transformer_engine import workspaces_held

    return {"allocated_bytes": allocated, "census_bytes": sum(i[0] for i in items), "tensors": len(items),
            "largest": items[:8], "held": {c: int(inventory.held(worker, c, device)) for c in worker.offloader.components},
            "te_workspaces": int(workspaces_held())}


def live_workers(*_) -> dict[str, int]:
    """Rank function: workers still alive in this rank process (no gc run first), the bytes the
    DDP buffers alive in it hold, and the device bytes allocated."""
    import gc

    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    from harness.training.policy import PolicyWorker
    from harness.training.reference import ReferenceWorker

    objects = gc.get_objects()
    buffers = [o for o in objects if isinstance(o, _ParamAndGradBuffer)]
    held = sum(t.untyped_storage().nbytes() for b in buffers for t in (b.param_data, b.grad_data) if t is not None)
    return {"workers": sum(isinstance(o, (PolicyWorker, ReferenceWorker)) for o in objects),
            "ddp_buffer_bytes": held,
            "allocated_bytes": torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0}


def _device_total(accounting: dict[str, Any]) -> int:
    return accounting.get("allocated_bytes", sum(accounting[c]["held_bytes"] for c in COMPONENTS))


def round_trip(make_policy: Callable, layout: str, dtype: str = "fp32", *, variant: str | None = None,
               device: str = "cpu", cycles: int = 2, policy=None, model: str = MODEL) -> RoundTrip:
    """The round trip on a fresh policy (`make_policy(layout, model, **config)`), or on `policy`
    (stepped at least once, everything resident)."""
    from harness.checkpoint.resume_check import train_batch

    result = RoundTrip(layout, dtype, device, variant, model=model)
    own = policy is None
    if own:
        policy = make_policy(layout, model, **config_for(layout), dtype=dtype, offload_variant=variant)
        policy.step(train_batch(0))
    try:
        _run(policy, result, cycles)
    finally:
        if own:
            policy.close()
    return result


def _run(policy, result: RoundTrip, cycles: int) -> None:
    from harness.offload.check import aliasing, digests  # the rank functions, by reference

    before, accounts0 = policy.apply(digests), policy.offload_accounting()
    rows = byte_rows(result, policy.reload(), "reload-when-resident")
    for component in COMPONENTS:
        alone = {c: c == component for c in COMPONENTS}
        rows += byte_rows(result, policy.offload(**alone), f"{component}-alone")
        rows += byte_rows(result, policy.reload(**alone), f"{component}-alone")
    for cycle in range(cycles):
        rows += byte_rows(result, policy.offload(), f"all-cycle{cycle}")
        rows += byte_rows(result, policy.offload(), f"offload-when-offloaded{cycle}")
        rows += byte_rows(result, policy.reload(), f"all-cycle{cycle}")
    after, accounts1, broken = policy.apply(digests), policy.offload_accounting(), policy.apply(aliasing)

    done = [r for r in rows if not r["noop"]]
    offloads = [r for r in done if r["op"] == "offload"]
    reloads = [r for r in done if r["op"] == "reload"]
    worst = lambda rs, f: max((f(r) for r in rs), default=0)  # noqa: E731
    result.check("freed_minus_theory_bytes", worst(offloads, lambda r: abs(r["measured_bytes"] - r["theory_device_bytes"])))
    result.check("held_after_offload_bytes", worst(offloads, lambda r: r["held_bytes"]))
    result.check("restored_minus_theory_bytes", worst(reloads, lambda r: abs(r["measured_bytes"] - r["theory_device_bytes"])))
    result.check("noop_changed_bytes", worst([r for r in rows if r["noop"]],
                                             lambda r: max(abs(r["measured_bytes"]), abs(r["walked_bytes"]))))
    result.check("round_trip_residual_bytes",
                 max(abs(_device_total(a1) - _device_total(a0)) for a0, a1 in zip(accounts0, accounts1)))
    result.check("aliasing_broken", sum(len(b) for b in broken), "; ".join(sorted({x for b in broken for x in b}))[:300])
    mismatched = sorted({k for b, a in zip(before, after) for k in set(b) | set(a)
                         if a.get(k) != (("zeros" if k.startswith("grads:") else b.get(k)))})
    result.check("content_mismatches", len(mismatched), ", ".join(mismatched[:4]))
    result.check("shadow_reallocations", max(
        sum(a[c]["shadow_allocations"] - len(a[c]["shadow_ids"]) for c in COMPONENTS) for a in accounts1))
    result.check("peak_host_over_shadow_bytes", max(a["peak_host_bytes"] - a["host_bytes"] for a in accounts1))
