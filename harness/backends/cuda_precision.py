"""fp32 means fp32 on CUDA: TF32 off in every process of a run, on both layer specs, and recorded.

Why (issue 24, measured on 1x H100, TE 2.20.2, megatron-core 0.16.1): with Transformer Engine the
fp32 parity cases failed, max |d| 2.7e-3 to 6.6e-3 against the fp32 bound 1e-5, and passed (5/5
rows) with `NVIDIA_TF32_OVERRIDE=0`. TE runs every pure-fp32 GEMM with
`CUBLAS_COMPUTE_32F_FAST_TF32` (transformer_engine/common/gemm/cublaslt_gemm.cu), whatever torch's
`allow_tf32` says; only cuBLAS's own override turns that off, and cuBLAS reads it when it starts. So
the policy is set in the environment of the run's first process, before CUDA starts there or in a
rank (ranks inherit it, and re-apply it), plus torch's own switches for the local spec's GEMMs and
cuDNN. `MRH_TF32=1` turns TF32 on instead: the `tf32-in-fp32` catalog control, which runs in a
world of its own (the override cannot be taken back once cuBLAS started). bf16 GEMMs do not use TF32.
"""
from __future__ import annotations

import os
import sys

ENV = "MRH_TF32"  # "0" (the default): fp32 GEMMs in full fp32; "1": TF32 allowed (a control)
OVERRIDE = "NVIDIA_TF32_OVERRIDE"


def tf32_requested() -> bool:
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def pin() -> bool:
    """Apply the policy to this process (environment first, then torch's switches if torch is
    imported); returns whether TF32 is on. Call before CUDA starts in this process."""
    tf32 = tf32_requested()
    if tf32:
        os.environ.pop(OVERRIDE, None)
    else:
        os.environ[OVERRIDE] = "0"
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return tf32


def state() -> dict:
    """What this process computes fp32 GEMMs with (for reports)."""
    torch = sys.modules.get("torch")
    facts = {"tf32": tf32_requested(), OVERRIDE: os.environ.get(OVERRIDE)}
    if torch is not None:
        facts.update(matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                     cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                     float32_matmul_precision=torch.get_float32_matmul_precision())
    return facts
