"""`mrh bench ckpt`: what an async checkpoint save saves the trainer over a sync one.

Figures from one run of one model at one layout (all through harness.checkpoint.Checkpointer, so
every save includes the harness's own commit: manifest with checksums, fsyncs, rename, tracker):
  * sync_save_s       - median wall time of a sync `save()` (training stopped for all of it);
  * async_blocking_s  - median wall time of an async `save()`: until training can continue;
  * async_total_s     - median time from an async save's start until it is committed
                        (`SaveRecord.total_s`); one training step runs in between, as in a loop;
  * ratio             - sync_save_s / async_blocking_s;
  * step_s_alone      - median step time with no write in flight (the steps after sync saves);
  * step_s_during_write - median step time right after an async save returned (write in flight);
  * blocking_fraction_of_sync - async_blocking_s / sync_save_s (the issue's target: <= 5% for >= 1 GB);
  * blocking_breakdown_s - where the blocking went, rank 0: state_dict_s (the sharded state dict:
                        a fully_reshardable optimizer is gathered into model space), plan_s
                        (megatron-core's save(): validation, planning collectives, common.pt),
                        stage_s (the copy to host and the fork of the writer);
  * writer_cpu_s      - CPU time of the writer processes of an async save, all ranks.
One save of each kind is made first and not counted (first-use costs: imports, the persistent
caller's worker).

Callers (`--caller`): megatron-core's temporal caller (a writer forked per save: what the harness
uses, harness.checkpoint.async_save) and, on CUDA only, its persistent caller (one spawned worker
kept for every save). The persistent worker cannot run on CPU (it dies with ZeroDivisionError at
`rank % torch.cuda.device_count()` and the trainer then waits forever), so asking for it on CPU is
refused before anything starts. The persistent caller is set on the ranks from here, by giving each
rank's RankSaver an `AsyncCallsQueue(persistent=True)` before its first async save.

Why the harness keeps the temporal caller: reports/gpu/2026-11-23-h100-ckpt/bench (one H100, tp1):
warm, both block alike (tiny-qwen3-kv4: 0.46 s temporal, 0.50 s persistent), while the persistent
caller's first save blocked 13.5 s spawning its worker (temporal: 0.51 s) and it cannot run on CPU.
qwen3-0.6b-shape bf16 (8.35 GB): sync save 26.5 s, async blocking 11.6 s, async total 28.0 s.

One JSON line on stdout; progress on stderr. Exit 0 measured, 2 bad input (before any rank starts).
"""
from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

CALLERS = ("temporal", "persistent")
DTYPES = ("fp32", "bf16")


class BadInput(Exception):
    """What the command line asked for cannot be measured (exit 2, nothing started)."""


