"""DeepSeek-V3's MLA latent norms take HF's epsilon, not the config's `rms_norm_eps` (issue 37).

HF's DeepseekV3Attention (transformers 5.17, as DeepSeek's own remote code) builds `q_a_layernorm` and
`kv_a_layernorm` without `eps`: DeepseekV3RMSNorm's default, 1e-6, whatever the config's `rms_norm_eps`.
megatron-core builds MLA's `q_layernorm`/`kv_layernorm` (on TE: the norms fused into `linear_q_up_proj`/
`linear_kv_up_proj`) with `config.layernorm_epsilon`, which both bridges set from `rms_norm_eps` (mbridge 0.15.1,
Megatron-Bridge 0.6.2), as vLLM does. For DeepSeek-V3 (1e-6) the two agree; for Moonlight (1e-5) Megatron's
latent norm is not HF's: moonlight-shape's fp32 logprobs were 2.6-3.8x farther from HF's float64 than HF's own
fp32 (1x H200, both stacks, 2026-12-03), 4.5x on the CPU tier, and 1.15x with `rms_norm_eps` 1e-6 (the catalog's
`mla-norm-eps-from-config`). Upstream: huggingface/transformers#44261 (PRs 44317, 44346, 44585 closed unmerged),
vllm-project/vllm#35515 (vLLM to follow the remote code; closed), pytorch/torchtitan#4395.

The harness follows HF's module (`harness.compat.transformers.hf_mla_norm_eps`, which the vLLM engine follows too).
"""
from __future__ import annotations

import torch

from harness.compat.transformers import hf_mla_norm_eps

__all__ = ["match_hf_mla_norms"]


def _norms(attention, which: str) -> list[torch.nn.Module]:
    """The modules of a Megatron MLA attention that normalize its q or kv latent: the norm itself (local spec)
    or the linear it is fused into (TE's LayerNormColumnParallelLinear); an IdentityOp or a plain linear has
    no `eps`."""
    names = {"q": ("q_layernorm", "linear_q_up_proj"), "kv": ("kv_layernorm", "linear_kv_up_proj")}[which]
    found = [getattr(attention, name, None) for name in names]
    return [module for module in found if isinstance(getattr(module, "eps", None), float)]


def match_hf_mla_norms(chunks: list[torch.nn.Module], hf_config, eps: dict[str, float] | None = None) -> int:
    """Set every MLA layer's latent norms of `chunks` to HF's epsilons (or `eps`); returns how many modules were
    set. Raises where an MLA layer has no such norm (a megatron-core whose modules moved)."""
    eps = hf_mla_norm_eps(hf_config) if eps is None else eps
    count = 0
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            attention = layer.self_attention
            if not hasattr(attention, "kv_layernorm"):
                continue  # not MLA
            for which, value in eps.items():
                modules = _norms(attention, which)
                if not modules:
                    raise RuntimeError(f"layer {layer.layer_number}: no {which} latent norm with an eps found in "
                                       f"{type(attention).__name__} (harness.bridge.mla_norms)")
                for module in modules:
                    module.eps = value
                count += len(modules)
    return count
