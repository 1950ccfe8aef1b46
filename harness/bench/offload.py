"""`mrh bench offload`: how fast the offload manager moves each component, next to what the
host<->device link does in the same run.

Measured on the ranks of one world, one policy after a warm-up step and a warm-up cycle (the
first offload allocates the host shadows: page-locking costs about 0.45 s per GiB on an H200,
../shared/notes/offload.md; later cycles reuse them):
  * bandwidth - host<->device copy bandwidth of one flat uint8 tensor the size of the largest
                component (at most 4 GiB): D2H into / H2D from a pinned buffer, and the same with a
                pageable (already touched) one; median of 3, GiB/s;
  * components - per component (params, grads, optimizer), alone: offload_s and reload_s (median
                over --cycles, the slowest rank), the bytes it copies (grads are discarded, not
                copied: time only), GiB/s, and `fraction_of_pinned` (offload against pinned D2H,
                reload against pinned H2D) with a `reason` when it is below TARGET (0.8): the
                number of storages and their mean size (small copies do not fill the link, and
                the per-call accounting is not amortized); rank 0's bytes, the slowest rank's time;
  * all       - everything offloaded and reloaded in one call each.
On the CPU tier "device" and host are the same memory: the figures are memcpy speeds, printed
for the record, not the link the target is about.

One JSON line on stdout; progress on stderr. Exit 0 measured, 2 bad input (before any rank starts).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from harness.bench.ckpt import BadInput, _batch_maker, _versions, check_target

TARGET = 0.8  # of the pinned bandwidth (issue 13)
MAX_PROBE = 4 << 30
COMPONENTS = ("params", "grads", "optimizer")


# ----------------------------------------------------------------------------- rank side
def _bandwidth(worker, nbytes: int, repeats: int = 3) -> dict[str, float]:
    import torch

    from harness.offload.storages import host_buffer, synchronize

    device = worker.offloader.device
    x = torch.ones(nbytes, dtype=torch.uint8, device=device)
    pinned = host_buffer(nbytes, pinned=device.type == "cuda")
    pageable = torch.zeros(nbytes, dtype=torch.uint8)  # touched: no first-fault cost in the timing
    out = {}
    for name, dst, src in (("pinned_d2h", pinned, x), ("pinned_h2d", x, pinned),
                           ("pageable_d2h", pageable, x), ("pageable_h2d", x, pageable)):
        times = []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            synchronize(device)
            times.append(time.perf_counter() - start)
        out[f"{name}_GiBps"] = nbytes / statistics.median(times) / 2**30
    del x, pinned, pageable
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _timed(worker, op: str, components: list[str]) -> dict[str, Any]:
    from harness.offload.storages import synchronize

    synchronize(worker.offloader.device)
    start = time.perf_counter()
    rows = getattr(worker.offloader, op)(tuple(components))
    return {"s": time.perf_counter() - start, "rows": rows}


def _largest(worker) -> int:
    account = worker.offloader.accounting()
    return max(account[c]["theory_bytes"] for c in COMPONENTS)


# ----------------------------------------------------------------------------- parent side
def _component_figures(offloads, reloads, bandwidth: dict[str, float]) -> dict[str, Any]:
    """offloads/reloads: per cycle, each rank's _timed result for this component."""
    rows = offloads[0][0]["rows"][0]
    copied = 0 if rows["component"] == "grads" else rows["theory_bytes"]
    off = statistics.median(max(r["s"] for r in ranks) for ranks in offloads)
    back = statistics.median(max(r["s"] for r in ranks) for ranks in reloads)
    figures = {"bytes": rows["theory_bytes"], "copied_bytes": copied, "storages": rows["storages"],
               "pinned": rows["pinned"], "offload_s": round(off, 6), "reload_s": round(back, 6)}
    if copied:
        figures["offload_GiBps"] = round(copied / off / 2**30, 3)
        figures["reload_GiBps"] = round(copied / back / 2**30, 3)
        fraction = min(figures["offload_GiBps"] / bandwidth["pinned_d2h_GiBps"],
                       figures["reload_GiBps"] / bandwidth["pinned_h2d_GiBps"])
        figures["fraction_of_pinned"] = round(fraction, 3)
        if fraction < TARGET:
            figures["reason"] = (f"{rows['storages']} storages of {copied / rows['storages'] / 2**20:.2f} MiB on "
                                 f"average, {copied / 2**20:.1f} MiB in all: the per-call costs (the accounting "
                                 "walks before and after, the synchronizations) are not amortized")
    else:
        figures["note"] = "grads are discarded on offload and zeroed on reload: nothing is copied"
    return figures


def run(model: str, layout: str | None = None, device: str | None = None, dtype: str = "bf16",
        cycles: int = 3, log=print) -> dict[str, Any]:
    """Measure (module docstring); raises BadInput before anything starts."""
    from harness.checkpoint.resume_check import CONFIG
    from harness.launch import World
    from harness.training.handles import PolicyHandle

    if not isinstance(cycles, int) or isinstance(cycles, bool) or cycles < 1:
        raise BadInput(f"--cycles must be an integer >= 1, got {cycles!r}")
    request = check_target(model, layout, device, dtype)
    layout_, device = request["layout"], request["device"]
    config = {**CONFIG, "dtype": dtype}
    batch = _batch_maker(request["vocab_size"], layout_.dp * config["micro_batches"])
    log(f"bench offload: {model} {layout_.name} on {layout_.world_size} {device} ranks, {dtype}, {cycles} cycles")
    world = World(layout_.world_size, device, echo_output=False, timeout=1800.0).start()
    try:
        policy = PolicyHandle(world, layout_, model, **config)
        try:
            policy.step(batch(0))
            probe = min(max(policy.apply(_largest)), MAX_PROBE)
            bandwidth = {k: round(v, 3) for k, v in policy.apply(_bandwidth, probe)[0].items()}
            log(f"  copy bandwidth ({probe / 2**20:.0f} MiB): {bandwidth}")
            for op in ("offload", "reload"):  # warm-up cycle: the host shadows are allocated here
                policy.apply(_timed, op, list(COMPONENTS))
            figures = {}
            for component in COMPONENTS:
                offloads, reloads = [], []
                for _ in range(cycles):
                    offloads.append(policy.apply(_timed, "offload", [component]))
                    reloads.append(policy.apply(_timed, "reload", [component]))
                figures[component] = _component_figures(offloads, reloads, bandwidth)
                log(f"  {component}: {figures[component]}")
            whole = [(policy.apply(_timed, "offload", list(COMPONENTS)), policy.apply(_timed, "reload", list(COMPONENTS)))
                     for _ in range(cycles)]
            all_ = {"offload_s": round(statistics.median(max(r["s"] for r in o) for o, _ in whole), 6),
                    "reload_s": round(statistics.median(max(r["s"] for r in b) for _, b in whole), 6)}
            policy.step(batch(1))  # and it trains on
        finally:
            policy.close()
    finally:
        world.close()
    return {"model": model, "layout": layout_.name, "device": device, "world_size": layout_.world_size,
            "dtype": dtype, "cycles": cycles, "target_fraction_of_pinned": TARGET, "bandwidth": bandwidth,
            "probe_bytes": probe, "components": figures, "all": all_, "versions": _versions()}


def main(args) -> int:
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        result = run(args.model, args.layout, args.device, args.dtype, args.cycles, log=log)
    except BadInput as exc:
        print(f"mrh bench offload: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0