# ----------------------------------------------------------------------------- rank side
def _set_caller(worker, caller: str) -> str:
    """Give this rank's saver a queue of `caller`'s kind (made before its first async save).
    Temporal: drop the queue, RankSaver makes its own (temporal) one at the next async save."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    saver = worker.saver
    if saver.pending():
        raise RuntimeError("a save is still in flight on this rank; finalize it before changing the caller")
    if saver._queue is not None:
        saver._queue.close()  # nothing pending: a persistent worker is told to exit and joined
    saver._queue = AsyncCallsQueue(persistent=True) if caller == "persistent" else None
    return caller


def _caller_kind(worker) -> str | None:
    queue = worker.saver._queue
    return None if queue is None else ("persistent" if queue.persistent else "temporal")


# ----------------------------------------------------------------------------- parent side
def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def _samples(values: list[float]) -> list[float]:
    return [round(v, 4) for v in values]


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    import torch

    try:
        megatron = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        megatron = None
    return {"torch": torch.__version__, "megatron_core": megatron}


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_device() -> str:
    return "cuda" if _gpu_count() > 0 else "cpu"


def default_layout(device: str) -> str:
    return "dp2" if device == "cpu" or _gpu_count() >= 2 else "tp1"


def check_target(model: str, layout: str | None, device: str | None, dtype: str,
                 spec: str = "local") -> dict[str, Any]:
    """What every command that runs a policy checks before any rank starts (the benches, `mrh loop`):
    the device, the dtype, the model, the layout against the model and the backend (`spec`: the
    layer spec its world builds models with; context parallelism needs TE on CUDA, bf16), the GPUs
    it needs. Raises BadInput. The checks that need no import come first."""
    if device not in (None, "cpu", "cuda"):
        raise BadInput(f"unknown device {device!r}; choose cpu or cuda")
    if dtype not in DTYPES:
        raise BadInput(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    device = device or default_device()
    from harness.models import ModelNotFoundError, load_hf_config
    from harness.parallel.layout import LayoutError, check_backend, parse_layout, validate

    try:
        config = load_hf_config(model)
    except (ModelNotFoundError, OSError, ValueError) as exc:
        raise BadInput(" ".join(str(exc).split())) from None
    from harness.bridge.specs import SpecError, for_world

    try:
        spec = for_world(device, spec)
    except SpecError as exc:
        raise BadInput(str(exc)) from None
    text = layout or default_layout(device)
    config.name_or_path = config.name_or_path or model  # a zoo config has none: errors name the model
    try:
        parsed = parse_layout(text)
        validate(parsed, parsed.world_size, config)
        check_backend(parsed, device, spec, dtype)
    except LayoutError as exc:
        first, *rest = [line.strip(" -") for line in str(exc).splitlines() if line.strip()]
        raise BadInput(f"{first.rstrip(':')}: {'; '.join(rest)}" if rest else first) from None
    if device == "cuda":
        gpus = _gpu_count()
        if gpus < parsed.world_size:
            raise BadInput(f"layout {parsed.name} needs {parsed.world_size} GPUs, {gpus} visible")
    return {"model": model, "layout": parsed, "device": device, "dtype": dtype, "spec": spec, "vocab_size": int(config.vocab_size)}


def check_input(model: str, layout: str | None, device: str | None, dtype: str, saves: int,
                caller: str) -> dict[str, Any]:
    """Everything that can be wrong with a `mrh bench ckpt` request (`check_target`, the saves, the
    callers), before any rank starts: raises BadInput."""
    if not isinstance(saves, int) or saves < 1:
        raise BadInput(f"--saves must be an integer >= 1, got {saves!r}")
    callers = list(CALLERS) if caller == "both" else [caller]
    if any(c not in CALLERS for c in callers):
        raise BadInput(f"unknown caller {caller!r}; choose temporal, persistent or both")
    if (device or default_device()) == "cpu" and "persistent" in callers:
        raise BadInput("the persistent caller needs CUDA: on CPU its spawned worker dies with ZeroDivisionError "
                       "at `rank % torch.cuda.device_count()` and the trainer waits forever; use --caller "
                       "temporal on cpu, or --device cuda")
    return {**check_target(model, layout, device, dtype), "saves": saves, "callers": callers}


def _batch_maker(vocab_size: int, rows_multiple: int) -> Callable[[int], Any]:
    """The global batch of step `step`: resume_check.train_batch's rows (8), repeated until every
    data-parallel rank gets whole micro-batches; tokens within the model's (and the tiny) vocab."""
    from harness.models import TINY_VOCAB_SIZE
    from harness.training import make_rl_train_batch

    prompts, responses = [5, 3, 7, 1, 10, 2, 12, 4], [19, 9, 10, 23, 4, 13, 1, 16]
    rows = math.lcm(len(prompts), rows_multiple)
    repeat = rows // len(prompts)
    vocab = min(vocab_size, TINY_VOCAB_SIZE)

    def batch(step: int):
        return make_rl_train_batch(vocab, batch_size=rows, seed=100 + step, prompt_lengths=prompts * repeat,
                                   response_lengths=responses * repeat)

    return batch


