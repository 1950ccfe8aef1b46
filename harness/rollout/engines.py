"""Which rollout engine a check or a loop runs: `open_engine("hf" | "vllm", model, dtype=..., device=...)`.

The HF engine is built fresh each time (it lives in this process). A vLLM engine is a process that
takes ~15 s to start, so one per (model, dtype, device, options) is kept for the life of this process
and handed out reset to its checkpoint's weights; it is stopped at exit. `options` reach the vLLM
engine (`precision`, `transport`, `engine_args`, `env`: harness.rollout.vllm_engine). `routing=True`
opens an engine whose `generate(..., routing=True)` gives the routes (R3): the HF engine records them on
demand, a vLLM engine is started so (its own process: one per option set).
"""
from __future__ import annotations

import atexit

import torch

ENGINES = ("hf", "vllm")
_VLLM: dict[tuple, object] = {}


def open_engine(kind: str, model: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                routing: bool = False, **options):
    if kind == "vllm" and routing:
        options["routing"] = True
    if kind == "hf":
        if options:
            raise ValueError(f"the HF engine takes no options, got {sorted(options)}")
        from harness.rollout.hf_engine import HFEngine

        return HFEngine(model, dtype=dtype, device=device)
    if kind == "vllm":
        return _shared_vllm(model, dtype, device, options)
    raise ValueError(f"engine must be one of {ENGINES}, got {kind!r}")


def _shared_vllm(model: str, dtype: torch.dtype, device: str, options: dict):
    from harness.rollout.vllm_engine import VLLMEngine

    key = (str(model), dtype, str(device), repr(sorted(options.items())))
    engine = _VLLM.get(key)
    if engine is not None and engine.alive:
        if engine.asleep:
            engine.wake()
        engine.hold_fused_groups = True
        engine.reset_cache_on_load = True
        engine.reset()
        return engine
    engine = VLLMEngine(model, dtype=dtype, device=device, **options)
    _VLLM[key] = engine
    return engine


@atexit.register
def close_all() -> None:
    """Stop every shared vLLM engine (also called by the pytest plugin at session end)."""
    while _VLLM:
        _VLLM.popitem()[1].close()
