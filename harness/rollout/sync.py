"""Weight sync: the policy's weights, from any layout, into a rollout engine, bucket by bucket.

Every rank walks the bridge's export together (the bridge gathers TP shards and broadcasts PP stages
tensor by tensor); rank 0 keeps each tensor only until its bucket is full and sent. So no rank ever
holds a full-model copy: the driver receives one bucket of at most `bucket_bytes` (or one tensor,
when a single tensor is larger) per call and hands it to `engine.update_weights`. The MLP's gate
and up projections travel fused (`gate_up_proj`, gate rows first, as vLLM packs them).

    report = sync_weights(policy, engine, bucket_bytes=1 << 20)

How a bucket reaches the engine is the engine's `transport` (harness.rollout.transfer): `host` (rank
0 copies to the CPU, the driver pickles it on), `cuda-ipc` (rank 0 packs the bucket into one CUDA
buffer and the engine maps it by an IPC handle: colocated vLLM on GPU) or `broadcast` (rank 0 packs
it and broadcasts it over a two-member group with the engine's process: vLLM on GPUs of its own).

The catalog's `weight-sync` variants are upstream bugs of exactly this path (harness.variants);
`sync-split-fused-group` is the vLLM adapter's (it loads each bucket as it comes, harness.rollout.vllm_engine).
A MoE model's experts travel one tensor per expert (`mlp.experts.<e>.gate_up_proj.weight`, ...), so an
expert group (a layer's experts of one projection, `expert_group`) may straddle buckets: the
`sync-expert-group-split` variant is what a grouped export makes of that (SkyRL PR 1471).
`sync-partial-bucket` hands the engine the first tensor of each bucket only (a loader that stops part-way,
the same on every transport); `sync-tied-lm-head-stale` is the engine's (its lm_head untied,
harness.rollout.check).
"""
from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from harness.rollout.engine import FUSED_GATE_UP
from harness.rollout.transfer import TRANSPORTS, WireBucket, bucket_names, bucket_nbytes

DEFAULT_BUCKET_BYTES = 64 << 20
IMPLEMENTED = ("sync-skipped-bucket", "sync-swapped-tp-shards", "sync-unsynced-tied-embedding",
               "sync-swapped-gate-up", "sync-split-fused-group", "sync-expert-group-split", "sync-skipped",
               "sync-qkv-not-grouped", "sync-experts-misordered", "sync-partial-bucket",
               # the engine's and the check's (harness.rollout.check)
               "sync-stale-prefix-cache", "sync-sleep-level2-no-reload", "logprobs-before-temperature",
               "sync-tied-lm-head-stale")
# HF projections that Megatron splits by output rows over TP (column-parallel).
_COLUMN_PARALLEL = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(.+)$")
VLLM_ONLY = ("sync-split-fused-group", "sync-stale-prefix-cache", "sync-sleep-level2-no-reload")
_EXPERT_INDEX = re.compile(r"^(.*\.experts\.)(\d+)(\..+)$")
_QKV = ("q_proj", "k_proj", "v_proj")


def expert_group(name: str) -> str | None:
    """The group an expert's tensor belongs to: the layer's experts of one projection (what a grouped
    export fuses into one HF tensor, `...mlp.experts.gate_up_proj.weight`); None for other tensors."""
    match = _EXPERT.match(name)
    return f"{match.group(1)}.{match.group(2)}" if match else None