class _Bench:
    """One policy in one world, its saves numbered from 1 across every Checkpointer."""

    def __init__(self, policy, root: Path, batch: Callable[[int], Any], log,
                 optimizer_format: str = "fully_reshardable") -> None:
        self.policy, self.root, self.batch, self.log = policy, root, batch, log
        self.optimizer_format = optimizer_format
        self.iteration = 0
        self.steps = 0

    def step(self) -> float:
        start = time.perf_counter()
        self.policy.step(self.batch(self.steps))
        self.steps += 1
        return time.perf_counter() - start

    def save(self, ckpt) -> tuple[int, float]:
        """A save as iteration n (the next number); returns (n, wall time of `save()`)."""
        self.iteration += 1
        start = time.perf_counter()
        ckpt.save(self.iteration)
        return self.iteration, time.perf_counter() - start

    @staticmethod
    def drop(ckpt, iteration: int) -> None:
        """Delete a committed checkpoint outside the timed part (rotation would time the deletion)."""
        ckpt.root.delete(iteration)

    def checkpointer(self, name: str, async_save: bool):
        from harness.checkpoint.checkpointer import Checkpointer

        # keep is never reached: each checkpoint is deleted by `drop`, untimed, once it is measured
        return Checkpointer(self.policy, self.root / name, keep=1_000_000, async_save=async_save,
                            optimizer_format=self.optimizer_format)

    def sync(self, saves: int) -> dict[str, Any]:
        ckpt = self.checkpointer("sync", async_save=False)
        iteration, warmup = self.save(ckpt)
        nbytes = _dir_bytes(ckpt.root.directory(iteration))
        self.log(f"  sync warm-up save (not counted): {warmup:.3f}s, {nbytes} bytes")
        self.drop(ckpt, iteration)
        times, steps = [], []
        for _ in range(saves):
            iteration, elapsed = self.save(ckpt)
            times.append(elapsed)
            self.drop(ckpt, iteration)
            steps.append(self.step())  # no write in flight: the step alone
            self.log(f"  sync save {iteration}: {elapsed:.3f}s; step alone {steps[-1]:.3f}s")
        ckpt.close()
        return {"checkpoint_bytes": nbytes, "warmup_s": warmup, "save": times, "step_alone": steps}

    def async_(self, caller: str, saves: int) -> dict[str, Any]:
        kinds = self.policy.apply(_set_caller, caller)
        assert kinds == [caller] * len(kinds), kinds
        ckpt = self.checkpointer(f"async-{caller}", async_save=True)
        try:
            iteration, warmup = self.save(ckpt)
            ckpt.wait()
            self.log(f"  {caller} warm-up async save (not counted): blocking {warmup:.3f}s, "
                     f"total {ckpt.history[-1].total_s:.3f}s")
            self.drop(ckpt, iteration)
            used = set(self.policy.apply(_caller_kind))
            if used != {caller}:
                raise RuntimeError(f"the ranks saved with the {sorted(used)} caller, not {caller}")
            blocking, total, during, waits, stages, writer_cpu = [], [], [], [], [], []
            for _ in range(saves):
                iteration, elapsed = self.save(ckpt)
                blocking.append(elapsed)
                during.append(self.step())  # the write is in flight (unless it already finished)
                start = time.perf_counter()
                ckpt.wait()  # commit: the next save would wait this long
                waits.append(time.perf_counter() - start)
                record = ckpt.history[-1]
                assert record.iteration == iteration and record.async_save, record
                total.append(record.total_s)
                stages.append(record.stages)
                writer_cpu.append(record.writer_cpu_s)
                self.drop(ckpt, iteration)
                self.log(f"  {caller} async save {iteration}: blocking {elapsed:.3f}s, total {total[-1]:.3f}s; "
                         f"step during write {during[-1]:.3f}s, then waited {waits[-1]:.3f}s to commit")
            ckpt.close()
        finally:
            if ckpt.pending:
                ckpt.abort()
            self.policy.apply(_set_caller, "temporal")  # a persistent worker exits; the harness default again
        return {"warmup_blocking_s": warmup, "blocking": blocking, "total": total, "step_during_write": during,
                "wait_after_step": waits, "stages": stages, "writer_cpu": writer_cpu}


