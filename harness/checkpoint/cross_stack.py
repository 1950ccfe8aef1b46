"""Cross-stack checks: a policy checkpoint and an HF export as the other stack sees them.

The harness runs on two stacks: megatron-core 0.16 with mbridge (Python 3.11) and megatron-core
0.19 with NVIDIA's Megatron-Bridge (Python 3.12), each in its own environment. Nothing anchors one
to the other but these checks: a checkpoint written by one stack is resumed by the other, and both
bridges export the same Megatron state. suites/checkpoint/test_cross_stack.py runs one stack in its
own process and the other through this module's command line:

    python -m harness.checkpoint.cross_stack versions
    python -m harness.checkpoint.cross_stack save OUT [--layout tp2] [--dtype fp32]
    python -m harness.checkpoint.cross_stack resume OUT NAME=CHECKPOINT@LAYOUT [...]

`save`: the resume check's policy (harness.checkpoint.resume_check: K_STEPS steps of its batches)
saved once per optimizer format (OUT/<format>/), its HF export then (OUT/saved.safetensors), one
more step without stopping and the HF export after it (OUT/after.safetensors). `resume`: per job, a
fresh policy at LAYOUT loads CHECKPOINT, saves it again without stepping (OUT/NAME/resaved/, diffed
against CHECKPOINT: `resave_diff`, harness.checkpoint.diff's as_dict), exports it
(OUT/NAME/loaded.safetensors), takes the next step and exports again
(OUT/NAME/after.safetensors); a load the harness refuses leaves nothing under OUT/NAME and the
job's policy as it was. Each command starts its own world of 2 CPU ranks and prints one JSON line
on stdout. Exit 0 done; 2 refused (a load, or the command: one line on stderr, nothing written); 1
anything else (its traceback). `run_on` runs a command on another stack's Python.

Measured (2 CPU ranks, tiny-qwen3-kv4 fp32, megatron-core 0.16.1 + mbridge 0.15.1 + torch 2.13 and
megatron-core 0.19.2 + Megatron-Bridge 0.6.2 + torch 2.15, 2026-11-25):
- 0.16 -> 0.19 resumes exactly. A fully_reshardable checkpoint saved at tp2 and loaded at dp2 (or
  tp2) on 0.19 saves again equal to it, every tensor bit for bit (`mrh ckpt diff`); the next step
  at tp2 is the uninterrupted one bit for bit (loss, grad norm, every weight), and so is that of
  a dp_reshardable one (same TP/PP only). bf16 too (once by hand, tp2 -> dp2: the
  re-save diffs equal, the two exports are torch.equal), not in the suite: bf16 steps on CPU are
  several times slower than fp32 ones.
- 0.19 -> 0.16 is refused. 0.19 writes the common state into the torch_dist files and no common.pt
  (NVIDIA/Megatron-LM#5160); 0.16.1 reads it only from common.pt, and without the refusal every
  rank failed inside dist_checkpointing.load (FileNotFoundError: .../common.pt, after building its
  load template from the live state). harness.checkpoint.manager.check_format_readable now refuses
  it in the parent, before any rank works:
    <dir>: written by megatron-core 0.19.2, which keeps the checkpoint's common state (scheduler,
    data position, optimizer param groups) inside its torch_dist files and writes no common.pt;
    megatron-core 0.16.1 here reads the common state only from common.pt, so every rank would fail
    half-way into the load. Resume it with megatron-core 0.19.x (nothing was loaded)
- Trained from the same HF weights (tp2, fp32), the two stacks take the same steps bit for bit
  (loss, grad norm; their checkpoints diff equal), and mbridge and Megatron-Bridge export every HF
  tensor of one state with the same name and value.
- Found on the way (either stack, not cross-stack): a dp_reshardable load did not restore torch
  Adam's per-parameter step (saved: 2, loaded: 0), so the weights after a resumed step differed
  from the uninterrupted ones (max |diff| 5.7e-4) while its loss and grad norm, taken before the
  update, were equal. megatron-core's bug on both stacks (the checkpoint carries the step, the
  dp_reshardable parameter-state load overwrites it): worked around as `dp-reshardable-step-reset`
  in harness.compat.megatron_core.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAVED, AFTER, LOADED, RESAVED = "saved.safetensors", "after.safetensors", "loaded.safetensors", "resaved"
WORLD_SIZE = 2  # every layout the checks use (tp2, dp2) on one world


def versions() -> dict[str, str]:
    """This stack: megatron-core, its bridge, torch, Python (package metadata: nothing imported)."""
    from importlib.metadata import version

    from harness.bridge import backends

    return {"megatron_core": version("megatron-core"), "bridge": backends.current(), "torch": version("torch"),
            "python": sys.version.split()[0]}


def line(version: str) -> str:
    """"0.19.2" -> "0.19": what decides a checkpoint's format."""
    return ".".join(version.split(".")[:2])