@dataclass
class SyncReport:
    buckets: int = 0
    tensors: int = 0  # as sent (a fused gate_up counts once)
    bytes: int = 0
    max_bucket_bytes: int = 0
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    seconds: float = 0.0
    names: list[str] = field(default_factory=list)
    bucket_tensors: list[int] = field(default_factory=list)  # tensors per bucket, in order (cuts `names`)
    transport: str = "host"
    export_seconds: float = 0.0  # in the ranks: the bridge's export, packing (and a broadcast's start)
    load_seconds: float = 0.0  # in the engine: taking the buckets (the copies into its weights)
    # export_seconds split (rank 0's clock; on CUDA host time: an async copy is paid where the pack synchronizes):
    walk_seconds: float = 0.0  # the bridge's export walk (TP gathers, PP broadcasts: every rank walks together)
    copy_seconds: float = 0.0  # each tensor kept: its copy out of the bridge's buffer, gate/up fused, variants
    pack_seconds: float = 0.0  # packing buckets into one buffer (cuda-ipc, broadcast): the copy, the handle, the start
    round_trip_seconds: float = 0.0  # the rest: one call to every rank per bucket, the bucket's way back to the driver
    load_path: str | None = None  # the engine's ("reload" | "in-place": harness.rollout.vllm_engine), None for HF

    @property
    def gbps(self) -> float:
        """Bytes moved per second of the whole update, in GB/s (1e9 bytes)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


def sync_weights(policy, engine, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, variant: str | None = None,
                 progress=None) -> SyncReport:
    """Stream the policy's exported HF weights into `engine`; `progress(report)` after each bucket."""
    from harness.models import load_hf_config
    from harness.variants.catalog import VariantError, require

    if not (isinstance(bucket_bytes, int) and bucket_bytes > 0):
        raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    require(variant, check="weight-sync", layout=policy.layout, config=load_hf_config(policy.path))
    if variant in VLLM_ONLY and not hasattr(engine, "hold_fused_groups"):
        raise VariantError(f"variant {variant!r} is the vLLM engine's (fused q/k/v on load, a prefix cache, "
                           f"sleep levels), not {type(engine).__name__}'s")
    transport = getattr(engine, "transport", "host")
    if transport not in TRANSPORTS:
        raise ValueError(f"engine transport must be one of {TRANSPORTS}, got {transport!r}")
    report = SyncReport(bucket_bytes=bucket_bytes, transport=transport, load_path=getattr(engine, "load_path", None))
    if transport == "broadcast":
        _ensure_group(policy, engine)  # once per (policy, engine): not part of an update's time
    start = time.perf_counter()
    policy.apply(_open, bucket_bytes, variant, transport)
    if variant == "sync-split-fused-group":
        engine.hold_fused_groups = False  # the upstream bug: each bucket loaded as it comes
    try:
        _stream(policy, engine, variant, report, progress)
        policy.apply(_release)
    finally:
        if variant == "sync-split-fused-group":
            engine.hold_fused_groups = True
    report.seconds = time.perf_counter() - start
    return report


def _stream(policy, engine, variant: str | None, report: SyncReport, progress) -> None:
    done = False
    while not done:
        tick = time.perf_counter()
        bucket, done, spent = policy.apply(_next)[0]
        elapsed = time.perf_counter() - tick
        report.export_seconds += elapsed
        report.walk_seconds += spent["walk"]
        report.copy_seconds += spent["copy"]
        report.pack_seconds += spent["pack"]
        report.round_trip_seconds += max(elapsed - sum(spent.values()), 0.0)
        size = bucket_nbytes(bucket)
        names = bucket_names(bucket)
        loaded = bucket
        if variant == "sync-partial-bucket" and len(names) > 1:
            loaded = _prefix(bucket, 1)  # the engine's loader stops after each bucket's first tensor
        # The upstream bugs: an index slip drops one bucket, or the whole update is never sent; the
        # engine keeps its old tensors.
        if not (variant == "sync-skipped-bucket" and report.buckets == 1) and variant != "sync-skipped":
            tick = time.perf_counter()
            engine.update_weights(loaded)
            report.load_seconds += time.perf_counter() - tick
        report.buckets += 1
        report.tensors += len(names)
        report.bucket_tensors.append(len(names))
        report.bytes += size
        report.max_bucket_bytes = max(report.max_bucket_bytes, size)
        report.names += names
        if progress is not None:
            progress(report)


def _prefix(bucket, count: int):
    """The sync-partial-bucket variant: what a loader that stops after `count` tensors takes of a bucket,
    on any transport. A packed bucket (cuda-ipc, broadcast) keeps its whole buffer, which travels as
    before (a broadcast's sizes must match), and loses the tail of its layout."""
    if isinstance(bucket, WireBucket):
        return dataclasses.replace(bucket, specs=bucket.specs[:count])
    return list(bucket)[:count]


