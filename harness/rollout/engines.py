"""Which rollout engine a check or a loop runs: `open_engine("hf" | "vllm", model, dtype=..., device=...)`.

The HF engine is built fresh each time (it lives in this process). A vLLM engine is a process that
takes ~15 s to start, so one per (model, dtype, device) is kept for the life of this process and
handed out reset to its checkpoint's weights; it is stopped at exit.
"""
from __future__ import annotations

import atexit

import torch

ENGINES = ("hf", "vllm")
_VLLM: dict[tuple, object] = {}


def open_engine(kind: str, model: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    if kind == "hf":
        from harness.rollout.hf_engine import HFEngine

        return HFEngine(model, dtype=dtype, device=device)
    if kind == "vllm":
        return _shared_vllm(model, dtype, device)
    raise ValueError(f"engine must be one of {ENGINES}, got {kind!r}")


def _shared_vllm(model: str, dtype: torch.dtype, device: str):
    from harness.rollout.vllm_engine import VLLMEngine

    key = (str(model), dtype, str(device))
    engine = _VLLM.get(key)
    if engine is not None and engine.alive:
        if engine.asleep:
            engine.wake()
        engine.hold_fused_groups = True
        engine.reset()
        return engine
    engine = VLLMEngine(model, dtype=dtype, device=device)
    _VLLM[key] = engine
    return engine


@atexit.register
def close_all() -> None:
    """Stop every shared vLLM engine (also called by the pytest plugin at session end)."""
    while _VLLM:
        _VLLM.popitem()[1].close()
