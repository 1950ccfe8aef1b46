"""The rank side of the persistent world: one process per rank, serving calls until told to stop.

A rank process starts once per world (per world size and device), joins the default process group
through the parent's TCPStore, then loops: receive a pickled call on its pipe, run it, send back the
result or the exception with its formatted traceback, plus whatever the call printed.
"""
from __future__ import annotations

import faulthandler
import io
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection

from harness.report import buffer as report_buffer

STACK_SIGNAL = signal.SIGUSR1
# Variables every CUDA rank must see: NVLink multicast can take a shared host's GPUs out of service.
CUDA_SAFETY_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
# Transformer Engine then picks deterministic kernels only (e.g. its fused attention backward): the
# harness's same-layout resumes and seeded runs are bit for bit on the te spec too.
CUDA_DETERMINISM_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to join its world (pickled into the spawned process)."""

    rank: int
    world_size: int
    device: str  # "cpu" or "cuda"
    store_host: str
    store_port: int
    workdir: str
    parent_pid: int | None  # the process whose end ends this rank; None: whoever is the parent at start
    pg_timeout_s: float
    env: dict[str, str] = field(default_factory=dict)

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, f"rank{self.rank}.log")

    @property
    def stack_path(self) -> str:
        return os.path.join(self.workdir, f"rank{self.rank}.stack")


@dataclass(frozen=True)
class RankContext:
    """What a function running on a rank may ask about where it runs (`harness.launch.context()`)."""

    rank: int
    world_size: int
    device_type: str
    workdir: str

    @property
    def device(self):
        import torch

        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


_context: RankContext | None = None


def bind_context(ctx: RankContext) -> None:
    """Make `context()` work in a process started by another launcher (e.g. torchrun)."""
    global _context
    _context = ctx


def context() -> RankContext:
    """The calling rank's context; raises outside a rank process."""
    if _context is None:
        raise RuntimeError("harness.launch.context() is only available inside a rank process")
    return _context


