"""Cross-stack checks: one stack's policy checkpoints and HF exports, as the other stack sees them.

(draft)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def _versions() -> dict[str, Any]:
    from importlib.metadata import version

    import torch

    from harness.bridge import backends

    return {"megatron_core": version("megatron-core"), "torch": torch.__version__, "bridge": backends.current(),
            "python": sys.version.split()[0]}


def _world(layout):
    from harness.launch.rank import hide_gpus
    from harness.launch.world import World

    hide_gpus()
    return World(layout.world_size, "cpu", echo_output=False, start_method="fork").start()


def _save_export(state, path: str | None) -> None:
    if path:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, path)


def _stats(step: dict[str, Any]) -> dict[str, Any]:
    return {k: step[k] for k in ("loss", "grad_norm", "lr")}


def cmd_save(args) -> dict[str, Any]:
    from harness.checkpoint.resume_check import CONFIG, K_STEPS, MODEL, train_batch
    from harness.parallel.state import as_layout
    from harness.training.handles import PolicyHandle

    layout = as_layout(args.layout)
    config = {**CONFIG, "dtype": args.dtype}
    out: dict[str, Any] = {}
    with _world(layout) as world:
        policy = PolicyHandle(world, layout, MODEL, **config)
        out["steps"] = [_stats(s) for s in policy.steps([train_batch(i) for i in range(K_STEPS)])]
        manifest = policy.save(args.dir, optimizer_format=args.optimizer_format)
        out["megatron_core_saved"] = manifest.megatron_core
        _save_export(policy.hf_state_dict(), args.export)
        if args.after:
            out["next_step"] = _stats(policy.step(train_batch(K_STEPS)))
            _save_export(policy.hf_state_dict(), args.after)
        policy.close()
    return out


def cmd_resume(args) -> dict[str, Any]:
    from harness.checkpoint.manifest import read_manifest
    from harness.checkpoint.resume_check import CONFIG, K_STEPS, MODEL, train_batch
    from harness.parallel.state import as_layout
    from harness.training.handles import PolicyHandle

    layout = as_layout(args.layout)
    manifest = read_manifest(args.dir)
    config = {**CONFIG, "dtype": manifest.dtype}
    out: dict[str, Any] = {}
    with _world(layout) as world:
        policy = PolicyHandle(world, layout, MODEL, **config)
        info = policy.load(args.dir)
        out["load"] = {k: info[k] for k in ("steps_done", "consumed_samples", "rng_restored")}
        if args.resave:
            policy.save(args.resave, optimizer_format=manifest.optimizer_format)
        _save_export(policy.hf_state_dict(), args.export)
        if args.after:
            out["next_step"] = _stats(policy.step(train_batch(K_STEPS)))
            _save_export(policy.hf_state_dict(), args.after)
        policy.close()
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness.checkpoint.cross_stack")
    commands = parser.add_subparsers(dest="command", required=True)
    save = commands.add_parser("save")
    save.add_argument("dir")
    save.add_argument("--layout", default="tp2")
    save.add_argument("--dtype", default="fp32")
    save.add_argument("--optimizer-format", default="fully_reshardable")
    save.add_argument("--export")
    save.add_argument("--after")
    save.set_defaults(handler=cmd_save)
    resume = commands.add_parser("resume")
    resume.add_argument("dir")
    resume.add_argument("--layout", default="tp2")
    resume.add_argument("--resave")
    resume.add_argument("--export")
    resume.add_argument("--after")
    resume.set_defaults(handler=cmd_resume)
    return parser


def main(argv: list[str] | None = None) -> int:
    from harness.backends import cpu_arithmetic

    cpu_arithmetic.pin()
    args = _parser().parse_args(argv)
    from harness.checkpoint.errors import CheckpointError

    started = time.perf_counter()
    try:
        out = args.handler(args)
    except CheckpointError as exc:
        print(f"cross_stack {args.command}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(json.dumps({**_versions(), **out, "wall_s": round(time.perf_counter() - started, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
