"""`mrh bench sync`: how fast one full weight update reaches the rollout engine, next to a plain copy
of the same bytes in the same run (issue 35 item 8: colocated by CUDA IPC and separate over NCCL,
the goal >= 50% of a device-to-device copy).

One policy in one world (default qwen3-0.6b-shape, tp1, bf16) and, per transport, a fresh engine
(default on CUDA: vLLM; on CPU: the HF engine). Transports are harness.rollout.transfer's:
  * cuda-ipc  - colocated: the engine on rank 0's GPU maps rank 0's packed CUDA buffer (vLLM, CUDA);
  * host      - colocated: rank 0 copies to the CPU, the driver pickles each bucket to the engine;
  * broadcast - separate: the engine on a GPU of its own (the machine's last, beside the layout's),
                rank 0 broadcasts each packed bucket over a two-member group (NCCL; gloo on CPU).
Default: cuda-ipc, host, and broadcast where a GPU is left for the engine (vLLM on CUDA); host
otherwise. For each transport: one warm-up update (not counted: first-use costs, the engine's first
load, the broadcast group's setup), then `--repeats` timed full updates
(`harness.rollout.sync.sync_weights`: the export walk on every rank, the buckets, the engine's load):
  * seconds  - the median update's wall time in the driver (what a trainer waits for);
  * gbps     - bytes / seconds, GB/s of 1e9 bytes (`SyncReport.gbps`); bytes are the exported HF
               tensors' (a tied embedding once), buckets how many `update_weights` calls;
  * of_copy  - gbps / the copy's gbps (the issue's goal: >= 0.5; printed, never asserted: a ratio
               from one run); a broadcast on CUDA also gets of_peer_copy.
Where an update's time goes (`SyncReport`; medians over the timed updates, and per update in `updates`):
  * export_s            - the driver's calls to the ranks for the buckets, one call per bucket:
    * export_walk_s     - rank 0 in the bridge's export walk (iter_hf_weights: per tensor its TP gather
                          and PP broadcast; every rank walks). `bridge` names whose walk: mbridge's with
                          the stages' names exchanged once per export (harness.bridge.mbridge_compat,
                          override 18; stock exchanged them per tensor, even at pp 1), or Megatron-Bridge's;
    * export_copy_s     - rank 0 keeping each tensor: its one copy (host: to the CPU; cuda-ipc/broadcast:
                          into the bucket's packed buffer), gate/up fused, what a variant holds;
    * export_pack_s     - rank 0 finishing each bucket: cuda-ipc its stream synchronized (the async copies
                          complete here) and the IPC handle; broadcast its start (and waiting for the last);
    * export_round_trip_s - the rest of export_s: the call to every rank and the bucket's way back to the
                          driver (host: the tensors themselves, pickled through the world's pipes; cuda-ipc,
                          broadcast: the bucket's layout and handle, a few hundred bytes);
  * load_s              - the engine taking the buckets (`update_weights`: to its process, its load into
                          its weights, a synchronize, the prefix cache reset);
  * load_path           - how the vLLM engine loads (`VLLMEngine(load_path=...)`: "reload" is vLLM's
                          layerwise reload_weights, "in-place" the model's own load_weights into the live
                          parameters; default in-place on CUDA where valid), `load_path_reason` why; None
                          for the HF engine.
Host-side clocks: on CUDA a kernel is paid where something waits for it (the pack's synchronize, the
engine's). The goal cannot be met by construction: an update is at least two copies of the bytes (rank 0
into the packed buffer, the engine from it into its weights), so it takes at least twice the copy's time,
at most 50% of its GB/s, before any walk, call or load overhead.
The copy baseline (`copy`): on CUDA a device-to-device `dst.copy_(src)` of one uint8 buffer of the
same number of bytes on rank 0's GPU, synchronized, one warm-up then the median of max(repeats, 3);
on CPU the same copy of host tensors (a memcpy). With a broadcast on CUDA, `copy_peer` is the same
copy from rank 0's GPU into the engine's. GB/s count the bytes once, as the sync's do.

One JSON line on stdout (and `--out FILE`, never overwritten), a table and progress on stderr. A
transport that fails is recorded with its error and the others still run (exit 1). Exit 0 measured,
2 bad input (before any rank or engine starts).
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from harness.bench.ckpt import BadInput, _gpu_count, _versions, check_target

DEFAULT_MODEL = "qwen3-0.6b-shape"
DEFAULT_LAYOUT = "tp1"
GOAL = 0.5  # of the copy (issue 35 item 8): printed, not asserted
PLACEMENTS = {"cuda-ipc": "colocated", "host": "colocated", "broadcast": "separate"}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
MAX_MODEL_LEN = 256  # the vLLM engine's: it never generates here
ENGINE_HEADROOM = 2 << 30  # bytes left free beside a colocated vLLM engine's budget on the GPU


def _sig(value: float, digits: int = 6) -> float:
    """`value` to `digits` significant digits (a copy of 1 GB takes under a millisecond on a GPU; a
    sync of a tiny model on CPU runs at a few MB/s: fixed decimals would lose either)."""
    return float(f"{value:.{digits}g}")


def default_engine(device: str) -> str:
    return "vllm" if device == "cuda" else "hf"


def engine_gpu(world_size: int) -> int | None:
    """The separate engine's GPU: the machine's last, when the layout leaves one (ranks take 0..n-1)."""
    gpus = _gpu_count()
    return gpus - 1 if gpus > world_size else None


def default_transports(device: str, engine: str, world_size: int) -> list[str]:
    if device == "cuda" and engine == "vllm":
        return ["cuda-ipc", "host"] + (["broadcast"] if engine_gpu(world_size) is not None else [])
    return ["host"]


def _unmeasured(device: str, engine: str, world_size: int, transports: list[str]) -> dict[str, str]:
    """Why the separate placement is not in this run, when it is not."""
    if "broadcast" in transports:
        return {}
    if engine != "vllm":
        why = f"the {engine} engine takes buckets through the host only (the broadcast transport is vLLM's)"
    elif device == "cuda" and engine_gpu(world_size) is None:
        why = (f"the separate engine needs a GPU of its own beside the layout's {world_size}: "
               f"{_gpu_count()} visible")
    else:
        why = "not in --transports"
    return {"broadcast": f"separate placement not measured: {why}"}


def check_input(model: str = DEFAULT_MODEL, layout: str | None = DEFAULT_LAYOUT, device: str | None = None,
                dtype: str = "bf16", engine: str | None = None, transports: str | list[str] | None = None,
                bucket_mb: float | None = None, repeats: int = 3, out: str | None = None,
                load_path: str | None = None) -> dict[str, Any]:
    """Everything that can be wrong with a `mrh bench sync` request, before any rank or engine starts:
    raises BadInput. Returns the request with its defaults filled in."""
    from harness.rollout.engines import ENGINES
    from harness.rollout.sync import DEFAULT_BUCKET_BYTES
    from harness.rollout.transfer import TRANSPORTS

    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise BadInput(f"--repeats must be an integer >= 1, got {repeats!r}")
    bucket_mb = DEFAULT_BUCKET_BYTES / 2**20 if bucket_mb is None else bucket_mb
    bucket_bytes = int(bucket_mb * 2**20) if isinstance(bucket_mb, (int, float)) and bucket_mb > 0 else 0
    if bucket_bytes < 1:
        raise BadInput(f"--bucket-mb must be a number > 0, got {bucket_mb!r}")
    if device not in (None, "cpu", "cuda"):
        raise BadInput(f"unknown device {device!r}; choose cpu or cuda")
    if device == "cuda" and _gpu_count() == 0:
        raise BadInput("--device cuda: no GPU is visible")
    if engine is not None and engine not in ENGINES:
        raise BadInput(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
    if transports is not None:
        names = transports.split(",") if isinstance(transports, str) else list(transports)
        names = [n.strip() for n in names if n.strip()]
        if not names:
            raise BadInput("--transports names no transport; choose from " + ", ".join(TRANSPORTS))
        for name in names:
            if name in ("nccl", "gloo", "separate"):
                raise BadInput(f"unknown transport {name!r}: the separate placement's is 'broadcast' (NCCL on "
                               f"CUDA, gloo on CPU); choose from {', '.join(TRANSPORTS)}")
            if name not in TRANSPORTS:
                raise BadInput(f"unknown transport {name!r}; choose from {', '.join(TRANSPORTS)}")
            if name not in PLACEMENTS:
                raise BadInput(f"transport {name!r} is not benchmarked yet (no placement for it in {__name__})")
        if len(set(names)) < len(names):
            raise BadInput(f"--transports names a transport twice: {','.join(names)}")
    if out is not None and Path(out).exists():
        raise BadInput(f"{out} exists: nothing is overwritten")
    request = check_target(model, layout or DEFAULT_LAYOUT, device, dtype)
    device = request["device"]
    engine = engine or default_engine(device)
    world_size = request["layout"].world_size
    names = default_transports(device, engine, world_size) if transports is None else names
    if "cuda-ipc" in names and device != "cuda":
        raise BadInput("transport 'cuda-ipc' needs --device cuda (the engine maps rank 0's GPU buffer)")
    for name in ("cuda-ipc", "broadcast"):
        if name in names and engine != "vllm":
            raise BadInput(f"transport {name!r} needs --engine vllm (the {engine} engine takes buckets through "
                           "the host only)")
    gpu = engine_gpu(world_size) if device == "cuda" and "broadcast" in names else None
    if device == "cuda" and "broadcast" in names and gpu is None:
        raise BadInput(f"transport 'broadcast' on cuda puts the engine on a GPU of its own: layout "
                       f"{request['layout'].name} takes {world_size}, {_gpu_count()} visible")
    if load_path is not None:
        from harness.rollout.vllm_engine import check_load_path

        if engine != "vllm":
            raise BadInput(f"load_path (how an engine loads an update) is the vLLM engine's, not the {engine} engine's")
        try:
            check_load_path(load_path, device)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
    if engine == "vllm":
        _check_vllm(model, device)
    return {**request, "engine": engine, "transports": names, "engine_gpu": gpu, "bucket_bytes": bucket_bytes,
            "repeats": repeats, "out": out, "not_measured": _unmeasured(device, engine, world_size, names),
            "load_path": load_path}


def _check_vllm(model: str, device: str) -> None:
    from harness.models import load_hf_config
    from harness.rollout.vllm_engine import VLLMUnavailable, check_model, vllm_python, vllm_pythonpath

    try:
        vllm_python()
        vllm_pythonpath()
        check_model(load_hf_config(model), device)
    except (VLLMUnavailable, ValueError) as exc:
        raise BadInput(str(exc)) from None


# ----------------------------------------------------------------------------- rank side
def _copy(worker, nbytes: int, repeats: int, peer: int | None = None) -> dict[str, Any] | None:
    """Rank 0: a plain copy of `nbytes` on its device (device-to-device on CUDA, memcpy on CPU), one
    warm-up and `repeats` timed; with `peer` (a GPU index) also from its GPU into that one. And what
    the device is."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    device = worker.offloader.device
    out = {"samples_s": _timed_copies(nbytes, repeats, device, device), "machine": _machine(device)}
    if peer is not None:
        target = torch.device("cuda", peer)
        out["peer_samples_s"] = _timed_copies(nbytes, repeats, device, target)
        out["peer"] = f"{device} -> {target}"
        out["peer_access"] = bool(torch.cuda.can_device_access_peer(device, target))
    return out


