"""The CPU tier's arithmetic, pinned: the same inputs give the same bits on any x86-64 machine.

Why (issue 23, measured): the RL loop's fp32 grad norms differed by up to 1.3e-5 relative between
this project's CI machines, on the same code and library versions. The cause is ATen's CPU kernel
dispatch: torch picks its vectorized kernels by the CPU it runs on (AVX2 on one machine, AVX-512 on
an AMD EPYC with AVX-512), and reductions with 8 or 16 lanes add in different orders. The first
step's grad norm differed by 9e-8 relative; GRPO steps at lr 1e-2 grew that to 1e-5 within 8
iterations. With `ATEN_CPU_CAPABILITY=avx2` the AVX-512 machine reproduced the other machine's
baseline bit for bit; MKL's code path (`MKL_CBWR`) changed nothing on it, and one or two threads
per rank changed nothing for the tiny models. So the harness pins the kernels (`ISAS["avx2"]`):
ATen's dispatch, MKL's conditional numerical reproducibility branch and oneDNN's ISA, every one to
AVX2, which every x86-64 CPU of the last decade has. MKL and oneDNN are pinned as well because on
an Intel CPU with AVX-512 their GEMMs would take AVX-512 paths: not measured here (no Intel CPU),
set for the same reason as ATen's.

`native` leaves the machine's own choice (faster on AVX-512, results then hold on that machine
only). The choice is explicit: `--mrh-cpu-isa` (pytest), `$MRH_CPU_ISA` (everything else), default
avx2; it travels to every rank (`env()`), and the report's fingerprint records it with what torch
actually dispatches to. It must be set before the process runs its first torch kernel (torch
chooses its kernels once, lazily): `pin()` checks that it took.
"""
from __future__ import annotations

import os

ENV = "MRH_CPU_ISA"
DEFAULT = "avx2"
ISAS: dict[str, dict[str, str]] = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "native": {},
}
_TORCH_NAME = {"avx2": "AVX2"}  # torch.backends.cpu.get_cpu_capability() under each pin


class ArithmeticPinError(RuntimeError):
    """The pin could not take effect (torch chose its kernels before it was set)."""


def chosen(isa: str | None = None) -> str:
    """The pin asked for: `isa`, else $MRH_CPU_ISA, else the default; ValueError when unknown."""
    isa = isa or os.environ.get(ENV) or DEFAULT
    if isa not in ISAS:
        raise ValueError(f"unknown CPU ISA pin {isa!r}; choose from {', '.join(ISAS)} ({ENV})")
    return isa


def env(isa: str | None = None) -> dict[str, str]:
    """The variables a process (a rank) needs for the pin: the library knobs and $MRH_CPU_ISA."""
    isa = chosen(isa)
    return {ENV: isa, **ISAS[isa]}


def pin(isa: str | None = None) -> str:
    """Pin this process (and the processes it starts, which inherit the environment); returns the
    pin. Raises ArithmeticPinError when torch already chose other kernels in this process."""
    isa = chosen(isa)
    os.environ.update(env(isa))
    if isa == "native":
        for name in {k for table in ISAS.values() for k in table}:
            os.environ.pop(name, None)  # inherited from a pinned parent: native means none
    want = _TORCH_NAME.get(isa)
    got = dispatched()
    if want is not None and got is not None and got != want:
        raise ArithmeticPinError(
            f"torch already runs {got} kernels in this process; the {isa} pin ({ENV}) must be set before "
            "the first torch operation (set it in the environment, or call pin() before using torch)")
    return isa


def dispatched() -> str | None:
    """The kernel set torch dispatches to in this process ("AVX2", "AVX512", ...), None without
    torch imported (asking fixes torch's choice: call it after the pin)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return None
    return torch.backends.cpu.get_cpu_capability()