def _write_hf(state: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path))


def read_hf(path: str | os.PathLike) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _stats(step: dict[str, Any]) -> dict[str, float]:
    return {key: step[key] for key in ("loss", "grad_norm", "lr")}


# ------------------------------------------------------------------------ the commands (any world)
def save(world, out: str | os.PathLike, *, layout: str = "tp2", dtype: str = "fp32") -> dict[str, Any]:
    """Train, save in every optimizer format, export, step on, export (module docstring)."""
    from harness.checkpoint.resume_check import CONFIG, K_STEPS, MODEL, train_batch
    from harness.checkpoint.sharded import OPTIMIZER_FORMATS
    from harness.training.handles import PolicyHandle

    out = Path(out)
    _refuse_existing(_save_outputs(out))
    out.mkdir(parents=True, exist_ok=True)
    policy = PolicyHandle(world, layout, MODEL, **{**CONFIG, "dtype": dtype})
    try:
        policy.steps([train_batch(i) for i in range(K_STEPS)])
        checkpoints = {}
        for optimizer_format in OPTIMIZER_FORMATS:  # a save changes nothing: both hold one state
            policy.save(out / optimizer_format, optimizer_format=optimizer_format)
            checkpoints[optimizer_format] = str(out / optimizer_format)
        position = policy.position()
        _write_hf(policy.hf_state_dict(), out / SAVED)
        next_step = _stats(policy.step(train_batch(K_STEPS)))
        _write_hf(policy.hf_state_dict(), out / AFTER)
        return {**versions(), "layout": policy.layout.name, "dtype": dtype, "checkpoints": checkpoints,
                "position": {k: position[k] for k in ("steps_done", "consumed_samples")}, "next_step": next_step,
                "saved": str(out / SAVED), "after": str(out / AFTER)}
    finally:
        policy.close()