def _ensure_group(policy, engine) -> None:
    """The broadcast transport's group of rank 0 and the engine's process: made once and kept by both
    (a new policy or a restarted engine makes a new one). Rank 0 binds the group's TCPStore to a port
    the OS picks and names it: a port probed free and bound later was taken in between on a busy host
    (EADDRINUSE at tp2, stack B, 4x H100, reports/gpu/2026-11-27-h100x4-sync-walk)."""
    key = engine.group_key
    if key is not None and policy.apply(_group_key)[0] == key:
        return
    port = policy.apply(_serve_group_store, "127.0.0.1")[0]
    engine.join_group("127.0.0.1", port)  # the engine connects in the background ...
    policy.apply(_join_group, "127.0.0.1", port)  # ... while rank 0 joins on the store it serves
    engine.group_joined()


def _group_key(worker) -> str | None:
    group = getattr(worker, "sync_group", None)
    return group[0] if group else None


def _serve_group_store(worker, host: str) -> int | None:
    """Rank 0: the group's TCPStore, listening on a port of the OS's choice (returned); None elsewhere."""
    import torch.distributed as dist

    from harness.rollout.transfer import serve_store

    if dist.get_rank() != 0:
        return None
    worker.sync_store = serve_store(host)
    return worker.sync_store.port


def _join_group(worker, host: str, port: int) -> None:
    import torch.distributed as dist

    from harness.rollout.transfer import open_group

    if dist.get_rank() != 0:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    store, worker.sync_store = worker.sync_store, None
    worker.sync_group = (f"{host}:{port}", open_group(host, port, 0, device, store=store))


# ------------------------------------------------------------------------------ rank side
def _open(worker, bucket_bytes: int, variant: str | None, transport: str = "host") -> None:
    worker.offloader.require("params", what="a weight sync")
    if transport == "cuda-ipc" and not torch.cuda.is_available():
        raise ValueError("transport 'cuda-ipc' needs CUDA ranks (the engine maps rank 0's GPU buffer)")
    worker.sync_stream = _Stream(worker.models, bucket_bytes, variant, on_device=transport != "host")
    worker.sync_transport = transport
    worker.sync_shared = None  # the buffer of the bucket last shared: kept until the next is asked for


def _next(worker) -> tuple[list[tuple[str, torch.Tensor]] | None, bool, dict[str, float]]:
    """The next bucket (rank 0's; None elsewhere), whether it is the last, and where this rank's time
    went: {"walk", "copy", "pack"} seconds (SyncReport)."""
    import torch.distributed as dist

    stream = getattr(worker, "sync_stream", None)
    if stream is None:
        raise RuntimeError("no weight sync is open on this worker")
    tick = time.perf_counter()
    _release(worker)  # the engine answered for the last bucket before this call: free its buffer
    released = time.perf_counter() - tick
    bucket, done = stream.next_bucket()
    spent = {"walk": stream.spent["walk"], "copy": stream.spent["copy"], "pack": released}
    if done:
        worker.sync_stream = None
    if dist.get_rank() != 0:
        return None, done, spent
    transport = getattr(worker, "sync_transport", "host")
    tick = time.perf_counter()
    if transport == "cuda-ipc" and bucket:
        from harness.rollout.transfer import share

        worker.sync_shared, bucket = share(*stream.packed(bucket))
    elif transport == "broadcast" and bucket:
        from harness.rollout.transfer import broadcast

        buffer, bucket = stream.packed(bucket)
        worker.sync_shared = (buffer, broadcast(worker.sync_group[1], buffer))  # the engine receives it next
    spent["pack"] += time.perf_counter() - tick
    return bucket, done, spent


def _release(worker) -> None:
    """Free the last bucket's buffer (a broadcast's once it completed)."""
    shared = getattr(worker, "sync_shared", None)
    if isinstance(shared, tuple):
        shared[1].wait()
    worker.sync_shared = None


