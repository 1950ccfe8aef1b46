"""Measure a layout switch in a live world (init + destroy of Megatron's groups), for choosing the
group-destroy policy on a machine: `python ci/switch_cost.py --device cuda --ranks 2`."""
import argparse
import json
import os
import threading
import time

from harness.launch import World
from harness.parallel.state import run_in_layout


def _threads(layout):
    return threading.active_count(), len(os.listdir("/proc/self/task"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--switches", type=int, default=6)
    parser.add_argument("--write-env", help="write `export MRH_KEEP_NCCL_GROUPS=..` for the faster policy")
    args = parser.parse_args()
    medians = {}
    for keep in ("0", "1"):
        world = World(args.ranks, args.device, echo_output=False, env={"MRH_KEEP_NCCL_GROUPS": keep})
        layouts = ["tp2", "pp2", "tp1"] if args.ranks >= 2 else ["tp1"]
        times = []
        for i in range(args.switches):
            start = time.perf_counter()
            run_in_layout(world, layouts[i % len(layouts)], _threads)
            times.append(round(time.perf_counter() - start, 3))
        tasks = world.run(lambda_free_tasks)
        world.close()
        print(json.dumps({"MRH_KEEP_NCCL_GROUPS": keep, "switch_s": times, "native_threads": tasks}), flush=True)
        medians[keep] = sorted(times[1:])[len(times[1:]) // 2]
    # Destroying is the clean choice; keep NCCL groups only when destroying costs 3x more.
    keep = "1" if medians["0"] > 3 * medians["1"] else "0"
    print(f"median switch: destroy all {medians['0']}s, keep NCCL {medians['1']}s -> MRH_KEEP_NCCL_GROUPS={keep}")
    if args.write_env:
        with open(args.write_env, "w") as f:
            f.write(f"export MRH_KEEP_NCCL_GROUPS={keep}\n")


def lambda_free_tasks():
    return len(os.listdir("/proc/self/task"))


if __name__ == "__main__":
    main()
