"""One rank of a fresh `torchrun` launch doing the bench's work once (see harness/bench/world.py)."""
from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layout", required=True)
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import torch
    import torch.distributed as dist

    from harness.launch.rank import RankContext, bind_context

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "cpu:gloo,cuda:nccl"
    else:
        from harness.backends import cpu_patches

        cpu_patches.install()
        backend = "gloo"
    dist.init_process_group(backend)
    bind_context(RankContext(rank, world_size, args.device, os.getcwd()))
    from harness.parallel.state import model_parallel
    from harness.probe import forward_backward

    with model_parallel(args.layout) as layout:
        forward_backward(layout)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