def resume(world, out: str | os.PathLike, jobs: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """Each job NAME -> (checkpoint, layout): load, re-save, export, step on, export (module
    docstring). A refused load is the job's result, not an exception."""
    _refuse_existing(_resume_outputs(out, jobs))
    return {**versions(), "jobs": {name: _resume(world, Path(checkpoint), layout, Path(out) / name)
                                   for name, (checkpoint, layout) in jobs.items()}}


def _save_outputs(out: str | os.PathLike) -> list[Path]:
    from harness.checkpoint.sharded import OPTIMIZER_FORMATS

    return [Path(out) / name for name in (*OPTIMIZER_FORMATS, SAVED, AFTER)]


def _resume_outputs(out: str | os.PathLike, jobs) -> list[Path]:
    return [Path(out) / name for name in jobs]


def _refuse_existing(paths: list[Path]) -> None:
    """Before anything runs: a command never writes over an earlier run's output."""
    from harness.checkpoint.errors import CheckpointError

    existing = [str(path) for path in paths if path.exists()]
    if existing:
        raise CheckpointError(f"{', '.join(existing)} exist(s); refusing to write over it (nothing was written)")


def _resume(world, checkpoint: Path, layout: str, out: Path) -> dict[str, Any]:
    import torch

    from harness.checkpoint.diff import diff_checkpoints
    from harness.checkpoint.errors import CheckpointError
    from harness.checkpoint.manifest import read_manifest
    from harness.checkpoint.resume_check import CONFIG, MODEL, train_batch
    from harness.training.handles import PolicyHandle

    manifest = read_manifest(checkpoint)
    policy = PolicyHandle(world, layout, MODEL, **{**CONFIG, "dtype": manifest.dtype})
    try:
        job = {"checkpoint": str(checkpoint), "layout": policy.layout.name, "written_by": manifest.megatron_core,
               "optimizer_format": manifest.optimizer_format}
        before = policy.hf_state_dict()
        try:
            loaded = policy.load(checkpoint)
        except CheckpointError as exc:
            # What a refusal must leave: the policy as it was (weights, data position), no output.
            after = policy.hf_state_dict()
            unchanged = (policy.position()["steps_done"] == 0 and before.keys() == after.keys()
                         and all(torch.equal(before[n], after[n]) for n in before))
            return {**job, "refused": " ".join(str(exc).split()), "state_unchanged": unchanged,
                    "wrote": out.exists()}
        out.mkdir(parents=True)
        policy.save(out / RESAVED, optimizer_format=manifest.optimizer_format)
        # Diffed here: the stack that loaded a checkpoint reads its format (0.16 cannot read 0.19's).
        resave_diff = diff_checkpoints(checkpoint, out / RESAVED).as_dict()
        _write_hf(policy.hf_state_dict(), out / LOADED)
        next_step = _stats(policy.step(train_batch(loaded["steps_done"])))
        _write_hf(policy.hf_state_dict(), out / AFTER)
        return {**job, "position": {k: loaded[k] for k in ("steps_done", "consumed_samples")},
                "rng_restored": loaded["rng_restored"], "next_step": next_step, "resaved": str(out / RESAVED),
                "resave_diff": resave_diff, "loaded": str(out / LOADED), "after": str(out / AFTER)}
    finally:
        policy.close()


# ------------------------------------------------------------------------ another stack's process
@dataclass
class Ran:
    """A command run on another stack: its exit status, its JSON line (None without one), stderr."""

    argv: list[str]
    returncode: int
    result: dict[str, Any] | None
    stderr: str

    def expect(self, returncode: int = 0) -> dict[str, Any]:
        """The JSON line of a run that exited `returncode`; anything else raises with its stderr."""
        if self.returncode != returncode or self.result is None:
            raise RuntimeError(f"{' '.join(self.argv)}: exit {self.returncode} (expected {returncode}), "
                               f"{'no' if self.result is None else 'a'} JSON line; stderr:\n{self.stderr[-6000:]}")
        return self.result


def harness_root() -> Path:
    """The directory holding this harness package (what another stack's PYTHONPATH needs)."""
    return Path(__file__).resolve().parents[2]


def run_on(python: str, *args: str, module: str = "harness.checkpoint.cross_stack",
           timeout: float = 600.0) -> Ran:
    """`python -m module *args` on another stack, with this harness first on its path. It picks its
    own bridge (the one usable there): this process's MRH_BRIDGE is not passed on."""
    env = {k: v for k, v in os.environ.items() if k != "MRH_BRIDGE"}
    env["PYTHONPATH"] = os.pathsep.join([str(harness_root()), *filter(None, [os.environ.get("PYTHONPATH")])])
    argv = [python, "-m", module, *map(str, args)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    return Ran(argv, done.returncode, _json(done.stdout), done.stderr)


def _json(stdout: str) -> dict[str, Any] | None:
    """The JSON object a command printed: its whole stdout (`mrh ckpt diff --json` indents), else
    its last line that is one."""
    for text in [stdout, *reversed(stdout.splitlines())]:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


# ------------------------------------------------------------------------ command line
def _job(text: str) -> tuple[str, tuple[str, str]]:
    name, sep, rest = text.partition("=")
    checkpoint, at, layout = rest.rpartition("@")
    if not (sep and at and name and checkpoint and layout) or "/" in name:
        raise argparse.ArgumentTypeError(f"{text!r}: a job is NAME=CHECKPOINT@LAYOUT")
    return name, (checkpoint, layout)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness.checkpoint.cross_stack",
                                     description="cross-stack checkpoint and export checks (module docstring)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("versions", help="this stack's megatron-core, bridge, torch and Python")
    save_ = commands.add_parser("save", help="train, save in every optimizer format, export, step on, export")
    save_.add_argument("out", help="output directory (its checkpoints must not exist)")
    save_.add_argument("--layout", default="tp2", help="default tp2")
    save_.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    resume_ = commands.add_parser("resume", help="per job: load, re-save, export, step on, export")
    resume_.add_argument("out", help="output directory: one subdirectory per job")
    resume_.add_argument("jobs", nargs="+", type=_job, metavar="NAME=CHECKPOINT@LAYOUT")
    return parser


def main(argv: list[str] | None = None) -> int:
    from harness.backends import cpu_arithmetic

    cpu_arithmetic.pin()  # before any torch kernel runs here or in a rank (as `mrh` does)
    args = _parser().parse_args(argv)
    if args.command == "versions":
        print(json.dumps(versions()))
        return 0
    from harness.checkpoint.errors import CheckpointError
    from harness.launch.rank import hide_gpus
    from harness.launch.world import World

    started = time.perf_counter()
    hide_gpus()  # a CPU world (forked ranks must never start CUDA)
    jobs = dict(getattr(args, "jobs", []))
    try:
        _refuse_existing(_save_outputs(args.out) if args.command == "save" else _resume_outputs(args.out, jobs))
        with World(WORLD_SIZE, "cpu", echo_output=False, start_method="fork") as world:  # ranks start here
            if args.command == "save":
                result = save(world, args.out, layout=args.layout, dtype=args.dtype)
            else:
                result = resume(world, args.out, jobs)
    except CheckpointError as exc:
        print(f"cross_stack {args.command}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(json.dumps({**result, "wall_s": round(time.perf_counter() - started, 2)}))
    refused = [f"{name}: {job['refused']}" for name, job in result.get("jobs", {}).items() if "refused" in job]
    for message in refused:
        print(f"cross_stack resume: {message}", file=sys.stderr)
    return 2 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