def run(model: str, layout: str | None = None, device: str | None = None, dtype: str = "fp32", saves: int = 3,
        caller: str = "temporal", directory: str | None = None, keep_dir: bool = False,
        log=print, optimizer_format: str = "fully_reshardable") -> dict[str, Any]:
    """Measure (module docstring); raises BadInput before anything starts."""
    from harness.checkpoint.resume_check import CONFIG
    from harness.launch import World
    from harness.training.handles import PolicyHandle

    from harness.checkpoint.sharded import OPTIMIZER_FORMATS

    if optimizer_format not in OPTIMIZER_FORMATS:
        raise BadInput(f"unknown optimizer format {optimizer_format!r}; choose from {', '.join(OPTIMIZER_FORMATS)}")
    request = check_input(model, layout, device, dtype, saves, caller)
    layout_, device = request["layout"], request["device"]
    world_size = layout_.world_size
    created = directory is None
    if not created:
        used = [name for name in ["sync", *(f"async-{c}" for c in request["callers"])]
                if (Path(directory) / name).exists() and any((Path(directory) / name).iterdir())]
        if used:
            raise BadInput(f"{directory} already holds {', '.join(used)} (an earlier run's checkpoints); "
                           "pass an empty or new --dir")
    root = Path(tempfile.mkdtemp(prefix="mrh-bench-ckpt-")) if created else Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    log(f"bench ckpt: {model} {layout_.name} on {world_size} {device} ranks, {dtype}, {saves} saves, "
        f"caller(s) {', '.join(request['callers'])}, checkpoints under {root}")
    config = {**CONFIG, "dtype": dtype}
    batch = _batch_maker(request["vocab_size"], layout_.dp * config["micro_batches"])
    try:
        start = time.perf_counter()
        world = World(world_size, device, echo_output=False, timeout=1800.0).start()
        log(f"  world start: {time.perf_counter() - start:.2f}s")
        try:
            policy = PolicyHandle(world, layout_, model, **config)
            try:
                bench = _Bench(policy, root, batch, log, optimizer_format)
                log(f"  warm-up step (not counted): {bench.step():.3f}s")
                sync = bench.sync(saves)
                measured = {c: bench.async_(c, saves) for c in request["callers"]}
            finally:
                policy.close()
        finally:
            world.close()
    finally:
        if keep_dir:
            log(f"  checkpoints kept under {root}")
        elif created:
            shutil.rmtree(root, ignore_errors=True)
        else:
            for name in ["sync", *(f"async-{c}" for c in request["callers"])]:
                shutil.rmtree(root / name, ignore_errors=True)

    sync_s, step_alone = _median(sync["save"]), _median(sync["step_alone"])
    callers = {}
    for name, m in measured.items():
        blocking = _median(m["blocking"])
        callers[name] = {
            "async_blocking_s": blocking, "async_total_s": _median(m["total"]),
            "ratio": round(sync_s / blocking, 2) if blocking > 0 else None,
            "step_s_during_write": _median(m["step_during_write"]),
            "async_wait_after_step_s": _median(m["wait_after_step"]),
            "warmup_blocking_s": round(m["warmup_blocking_s"], 4),
            "async_blocking_samples_s": _samples(m["blocking"]), "async_total_samples_s": _samples(m["total"]),
            "step_during_write_samples_s": _samples(m["step_during_write"]),
            # where the blocking time went (rank 0, medians): building the sharded state dict,
            # megatron-core's save() (planning), staging (copy to host, fork of the writer)
            "blocking_breakdown_s": {k: _median([s[k] for s in m["stages"]]) for k in m["stages"][0]},
            "blocking_fraction_of_sync": round(blocking / sync_s, 4) if sync_s > 0 else None,
            # CPU time of the writer processes while training went on (all ranks, median per save)
            "writer_cpu_s": _median(m["writer_cpu"]),
        }
    first = request["callers"][0]
    return {
        "model": model, "layout": layout_.name, "device": device, "world_size": world_size, "dtype": dtype,
        "optimizer_format": optimizer_format,
        "checkpoint_bytes": sync["checkpoint_bytes"], "saves": saves, "caller": first,
        "sync_save_s": sync_s,
        **{k: callers[first][k] for k in ("async_blocking_s", "async_total_s", "ratio", "step_s_during_write",
                                          "async_wait_after_step_s", "blocking_fraction_of_sync",
                                          "blocking_breakdown_s", "writer_cpu_s")},
        "step_s_alone": step_alone,
        "sync_samples_s": _samples(sync["save"]), "step_alone_samples_s": _samples(sync["step_alone"]),
        "callers": callers, "versions": _versions(),
    }


def main(args) -> int:
    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        result = run(args.model, args.layout, args.device, args.dtype, args.saves, args.caller,
                     directory=args.dir, keep_dir=args.keep_dir, log=log, optimizer_format=args.optimizer_format)
    except BadInput as exc:
        print(f"mrh bench ckpt: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0
