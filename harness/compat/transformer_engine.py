"""Transformer Engine workarounds (rank-side), each gated on the TE versions it was verified on.

- `CUBLAS_WORKSPACE`: TE keeps its cuBLAS workspaces (32 MiB + 1 KiB each on Hopper, one per
  device, one per stream for grouped GEMMs) in `functools.lru_cache`d getters of
  `transformer_engine.pytorch.cpp_extensions.gemm` for the life of the process. An offloaded
  policy then still holds them: the device memory a colocated rollout engine is promised is short
  by that much (verl #6952 is the FP8 case of the same class: TE's buffers not freed on offload).
  Clearing the caches drops the tensors; TE allocates them again at its next GEMM.

On another TE version `require` raises before anything changes (harness.compat.megatron_core says
why a gate and not a warning).
"""
from __future__ import annotations

import sys

from harness.compat import refuse_unverified
from harness.compat.megatron_core import Workaround

CUBLAS_WORKSPACE = Workaround(
    "te-cublas-workspace", "TE's cuBLAS workspaces live in lru_cached getters for the life of the "
    "process (transformer_engine.pytorch.cpp_extensions.gemm)", ("2.20.2",))


class UnverifiedTransformerEngineError(RuntimeError):
    """A workaround was asked for on a Transformer Engine version it was not verified on."""


def version() -> str | None:
    """The loaded Transformer Engine's version (None when it is not imported)."""
    te = sys.modules.get("transformer_engine")
    return getattr(te, "__version__", None) if te is not None else None


def require(workaround: Workaround) -> None:
    refuse_unverified(UnverifiedTransformerEngineError, "Transformer Engine", version(), workaround.name,
                      workaround.verified_on, "suites/offload on the te spec")


_GETTERS = ("get_cublas_workspace", "_get_grouped_cublas_workspace")


def workspaces_held() -> int:
    """How many cuBLAS workspaces TE holds in its caches right now (0 when TE's GEMM module is not loaded)."""
    gemm = sys.modules.get("transformer_engine.pytorch.cpp_extensions.gemm")
    if gemm is None:
        return 0
    return sum(getattr(gemm, g).cache_info().currsize for g in _GETTERS if hasattr(getattr(gemm, g, None), "cache_info"))


def release_workspaces() -> bool:
    """Drop TE's cached cuBLAS workspaces (no-op when TE's GEMM module is not loaded); True if it did."""
    gemm = sys.modules.get("transformer_engine.pytorch.cpp_extensions.gemm")
    if gemm is None:
        return False
    require(CUBLAS_WORKSPACE)
    for getter in _GETTERS:
        cached = getattr(gemm, getter, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
    return True