class _Stream:
    """The export as buckets. Every rank runs the same walk (the collectives pair up) and makes
    the same bucket cuts from the tensors' sizes; only rank 0 keeps copies.

    One copy per tensor on rank 0. The bridge's tensors are valid until its next item, and the walk
    advances only once `ready` is empty, so a tensor is copied when it joins a bucket: `host` copies it
    to the CPU in `_transform`; `cuda-ipc` and `broadcast` copy it straight into the bucket's packed
    buffer (harness.rollout.transfer.Packer), which is what travels. What a variant holds past its
    item (one of gate/up, q/k/v awaiting the rest, a tied embedding to compare) gets a copy of its own."""

    def __init__(self, models, bucket_bytes: int, variant: str | None, on_device: bool = False) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from harness.bridge import iter_hf_weights, unwrap_model

        self.items: Iterator = iter_hf_weights(models)
        self.limit = bucket_bytes
        self.variant = variant
        self.keep = dist.get_rank() == 0
        self.on_device = on_device  # cuda-ipc, broadcast: rank 0 packs each tensor on its device as it comes
        self.packer = None  # the current bucket's packed buffer (on_device, rank 0)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.tied = bool(getattr(unwrap_model(models)[0], "share_embeddings_and_output_weights", False))
        self.sent: dict[str, torch.Tensor | None] = {}  # name -> the copy, kept for embeddings only
        self.halves: dict[str, dict[str, torch.Tensor]] = {}  # MLP prefix -> gate/up awaiting its pair
        self.ready: list[tuple[str, torch.Tensor]] = []  # transformed, not yet in a bucket
        self.spent = {"walk": 0.0, "copy": 0.0}  # the last next_bucket's seconds (SyncReport's split)
        if variant in ("sync-expert-group-split", "sync-experts-misordered", "sync-qkv-not-grouped"):
            from harness.bridge import hf_config
            from harness.bridge.preflight import num_experts

            config = hf_config(models)
            self.experts = num_experts(config)
            heads = config.num_attention_heads
            self.qkv_shape = (heads, config.num_key_value_heads or heads,
                              getattr(config, "head_dim", None) or config.hidden_size // heads)
            self.qkv: dict[str, dict[str, torch.Tensor]] = {}  # attention prefix -> q/k/v awaiting the rest

    def next_bucket(self) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        """The next bucket and whether it is the last; `spent` then holds this call's seconds in the
        bridge's walk ("walk") and in keeping its tensors ("copy": _transform and _pack)."""
        bucket, size = [], 0
        self.spent = {"walk": 0.0, "copy": 0.0}
        self.packer = None
        while True:
            while not self.ready:
                tick = time.perf_counter()
                item = next(self.items, None)
                walked = time.perf_counter()
                self.spent["walk"] += walked - tick
                if item is None:
                    if self.halves:
                        raise RuntimeError(f"gate/up projections without their pair: {sorted(self.halves)}")
                    return self._grouped_export(bucket), True
                self.ready = self._transform(*item)
                self.spent["copy"] += time.perf_counter() - walked
            name, tensor = self.ready[0]
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > self.limit:
                return self._grouped_export(bucket), False
            self.ready.pop(0)
            bucket.append((name, self._pack(name, tensor)))
            size += nbytes

    def _pack(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor joining the bucket: on a device transport (rank 0) copied into its packed buffer."""
        if not (self.keep and self.on_device):
            return tensor
        from harness.rollout.transfer import Packer

        tick = time.perf_counter()
        if self.packer is None:
            self.packer = Packer(self.limit + (16 << 10))  # room for the 256-byte alignment of ~64 tensors
        packed = self.packer.add(name, tensor)
        self.spent["copy"] += time.perf_counter() - tick
        return packed

    def packed(self, bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, WireBucket]:
        """The last bucket's packed buffer and the layout of `bucket`'s tensors in it (rank 0, a device
        transport): no copy."""
        return self.packer.layout(name for name, _ in bucket)

    def _own(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor held past the bridge's next item: a copy, unless `_transform` already made one."""
        return tensor.clone(memory_format=torch.contiguous_format) if self.keep and self.on_device else tensor

    def _grouped_export(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The sync-expert-group-split variant (SkyRL PR 1471's bug): buckets planned over the bridge's
        export tasks, each bucket exported by a call of its own, whose grouped export yields a fused
        expert group only once every expert of the group was in that call. A group cut by a bucket
        boundary is complete in neither call: none of its experts is ever sent."""
        if self.variant != "sync-expert-group-split":
            return bucket
        members = Counter(expert_group(name) for name, _ in bucket)
        return [(name, t) for name, t in bucket
                if expert_group(name) is None or members[expert_group(name)] == self.experts]

    @torch.no_grad()
    def _transform(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        # The bridge yields views into its gather buffers: host copies each to the CPU here (one copy,
        # also from a GPU); cuda-ipc and broadcast copy it into the bucket's buffer (_pack). Ranks other
        # than 0 keep a meta tensor of the same size (only sizes decide the cuts).
        if self.keep:
            tensor = tensor.detach()
            if not self.on_device:
                tensor = tensor.to("cpu", copy=True, memory_format=torch.contiguous_format)
        else:
            tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        if name in self.sent:  # a tied embedding's second copy (last PP stage): equal, or a bug
            first = self.sent[name]
            if self.keep and first is not None and not torch.equal(first, tensor):
                raise RuntimeError(f"{name}: the copies on different pipeline stages differ")
            return []
        # kept to compare with a second copy: one comes only for a tied model under PP (iter_hf_weights)
        compare = name in _EMBEDDINGS and (not self.on_device or (self.tied and self.pp > 1))
        self.sent[name] = self._own(tensor) if compare else None
        if self.variant == "sync-unsynced-tied-embedding" and self.tied and self.pp > 1 and name in _EMBEDDINGS:
            return []  # the upstream bug: the tied weight is left to "the other stage"
        if self.variant == "sync-swapped-tp-shards" and self.tp > 1 and name.endswith(_COLUMN_PARALLEL):
            tensor = torch.cat(list(reversed(tensor.chunk(self.tp, dim=0))), dim=0)
        if self.variant == "sync-qkv-not-grouped" and name.endswith(tuple(f".{p}.weight" for p in _QKV)):
            return self._ungrouped_qkv(name, tensor)
        for half in ("gate_proj", "up_proj"):
            if name.endswith(f".{half}.weight"):
                return self._misordered(self._fuse(name[: -len(f"{half}.weight")], half, tensor))
        return self._misordered([(name, tensor)])

    def _misordered(self, pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The sync-experts-misordered variant (SkyRL issue 1680's symptom): expert e sent as e+1 mod E."""
        if self.variant != "sync-experts-misordered":
            return pairs
        out = []
        for name, tensor in pairs:
            match = _EXPERT_INDEX.match(name)
            if match:
                name = f"{match.group(1)}{(int(match.group(2)) + 1) % self.experts}{match.group(3)}"
            out.append((name, tensor))
        return out

    def _ungrouped_qkv(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The sync-qkv-not-grouped variant (Megatron-Bridge issue 1818): a layer's q/k/v put back into
        Megatron's fused layout (per KV group: its q heads, its k, its v) and split as if that were
        [all q | all k | all v]."""
        which = next(p for p in _QKV if name.endswith(f".{p}.weight"))
        prefix = name[: -len(f"{which}.weight")]
        parts = self.qkv.setdefault(prefix, {})
        parts[which] = tensor
        if len(parts) < 3:
            parts[which] = self._own(tensor)  # held for the rest
            return []
        del self.qkv[prefix]
        heads, groups, dim = self.qkv_shape
        q = parts["q_proj"].reshape(groups, heads // groups * dim, -1)
        k, v = (parts[p].reshape(groups, dim, -1) for p in ("k_proj", "v_proj"))
        fused = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        sizes = [heads * dim, groups * dim, groups * dim]
        return [(f"{prefix}{p}.weight", t.clone()) for p, t in zip(_QKV, fused.split(sizes, dim=0))]

    def _fuse(self, prefix: str, half: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        pair = self.halves.setdefault(prefix, {})
        pair[half] = tensor
        if len(pair) < 2:
            pair[half] = self._own(tensor)  # held for its pair
            return []
        del self.halves[prefix]
        order = ("up_proj", "gate_proj") if self.variant == "sync-swapped-gate-up" else ("gate_proj", "up_proj")
        return [(f"{prefix}{FUSED_GATE_UP}.weight", torch.cat([pair[order[0]], pair[order[1]]], dim=0))]


def engine_weight_diffs(engine_weights: dict[str, torch.Tensor], exported: dict[str, torch.Tensor]
                        ) -> dict[str, Any]:
    """How the engine's weights differ from the policy's exported ones: names missing on either
    side, names not bit-equal (dtype and values), the largest |difference|."""
    missing = sorted(set(exported) - set(engine_weights))
    extra = sorted(set(engine_weights) - set(exported))
    unequal, worst = [], 0.0
    for name in sorted(set(exported) & set(engine_weights)):
        a, b = engine_weights[name], exported[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            unequal.append(name)
            if a.shape == b.shape:
                worst = max(worst, float((a.double() - b.double()).abs().max()))
            else:
                worst = float("inf")
    return {"missing": missing, "extra": extra, "unequal": unequal, "max_abs_diff": worst}
