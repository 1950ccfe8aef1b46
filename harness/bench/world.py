"""`mrh bench world`: what the persistent world saves over a fresh torchrun-style launch.

Three figures from one run, all doing the same work (initialize a layout, build the probe GPT,
one forward+backward, destroy the layout), for either launcher (`--launcher process|ray`):
  * world_start_s   - starting the persistent world's N ranks (paid once per session; with Ray,
                      ray_init_s is the local instance's start before it, also once per session);
  * layout_switch_s - median time of that work in the live world when the layout changes;
  * fresh_launch_s  - median time of `python -m torch.distributed.run` doing that work from scratch
                      (interpreters, imports, rendezvous, process group, work, exit).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

from harness.launch import ensure_ray, make_world
from harness.parallel.layout import enumerate_layouts
from harness.parallel.state import run_in_layout
from harness.probe import ProbeSpec, forward_backward


def bench_layouts(ranks: int) -> list[str]:
    """The layouts the probe supports on `ranks` ranks (no VPP or SP: the probe builds one chunk)."""
    spec = ProbeSpec()
    names = [l.name for l in enumerate_layouts(ranks, spec, allow_sp=False, allow_vpp=False)]
    if not names:
        raise SystemExit(f"no layout of the probe model fits {ranks} ranks")
    return names


def _fresh_launch(ranks: int, device: str, layout: str) -> float:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        "-m", "harness.bench.fresh_worker", "--device", device, "--layout", layout,
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"fresh launch failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return elapsed


def run(ranks: int, device: str, repeats: int = 3, log=print, launcher: str = "process",
        ray_address: str | None = None) -> dict[str, Any]:
    layouts = bench_layouts(ranks)
    log(f"bench world: {ranks} {device} ranks ({launcher} launcher), layouts {layouts}, {repeats} repeats")
    extra: dict[str, Any] = {}
    if launcher == "ray":
        start = time.perf_counter()
        ensure_ray(ray_address)
        extra["ray_init_s"] = round(time.perf_counter() - start, 4)
        log(f"  ray init: {extra['ray_init_s']:.2f}s")
    start = time.perf_counter()
    world = make_world(ranks, device, launcher=launcher, echo_output=False).start()
    world_start = time.perf_counter() - start
    log(f"  world start: {world_start:.2f}s")
    try:
        run_in_layout(world, layouts[-1], forward_backward)  # warm-up: first model build imports
        switches = []
        for i in range(max(repeats, 2) * len(layouts)):
            layout = layouts[i % len(layouts)]
            start = time.perf_counter()
            run_in_layout(world, layout, forward_backward)
            switches.append(time.perf_counter() - start)
            log(f"  switch to {layout}: {switches[-1]:.3f}s")
    finally:
        world.close()
    fresh = []
    for i in range(repeats):
        fresh.append(_fresh_launch(ranks, device, layouts[i % len(layouts)]))
        log(f"  fresh torchrun launch ({layouts[i % len(layouts)]}): {fresh[-1]:.2f}s")
    switch_s, fresh_s = statistics.median(switches), statistics.median(fresh)
    return {
        "launcher": launcher, **extra, "ranks": ranks, "device": device, "layouts": layouts,
        "world_start_s": round(world_start, 4), "layout_switch_s": round(switch_s, 4),
        "fresh_launch_s": round(fresh_s, 4), "switch_speedup": round(fresh_s / switch_s, 2),
        "switch_samples_s": [round(s, 4) for s in switches], "fresh_samples_s": [round(s, 4) for s in fresh],
    }


def main(args) -> int:
    result = run(args.ranks, args.device, args.repeats, log=lambda m: print(m, file=sys.stderr, flush=True),
                 launcher=args.launcher, ray_address=args.ray_address)
    print(json.dumps(result))
    return 0
