"""What a world's ranks compute with, as reports record it: the layer spec and, on CUDA, the GPU,
the fp32 precision policy (TF32), Transformer Engine's version and attention-backend switches, the
CPU kernels. Asked once per world start (`WorldBase.start`), from rank 0."""
from __future__ import annotations

import os
from typing import Any

TE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_ALLOW_NONDETERMINISTIC_ALGO")


def rank_facts() -> dict[str, Any]:
    import torch

    from harness.backends import cpu_arithmetic, cuda_precision
    from harness.bridge import specs

    facts: dict[str, Any] = {"spec": specs.current(), "torch": torch.__version__,
                             "cpu_kernels": cpu_arithmetic.dispatched()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        facts.update(gpu=torch.cuda.get_device_name(), cudnn=torch.backends.cudnn.version(),
                     **cuda_precision.state())
    if facts["spec"] == "te":
        import transformer_engine

        facts["transformer_engine"] = getattr(transformer_engine, "__version__", None)
        facts["te_attention_env"] = {k: os.environ.get(k) for k in TE_ATTENTION_ENV}
    return facts
