"""What a run ran on: package versions, CUDA, GPUs, commit, host.

A report row means little without the stack that produced it (a parity number on megatron-core
0.16 says nothing about 0.17), so every run stores this fingerprint next to its rows.

Fast (well under a second) and never raises: it is called at the start of every pytest session,
and a broken `git` or `nvidia-smi` must not cost the run. Anything that cannot be found is None,
except the commit: a working tree shipped without `.git` (the GPU machines get one) takes it from
$MRH_GIT_COMMIT (and $MRH_GIT_DIRTY), and says "unknown" when neither git nor the variable has it.
It deliberately does not `import torch` (that alone takes > 1 s) and never creates a CUDA context
(that would pin GPU memory in the pytest parent, which only coordinates the rank processes).
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from importlib import metadata, util
from typing import Any

# Distribution names as pip knows them; the fingerprint key is the first name.
PACKAGES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "megatron-core": ("megatron-core",),
    "mbridge": ("mbridge",),
    "megatron-bridge": ("megatron-bridge",),
    # TE ships under several distribution names depending on the CUDA major version.
    "transformer-engine": ("transformer-engine", "transformer-engine-cu12", "transformer-engine-cu13"),
    "transformers": ("transformers",),
}
_TIMEOUT_S = 3.0
# CPU features that change floating-point results (which vectorized and GEMM kernels run), as
# /proc/cpuinfo names them; the fingerprint records the ones the machine has.
ARITHMETIC_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                    "amx_tile", "amx_bf16", "amx_int8")
# The fields whose difference may move a figure (compare.py prints them when two runs differ).
ARITHMETIC_KEYS = ("cpu_model", "cpu_flags", "cpu_isa", "cpu_kernels", "cpu_count", "torch_threads", "python",
                   "torch", "megatron-core", "mbridge", "megatron-bridge", "transformer-engine", "transformers", "cuda",
                   "gpu_model")


def environment_fingerprint(device: str | None = None) -> dict[str, Any]:
    """The environment of this process as a flat JSON-able dict (see module docstring).

    Keys: python, torch, megatron-core, mbridge, transformer-engine, transformers, cuda (the CUDA
    runtime torch was built with), driver, gpus (model of every GPU nvidia-smi sees), gpu_model,
    gpu_count (GPUs this process may use), cuda_visible_devices, device, git_commit, git_dirty,
    host, platform (git_commit and git_dirty: see git_revision); and what the CPU arithmetic
    depends on: cpu_model, cpu_flags (the ARITHMETIC_FLAGS the CPU has), cpu_count, cpu_isa (the
    harness's kernel pin, harness.backends.cpu_arithmetic), cpu_kernels (the kernels torch
    dispatches to in this process, None before torch is imported) and torch_threads.
    """
    fingerprint: dict[str, Any] = {"python": platform.python_version()}
    for key, names in PACKAGES.items():
        fingerprint[key] = _safe(lambda names=names: _version(names))
    gpus, driver = _safe(_nvidia_smi) or ([], None)
    fingerprint.update(
        cuda=_safe(_torch_cuda_version),
        driver=driver,
        gpus=gpus,
        gpu_model=gpus[0] if gpus else None,
        gpu_count=_safe(lambda: _gpu_count(len(gpus))) or 0,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        device=device,
        **git_revision(),
        host=_safe(socket.gethostname),
        platform=_safe(platform.platform),
        **_cpu(),
    )
    return fingerprint


def _cpu() -> dict[str, Any]:
    from harness.backends import cpu_arithmetic

    model, flags = _safe(_cpuinfo) or (None, None)
    torch = sys.modules.get("torch")
    return {"cpu_model": model, "cpu_flags": flags, "cpu_count": os.cpu_count(),
            "cpu_isa": _safe(cpu_arithmetic.chosen),
            "cpu_kernels": _safe(cpu_arithmetic.dispatched),
            "torch_threads": _safe(torch.get_num_threads) if torch is not None else None}


def cpuinfo_field(key: str) -> str | None:
    """The first value of `key` in /proc/cpuinfo (e.g. "model name", "vendor_id"); None where absent."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def _cpuinfo() -> tuple[str | None, list[str]]:
    """(model name, the ARITHMETIC_FLAGS present) from /proc/cpuinfo (Linux)."""
    model, flags = None, set()
    with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
            if model and flags:
                break
    return model, [flag for flag in ARITHMETIC_FLAGS if flag in flags]


def _safe(fn):
    """Call fn; any failure becomes None, because a fingerprint field must never fail a run."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - by design: missing information is None, not an error
        return None


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _run(command: list[str]) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    done = subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT_S,
                          cwd=os.getcwd(), check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def _nvidia_smi() -> tuple[list[str], str | None]:
    """(GPU model per GPU, driver version); nvidia-smi reads NVML and creates no CUDA context."""
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if not out:
        return [], None
    pairs = [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.strip()]
    return [p[0] for p in pairs], (pairs[0][1] if pairs and len(pairs[0]) > 1 else None)


def _torch_cuda_version() -> str | None:
    """torch.version.cuda, read from torch/version.py when torch is not imported yet (cheap)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return getattr(torch.version, "cuda", None)
    spec = util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    with open(path, encoding="utf-8") as f:
        match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", f.read(), re.MULTILINE)
    return match.group(1) if match else None


def _gpu_count(seen_by_smi: int) -> int:
    """GPUs this process may use: torch's count when torch is loaded (honours CUDA_VISIBLE_DEVICES;
    device_count does not create a context), else what nvidia-smi sees."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and seen_by_smi:
        return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
    return seen_by_smi


GIT_COMMIT_ENV = "MRH_GIT_COMMIT"
GIT_DIRTY_ENV = "MRH_GIT_DIRTY"
UNKNOWN_COMMIT = "unknown"
_TRUE, _FALSE = ("1", "true", "yes"), ("0", "false", "no")


def git_revision() -> dict[str, Any]:
    """{"git_commit": ..., "git_dirty": ...} of the code this process runs.

    From $MRH_GIT_COMMIT and the optional $MRH_GIT_DIRTY (1/0; unset: None) when the caller set
    them: the caller knows which commit it sent (ci/git_env.sh prints them where git is), while a
    copied tree may carry a stale .git (the lent GPU machines' copies report the session's first
    commit, dirty). Otherwise from git when the working tree has it (dirty: tracked files differ
    from HEAD). Neither: git_commit "unknown", git_dirty None. Never raises.
    """
    commit = os.environ.get(GIT_COMMIT_ENV, "").strip()
    if not commit:
        commit = _safe(lambda: _run(["git", "rev-parse", "HEAD"]))
        if not commit:
            return {"git_commit": UNKNOWN_COMMIT, "git_dirty": None}
        # --no-optional-locks: never take the index lock a concurrent `git commit` may need.
        status = _safe(lambda: _run(["git", "--no-optional-locks", "status", "--porcelain",
                                     "--untracked-files=no"]))
        return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}
    dirty = os.environ.get(GIT_DIRTY_ENV, "").strip().lower()
    return {"git_commit": commit, "git_dirty": True if dirty in _TRUE else False if dirty in _FALSE else None}