def _timed_copies(nbytes: int, repeats: int, source, target) -> list[float]:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=source)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=target)
    cuda = [d for d in (source, target) if d.type == "cuda"]
    times = []
    for i in range(repeats + 1):  # the first is the warm-up (touches dst's pages)
        for d in cuda:
            torch.cuda.synchronize(d)
        start = time.perf_counter()
        dst.copy_(src)
        for d in cuda:
            torch.cuda.synchronize(d)
        if i:
            times.append(time.perf_counter() - start)
    if not torch.equal(dst[-1:].to(source), src[-1:]):
        raise RuntimeError("the copy baseline did not copy")
    del src, dst
    if cuda:
        for d in cuda:
            with torch.cuda.device(d):
                torch.cuda.empty_cache()
    return times


def _machine(device) -> dict[str, Any]:
    import os
    import platform

    import torch

    facts: dict[str, Any] = {"device": str(device), "cpus": os.cpu_count(), "platform": platform.platform()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(device_name=props.name, device_memory_bytes=int(props.total_memory),
                     cuda=torch.version.cuda)
    else:
        facts["device_name"] = _cpu_name()
    return facts


def _cpu_name() -> str:
    import platform

    from harness.report.fingerprint import cpuinfo_field

    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def _gpu_memory(worker) -> tuple[int, int] | None:
    """Rank 0: (free, total) bytes of its GPU, as the engine's process will see them at start."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(worker.offloader.device)
    return int(free), int(total)


# ----------------------------------------------------------------------------- parent side
def _open(kind: str, model: str, dtype, device: str, transport: str, options: dict[str, Any]):
    """A fresh engine for one transport (closed by the caller: one engine at a time)."""
    if kind == "hf":
        from harness.rollout.engines import open_engine

        return open_engine("hf", model, dtype=dtype, device=device)
    from harness.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model, dtype=dtype, device=device, transport=transport, **options)


def _vllm_options(policy, model: str, device: str, transport: str, gpu: int | None,
                  load_path: str | None = None) -> dict[str, Any]:
    """What a vLLM engine needs to start here: a short max_model_len (the bench never generates; the
    0.6B shape's 40960 positions would not fit the engine's 64 MiB KV cache) and, colocated on CUDA, a
    gpu_memory_utilization within what the policy left free on its GPU (vLLM refuses to start when
    utilization x total exceeds the free memory: its default 0.92 does next to a 0.6B policy). The
    separate engine gets its GPU (`gpu=`) and vLLM's default utilization there."""
    from harness.models import load_hf_config

    options: dict[str, Any] = {"max_model_len": min(MAX_MODEL_LEN,
                                                    int(load_hf_config(model).max_position_embeddings))}
    if load_path is not None:
        options["load_path"] = load_path
    if device == "cuda" and PLACEMENTS[transport] == "separate":
        options["gpu"] = gpu
    elif device == "cuda":
        free, total = policy.apply(_gpu_memory)[0]
        fraction = math.floor((free - ENGINE_HEADROOM) / total * 100) / 100
        if fraction < 0.05:
            raise RuntimeError(f"the policy left {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB free on rank 0's "
                               "GPU: too little for a colocated vLLM engine")
        options["engine_args"] = {"gpu_memory_utilization": min(fraction, 0.9)}
    return options


def _close(engine) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        close()
    else:  # the HF engine lives in this process: drop it and give its GPU memory back
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# The per-update split (JSON key -> SyncReport attribute); the medians go to the transport's figures.
SPLIT = {"seconds": "seconds", "export_s": "export_seconds", "export_walk_s": "walk_seconds",
         "export_copy_s": "copy_seconds", "export_pack_s": "pack_seconds",
         "export_round_trip_s": "round_trip_seconds", "load_s": "load_seconds"}


def _measure(policy, engine, bucket_bytes: int, repeats: int, log) -> dict[str, Any]:
    from harness.rollout.sync import sync_weights

    warmup = sync_weights(policy, engine, bucket_bytes=bucket_bytes)
    log(f"  warm-up update (not counted): {warmup.seconds:.3f}s, {warmup.buckets} buckets, {warmup.bytes} bytes")
    reports = []
    for i in range(repeats):
        report = sync_weights(policy, engine, bucket_bytes=bucket_bytes)
        if (report.bytes, report.buckets) != (warmup.bytes, warmup.buckets):
            raise RuntimeError(f"update {i + 1} moved {report.bytes} bytes in {report.buckets} buckets, the "
                               f"warm-up {warmup.bytes} in {warmup.buckets}")
        reports.append(report)
        log(f"  update {i + 1}: {report.seconds:.3f}s, {report.gbps:.3f} GB/s (export {report.export_seconds:.3f}s: "
            f"walk {report.walk_seconds:.3f}, copy {report.copy_seconds:.3f}, pack {report.pack_seconds:.3f}, "
            f"round trips {report.round_trip_seconds:.3f}; engine load {report.load_seconds:.3f}s"
            + (f", {report.load_path})" if report.load_path else ")"))
    seconds = statistics.median(r.seconds for r in reports)
    updates = [{key: _sig(getattr(r, attribute)) for key, attribute in SPLIT.items()} for r in reports]
    return {"transport": warmup.transport, "bytes": warmup.bytes, "buckets": warmup.buckets,
            "tensors": warmup.tensors, "max_bucket_bytes": warmup.max_bucket_bytes,
            "seconds": _sig(seconds), "gbps": _sig(warmup.bytes / seconds / 1e9),
            "samples_s": [_sig(r.seconds) for r in reports], "warmup_s": _sig(warmup.seconds),
            # where the time goes (module docstring): the ranks' export, split, and the engine's loads
            **{key: _sig(statistics.median(u[key] for u in updates)) for key in SPLIT if key != "seconds"},
            "updates": updates, "load_path": warmup.load_path}


def run(model: str = DEFAULT_MODEL, layout: str | None = DEFAULT_LAYOUT, device: str | None = None,
        dtype: str = "bf16", engine: str | None = None, transports: str | list[str] | None = None,
        bucket_mb: float | None = None, repeats: int = 3, out: str | None = None, log=print,
        load_path: str | None = None) -> dict[str, Any]:
    """Measure (module docstring); raises BadInput before anything starts."""
    import torch

    from harness.launch import World
    from harness.training.handles import PolicyHandle

    request = check_input(model, layout, device, dtype, engine, transports, bucket_mb, repeats, out, load_path)
    layout_, device, engine = request["layout"], request["device"], request["engine"]
    torch_dtype = getattr(torch, DTYPES[dtype])
    log(f"bench sync: {model} {layout_.name} on {layout_.world_size} {device} ranks, {dtype}, engine {engine}, "
        f"transports {', '.join(request['transports'])}, buckets of {request['bucket_bytes']} bytes, "
        f"{repeats} repeats")
    measured: dict[str, dict[str, Any]] = {}
    engine_versions: dict[str, Any] = {}
    world = World(layout_.world_size, device, echo_output=False, timeout=1800.0).start()
    try:
        policy = PolicyHandle(world, layout_, model, dtype=dtype)
        try:
            for transport in request["transports"]:
                measured[transport] = figures = {"placement": PLACEMENTS[transport]}
                try:
                    options = (_vllm_options(policy, model, device, transport, request["engine_gpu"], load_path)
                               if engine == "vllm" else {})
                    figures["engine_options"] = options
                    start = time.perf_counter()
                    live = _open(engine, model, torch_dtype, device, transport, options)
                    try:
                        figures["engine_start_s"] = _sig(time.perf_counter() - start, 4)
                        log(f"  {engine} engine ({transport}, {PLACEMENTS[transport]}) up in "
                            f"{figures['engine_start_s']:.1f}s")
                        engine_versions.update(getattr(live, "versions", {}) or {})
                        if getattr(live, "load_path_reason", None):
                            figures["load_path_reason"] = live.load_path_reason
                        figures.update(_measure(policy, live, request["bucket_bytes"], repeats, log))
                    finally:
                        _close(live)
                        del live
                except Exception as exc:  # noqa: BLE001 - recorded; the other transports still run
                    figures["error"] = f"{type(exc).__name__}: {exc}"
                    log(f"  {transport} failed: {traceback.format_exc()}")
            sizes = {m["bytes"] for m in measured.values() if "bytes" in m}
            if len(sizes) > 1:
                raise RuntimeError(f"the transports moved different byte counts: {sizes}")
            nbytes = sizes.pop() if sizes else _exported_bytes(model, torch_dtype)
            separate = "broadcast" in measured and "error" not in measured["broadcast"]
            peer = request["engine_gpu"] if device == "cuda" and separate else None
            copy = policy.apply(_copy, nbytes, max(repeats, 3), peer)[0]
        finally:
            policy.close()
    finally:
        world.close()

    copy_s = statistics.median(copy["samples_s"])
    copy_gbps = nbytes / copy_s / 1e9
    baseline = {"kind": "device-to-device" if device == "cuda" else "host memcpy", "bytes": nbytes,
                "seconds": _sig(copy_s), "gbps": _sig(copy_gbps), "samples_s": [_sig(t) for t in copy["samples_s"]]}
    result: dict[str, Any] = {
        "model": model, "layout": layout_.name, "device": device, "world_size": layout_.world_size,
        "dtype": dtype, "engine": engine, "bucket_bytes": request["bucket_bytes"], "repeats": repeats,
        "bytes": nbytes, "copy": baseline, "copy_gbps": _sig(copy_gbps), "goal_of_copy": GOAL,
        "load_path_asked": load_path,  # None: each engine's default (VLLMEngine: in-place on CUDA where valid)
    }
    if "peer_samples_s" in copy:
        peer_s = statistics.median(copy["peer_samples_s"])
        result["copy_peer"] = {"kind": f"device-to-device, {copy['peer']}", "peer_access": copy["peer_access"],
                               "bytes": nbytes, "seconds": _sig(peer_s), "gbps": _sig(nbytes / peer_s / 1e9),
                               "samples_s": [_sig(t) for t in copy["peer_samples_s"]]}
    for name, figures in measured.items():
        if "gbps" in figures:
            figures["of_copy"] = _sig(figures["gbps"] / copy_gbps, 4)
            if name == "broadcast" and "copy_peer" in result:
                figures["of_peer_copy"] = _sig(figures["gbps"] / result["copy_peer"]["gbps"], 4)
    versions = {**_versions(), **{f"engine_{k}" if k == "torch" else k: v for k, v in engine_versions.items()}}
    try:
        from importlib import metadata

        versions["transformers"] = metadata.version("transformers")
    except Exception:  # noqa: BLE001 - a fact for the record, never a reason to fail
        pass
    from harness.bridge.backends import current

    result.update(transports=measured, not_measured=request["not_measured"], machine=copy["machine"],
                  versions=versions, bridge=current())
    return result


def _exported_bytes(model: str, dtype) -> int:
    """What an update moves, when no transport got to measure it (every one failed): the HF
    checkpoint's tensors at `dtype` (a tied embedding once), from the config alone."""
    import torch

    from harness.models import build_hf_model
    from harness.models.zoo import checkpoint_state_dict

    with torch.device("meta"):
        model_ = build_hf_model(model, dtype=dtype)
    state = checkpoint_state_dict(model_)
    if model_.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # sent once, as embed_tokens
    return sum(t.numel() * t.element_size() for t in state.values())


def failed(result: dict[str, Any]) -> list[str]:
    return [name for name, figures in result["transports"].items() if "error" in figures]


def table(result: dict[str, Any]) -> str:
    """The figures as a small table (what the JSON line holds, rounded): per transport the update, then
    where its seconds went (the export's walk, copy + pack and round trips; the engine's load)."""
    rows = [("transport", "placement", "buckets", "MB", "seconds", "GB/s", "of copy", "export", "walk",
             "copy+pack", "round trips", "load", "load path")]
    for name, f in result["transports"].items():
        if "error" in f:
            rows.append((name, f["placement"], *["-"] * 4, "failed", *["-"] * 6))
            continue
        split = (f"{f['export_s']:.3g}", f"{f['export_walk_s']:.3g}", f"{f['export_copy_s'] + f['export_pack_s']:.3g}",
                 f"{f['export_round_trip_s']:.3g}", f"{f['load_s']:.3g}", f["load_path"] or "-")
        rows.append((name, f["placement"], str(f["buckets"]), f"{f['bytes'] / 1e6:.1f}", f"{f['seconds']:.4g}",
                     f"{f['gbps']:.4g}", f"{f['of_copy']:.3g}", *split))
    for key in ("copy", "copy_peer"):
        if key in result:
            c = result[key]
            rows.append((f"copy ({c['kind']})", "-", "1", f"{c['bytes'] / 1e6:.1f}", f"{c['seconds']:.4g}",
                         f"{c['gbps']:.4g}", f"{c['gbps'] / result['copy_gbps']:.3g}", *["-"] * 6))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.append("seconds = export (walk + copy+pack + round trips, the ranks) + load (the engine) + the driver's rest")
    lines.append(f"goal: >= {result['goal_of_copy']:.0%} of the copy (printed, not asserted; two copies, the "
                 "pack's and the engine's, bound an update at 50%)")
    lines += [f"{name} failed: {result['transports'][name]['error']}" for name in failed(result)]
    lines += list(result["not_measured"].values())
    return "\n".join(lines)


def main(args) -> int:
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        result = run(args.model, args.layout, args.device, args.dtype, args.engine, args.transports,
                     args.bucket_mb, args.repeats, args.out, log=log, load_path=args.load_path)
    except BadInput as exc:
        print(f"mrh bench sync: {exc}", file=sys.stderr)
        return 2
    line = json.dumps(result)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result), file=sys.stderr, flush=True)
    print(line, flush=True)
    return 1 if failed(result) else 0