def _watch_parent(parent_pid: int) -> None:
    """Kill this rank's process group (itself and what it started) when the parent disappears,
    so a killed pytest leaves no orphans even while the rank is busy in a call."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os.killpg(0, signal.SIGKILL)


def _redirect_output(log_path: str) -> io.TextIOWrapper:
    """Send fd 1 and 2 to the rank's log; the parent forwards each call's share of it."""
    log = open(log_path, "a+b", buffering=0)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
    return log


def _read_from(path: str, offset: int) -> str:
    """Text of `path` from byte `offset` on ("" if unreadable)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def all_stacks() -> str:
    """Every thread's Python stack, formatted (the Ray launcher's answer to a stack request)."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
                     for ident, frame in frames.items())


def _init_process_group(spec: RankSpec) -> None:
    import torch
    import torch.distributed as dist

    timeout = timedelta(seconds=spec.pg_timeout_s)
    store = dist.TCPStore(
        spec.store_host, spec.store_port, spec.world_size, is_master=False, timeout=timeout
    )
    if spec.device == "cuda":
        from harness.backends import cuda_precision

        cuda_precision.pin()  # torch's own switches, now that torch is imported
        torch.cuda.set_device(spec.rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"  # gloo too: Megatron makes gloo groups for CPU tensors
    else:
        from harness.backends import cpu_arithmetic, cpu_patches
        from harness.compat.torch import share_gloo_device

        cpu_arithmetic.pin()  # the parent's pin came in the environment: check that it took
        cpu_patches.install()
        share_gloo_device()  # one gloo loop thread, not one per group (harness.compat.torch)
        # Ranks share the machine's cores: more intra-op threads than cores/ranks only spin.
        torch.set_num_threads(max(1, _usable_cores() // spec.world_size))
        backend = "gloo"
    dist.init_process_group(
        backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout
    )


# Defaults for every rank: HF progress bars per model load would drown each call's output.
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def hide_gpus() -> None:
    """A CPU process on a GPU host sees no GPU. torch touches CUDA where one is visible even for CPU
    tensors (torch.optim.Adam's graph-capture check), and in a process forked from one that had
    started CUDA that call fails (cudaErrorInitializationError): hidden, CUDA never starts."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _setup_environment(spec: RankSpec) -> None:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.update(spec.env)
    if spec.device == "cuda":
        from harness.backends import cuda_precision

        for key, value in {**CUDA_SAFETY_ENV, **CUDA_DETERMINISM_ENV}.items():
            os.environ.setdefault(key, value)
        cuda_precision.pin()  # before CUDA starts here: cuBLAS reads its TF32 override once
    else:
        hide_gpus()
    os.environ.update(
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        MASTER_ADDR=spec.store_host,
        MASTER_PORT=str(spec.store_port),
    )


def _encode_error(exc: BaseException) -> tuple[bytes | None, str]:
    tb = "".join(traceback.format_exception(exc))
    try:
        payload = pickle.dumps(exc)
        pickle.loads(payload)  # some exceptions pickle but fail to unpickle
    except Exception:
        payload = None
    return payload, tb


def _release_memory() -> None:
    """After a failed call: free what its frames held (reference cycles included) and hand CUDA's cached
    blocks back to the device. A persistent rank otherwise keeps a failed call's tensors reserved, and
    every later world on the same GPU runs out of memory (4x H100, 2026-11-27: a 1-rank world kept the
    52 GB of a GLM-4.5-Air-shaped parity call that had failed, and the next 7 tests of the run failed
    with CUDA OOM)."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def execute(spec: RankSpec, message: tuple) -> tuple:
    """Run one call message `(call_id, sys_path, payload)`; the reply `(call_id, status, payload,
    traceback, output, report rows)` that the parent's world reads (either launcher)."""
    call_id, sys_path, payload = message
    for entry in sys_path:  # test modules imported after start must be importable here
        if entry not in sys.path:
            sys.path.append(entry)
    offset = os.path.getsize(spec.log_path)
    try:
        fn, args, kwargs = pickle.loads(payload)
        value = fn(*args, **kwargs)
        try:
            reply = (call_id, "ok", pickle.dumps(value), None)
        except Exception as exc:
            raise TypeError(
                f"the result of {getattr(fn, '__qualname__', fn)!r} on rank {spec.rank} "
                f"cannot be sent back to the parent: {exc}"
            ) from exc
    except BaseException as exc:  # noqa: BLE001 - even SystemExit goes back to the parent
        error_payload, tb = _encode_error(exc)
        reply = (call_id, "error", error_payload, tb)
        traceback.clear_frames(exc.__traceback__)
    if reply[1] == "error":
        _release_memory()
    sys.stdout.flush()
    sys.stderr.flush()
    return (*reply, _read_from(spec.log_path, offset), report_buffer.drain())


def _serve(spec: RankSpec, conn: Connection) -> None:
    while True:
        message = conn.recv()
        if message is None:  # orderly stop
            return
        conn.send(execute(spec, message))


def _usable_cores() -> int:
    """The cores this process may run on (a taskset or cpuset limits them), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def prepare(spec: RankSpec, *, stack_signal: bool = True) -> None:
    """Everything before joining the process group: output to the rank's log, faulthandler (and the
    stack-dump signal, which only a main thread can register), the environment."""
    os.makedirs(spec.workdir, exist_ok=True)
    log = _redirect_output(spec.log_path)
    faulthandler.enable(file=log, all_threads=True)
    if stack_signal:
        stack_file = open(spec.stack_path, "ab", buffering=0)
        faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True, chain=False)
    _setup_environment(spec)


def join(spec: RankSpec) -> None:
    """Join the world's default process group and make `context()` answer."""
    global _context
    _init_process_group(spec)
    _context = RankContext(spec.rank, spec.world_size, spec.device, spec.workdir)


def join_reply(spec: RankSpec) -> tuple:
    """`join`, answered as the reply to the world's "start" call (a failure goes back as one)."""
    try:
        join(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as a start failure
        return ("start", "error", *_encode_error(exc), "", [])
    return ("start", "ok", None, None, "", [])


def rank_main(spec: RankSpec, conn: Connection) -> None:
    """Entry point of a spawned rank process."""
    os.setpgrp()  # own process group: teardown kills the rank and anything it started
    # A forkserver's child watches the forkserver, which exits when the world's process does.
    watched = os.getppid() if spec.parent_pid is None else spec.parent_pid
    threading.Thread(target=_watch_parent, args=(watched,), daemon=True).start()
    prepare(spec)
    reply = join_reply(spec)
    conn.send(reply)
    if reply[1] != "ok":
        return
    try:
        _serve(spec, conn)
    except EOFError:  # the parent is gone: take down anything this rank started, then itself
        os.killpg(0, signal.SIGKILL)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
