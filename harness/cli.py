"""`mrh`: the harness's command line."""
from __future__ import annotations

import argparse
import sys


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `command`, only that one's arguments (the others keep their name
    and help): a command's arguments may import its modules (`mrh parity`'s: torch and
    transformers, seconds), which `mrh report compare` or `mrh --help` need not wait for."""

    def wanted(name: str) -> bool:
        return command is None or command == name

    parser = argparse.ArgumentParser(prog="mrh", description="megatron-rl-harness command line")
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="benchmarks that print figures")
    benches = bench.add_subparsers(dest="bench", required=True)
    world = benches.add_parser("world", help="persistent world vs fresh torchrun launch")
    world.add_argument("--ranks", type=int, default=2, help="world size (default 2)")
    world.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    world.add_argument("--repeats", type=int, default=3, help="fresh launches to time (default 3)")
    world.add_argument("--launcher", choices=("process", "ray"), default="process",
                       help="how the persistent world starts its ranks (default process)")
    world.add_argument("--ray-address", default=None,
                       help="with --launcher ray: attach to this cluster (default $RAY_ADDRESS, else a local one)")
    world.set_defaults(handler="harness.bench.world:main")
    ckpt_bench = benches.add_parser("ckpt", help="sync save vs async blocking vs async total time, one JSON line "
                                                 "(exit 2 bad input)")
    ckpt_bench.add_argument("--model", default="tiny-qwen3-kv4",
                            help="zoo name or local HF checkpoint dir (default tiny-qwen3-kv4)")
    ckpt_bench.add_argument("--layout", default=None, help="default dp2 on cpu; cuda: dp2 with 2+ GPUs, else tp1")
    ckpt_bench.add_argument("--device", default=None, help="cpu or cuda (default cuda if available, else cpu)")
    ckpt_bench.add_argument("--dtype", default="fp32", help="fp32 or bf16 (default fp32)")
    ckpt_bench.add_argument("--saves", type=int, default=3, help="timed saves of each kind (default 3)")
    ckpt_bench.add_argument("--caller", default="temporal",
                            help="megatron-core async caller: temporal, persistent or both (persistent: cuda only)")
    ckpt_bench.add_argument("--dir", default=None, help="checkpoint root (default: a temp dir)")
    ckpt_bench.add_argument("--keep-dir", action="store_true", help="leave the checkpoints on disk")
    ckpt_bench.add_argument("--optimizer-format", default="fully_reshardable",
                            help="fully_reshardable (default: loadable at any layout) or dp_reshardable "
                                 "(flat buffers of this TP/PP layout: cheaper to build)")
    ckpt_bench.set_defaults(handler="harness.bench.ckpt:main")
    offload_bench = benches.add_parser("offload", help="offload/reload time and throughput per component vs the "
                                       "pinned and pageable copy bandwidth, one JSON line")
    offload_bench.add_argument("--model", default="tiny-qwen3-kv4",
                               help="zoo name or local HF checkpoint (default tiny-qwen3-kv4)")
    offload_bench.add_argument("--layout", default=None, help="default dp2 on cpu; cuda: dp2 with 2+ GPUs, else tp1")
    offload_bench.add_argument("--device", default=None, help="cpu or cuda (default cuda if available, else cpu)")
    offload_bench.add_argument("--dtype", default="bf16", help="fp32 or bf16 (default bf16)")
    offload_bench.add_argument("--cycles", type=int, default=3, help="timed cycles per component (default 3)")
    offload_bench.set_defaults(handler="harness.bench.offload:main")
    sync_help = ("seconds and GB/s of one full weight update into the rollout engine per transport (colocated: "
                 "cuda-ipc, host; separate: broadcast, the engine on a GPU of its own, NCCL), next to a plain "
                 "device-to-device copy of the same bytes; one JSON line (exit 1 a transport failed, 2 bad input)")
    sync_bench = benches.add_parser("sync", help=sync_help, description=sync_help)
    sync_bench.add_argument("--model", default="qwen3-0.6b-shape",
                            help="zoo name or local HF checkpoint (default qwen3-0.6b-shape)")
    sync_bench.add_argument("--layout", default="tp1", help="the policy's layout (default tp1)")
    sync_bench.add_argument("--device", default=None, help="cpu or cuda (default cuda if available, else cpu)")
    sync_bench.add_argument("--dtype", default="bf16", help="fp32 or bf16 (default bf16)")
    sync_bench.add_argument("--engine", default=None, help="hf or vllm (default vllm on cuda, hf on cpu)")
    sync_bench.add_argument("--transports", default=None,
                            help="comma list of cuda-ipc, host, broadcast (default on cuda with vllm: cuda-ipc,host "
                                 "and broadcast when a GPU is left for the engine; else host); cuda-ipc: vllm on "
                                 "cuda; broadcast: vllm, on cuda a GPU beside the layout's")
    sync_bench.add_argument("--bucket-mb", type=float, default=None,
                            help="bucket bound in MiB (default 64, the sync's DEFAULT_BUCKET_BYTES)")
    sync_bench.add_argument("--repeats", type=int, default=3, help="timed updates per transport after a warm-up "
                                                                   "(default 3)")
    sync_bench.add_argument("--load-path", default=None,
                            help="how the vLLM engine loads an update: reload or in-place (default: in-place on "
                                 "cuda where valid, else reload)")
    sync_bench.add_argument("--out", default=None, help="also write the JSON to this file (never overwritten)")
    sync_bench.set_defaults(handler="harness.bench.sync:main")

    parity = commands.add_parser("parity", help="HF vs Megatron logprob parity over layouts")
    if wanted("parity"):
        from harness.parity.cli import add_arguments as parity_arguments

        parity_arguments(parity)
    parity.set_defaults(handler="harness.parity.cli:main")

    report = commands.add_parser("report", help="compare runs against a baseline, plot trends, render")
    if wanted("report"):
        from harness.report.cli import add_arguments as report_arguments

        report_arguments(report)
    report.set_defaults(handler="harness.report.cli:main")

    repro = commands.add_parser("repro", help="the catalog of wrong variants; reproduce one on the variant "
                                              "and the fixed path (exit 0 reproduced and fixed)")
    if wanted("repro"):
        from harness.variants.cli import add_arguments as repro_arguments

        repro_arguments(repro)
    repro.set_defaults(handler="harness.variants.cli:main")

    loop = commands.add_parser("loop", help="the GRPO loop (engine, rewards, policy steps, weight sync) with "
                                            "per-iteration metrics and a run report with plots")
    if wanted("loop"):
        from harness.rl.cli import add_arguments as loop_arguments

        loop_arguments(loop)
    loop.set_defaults(handler="harness.rl.cli:main")

    ckpt = commands.add_parser("ckpt", help="inspect dist checkpoints")
    ckpts = ckpt.add_subparsers(dest="ckpt", required=True)
    diff = ckpts.add_parser("diff", help="full-tensor diff of two checkpoints (exit 0 equal, 1 different, 2 bad input)")
    if wanted("ckpt"):
        from harness.checkpoint.diff import add_arguments as diff_arguments

        diff_arguments(diff)
    diff.set_defaults(handler="harness.checkpoint.diff:main")
    return parser


def main(argv: list[str] | None = None) -> int:
    from harness.backends import cpu_arithmetic, cuda_precision

    try:  # before any torch kernel runs here or in a rank ($MRH_CPU_ISA; cpu_arithmetic says why),
        cpu_arithmetic.pin()  # and before CUDA starts (TF32 off: cuda_precision says why)
        cuda_precision.pin()
    except (ValueError, cpu_arithmetic.ArithmeticPinError) as exc:
        print(f"mrh: {exc}", file=sys.stderr)
        return 2
    argv = sys.argv[1:] if argv is None else argv
    # The command is the first word (mrh's own option is -h/--help alone); without one (`mrh`,
    # `mrh --help`) every command keeps its name and help and none builds its arguments.
    args = _parser(next((word for word in argv if not word.startswith("-")), "")).parse_args(argv)
    module_name, func_name = args.handler.split(":")
    module = __import__(module_name, fromlist=[func_name])  # import only what the command needs
    return getattr(module, func_name)(args)


if __name__ == "__main__":
    sys.exit(main())
