"""vLLM workarounds, applied inside the vLLM engine's process (harness/rollout/vllm_server.py), each
gated on the vLLM versions it was verified on.

- `CPU_MOE_RELOAD_REPACK` (found by this harness): on CPU, a MoE layer's kernel computes with expert
  weights prepacked into its grouped-GEMM layout (`CPUUnquantizedExperts.process_weights_after_loading`
  in vllm/model_executor/layers/fused_moe/experts/cpu_moe.py: `cpu_prepack_moe_weight` of `w13_weight`
  and `w2_weight`). `UnquantizedFusedMoEMethod._setup_kernel` (fused_moe/unquantized_fused_moe_method.py)
  runs that prepack only when `self.moe_kernel is None`, i.e. on the first load: an in-place
  `reload_weights` (model_loader/reload/layerwise.py: the layer is rebuilt in checkpoint layout, loaded,
  processed, then copied into the original kernel tensors) copies the weights UNPACKED into the
  packed storage, and the kernel reads them as packed: reloading a Qwen3-MoE's own weights moved its
  logprobs 4.1 off HF (tiny-qwen3-moe-hd32, fp32; suites/moe/test_vllm.py's guard test measures it
  each run). The workaround runs the experts' prepack again on a weight update, so the layerwise
  reload copies packed weights into the packed storage.

The gate, as in harness.compat.megatron_core: `install` raises `UnverifiedVLLMError` on a vLLM
version a workaround was not verified on, before anything changes (the engine does not start; a
model that needs none of them starts on any version). Re-verify with suites/moe/test_vllm.py
(`test_the_cpu_moe_reload_workaround_is_still_needed` shows whether the bug is still there), then add
the version to `verified_on`.

This module runs under the vLLM environment's Python, which has no harness dependencies: it imports
only the standard library at import time, and vllm inside `install`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.compat import refuse_unverified


class UnverifiedVLLMError(RuntimeError):
    """A workaround was asked for on a vLLM version it was not verified on."""


@dataclass(frozen=True)
class Workaround:
    name: str
    bug: str  # the upstream behaviour it works around, in one line
    verified_on: tuple[str, ...]  # vllm.__version__ values


CPU_MOE_RELOAD_REPACK = Workaround(
    "cpu-moe-reload-repack", "UnquantizedFusedMoEMethod._setup_kernel prepacks the CPU MoE kernel's "
    "expert weights only on the first load: an in-place reload_weights leaves them unpacked in the "
    "packed storage", ("0.32.0",))
WORKAROUNDS = (CPU_MOE_RELOAD_REPACK,)

# Which installed workarounds act: the guard test turns one off to show the bug is still there.
_ENABLED: dict[str, bool] = {}


def version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def require(workaround: Workaround) -> None:
    refuse_unverified(UnverifiedVLLMError, "vLLM", version(), workaround.name, workaround.verified_on,
                      "suites/moe/test_vllm.py")


def needed(hf_config: dict[str, Any], device: str) -> list[Workaround]:
    """The workarounds a model (its config.json, as a dict) needs on `device`."""
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0
    return [CPU_MOE_RELOAD_REPACK] if device == "cpu" and experts > 0 else []


def install(hf_config: dict[str, Any], device: str) -> list[str]:
    """Apply the workarounds the model needs (each once per process); returns their names."""
    chosen = needed(hf_config, device)
    for workaround in chosen:  # every gate first: nothing changes on an unverified version
        require(workaround)
    for workaround in chosen:
        if workaround.name not in _ENABLED:
            _PATCHES[workaround.name]()
        _ENABLED[workaround.name] = True
    return [w.name for w in chosen]


def set_enabled(name: str, enabled: bool) -> None:
    """Turn an installed workaround off (the bug shows again) or back on."""
    if name not in _ENABLED:
        raise KeyError(f"workaround {name!r} is not installed in this engine (installed: {sorted(_ENABLED)})")
    _ENABLED[name] = bool(enabled)


def _patch_cpu_moe_reload_repack() -> None:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = UnquantizedFusedMoEMethod._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        weight_update = self.moe_kernel is not None  # vLLM's own test for "not the first load"
        original(self, layer, w13, w2)
        if weight_update and _ENABLED.get(CPU_MOE_RELOAD_REPACK.name):
            # what the first load did after the kernel was built: pad + prepack (CPU experts)
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    _setup_kernel.__wrapped__ = original
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel


_PATCHES = {CPU_MOE_RELOAD_REPACK.name: _patch_cpu_moe_reload_repack}
