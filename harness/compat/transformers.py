"""What transformers computes where the other engines differ, read off its own modules (no patch).

- `hf_mla_norm_eps`: HF's DeepseekV3Attention (transformers 5.12-5.19, as DeepSeek's own remote code) builds its
  MLA latent norms (`q_a_layernorm`, `kv_a_layernorm`) without `eps`, so with DeepseekV3RMSNorm's default 1e-6,
  whatever the config's `rms_norm_eps`; megatron-core and vLLM take `rms_norm_eps` (transformers #44261, its PRs
  44317, 44346 and 44585 closed unmerged; vLLM PR 35515 closed). The harness's Megatron models
  (harness.bridge.mla_norms) and its vLLM engine (harness.compat.vllm `mla-norm-eps-like-hf`) follow HF. Read off
  an HF attention built on the meta device, so an HF that starts passing `rms_norm_eps` is followed too.

Imported by the vLLM engine's process too (harness.compat.vllm): the standard library at import time, torch and
transformers inside the function.
"""
from __future__ import annotations

from typing import Any


def hf_mla_norm_eps(hf_config: Any) -> dict[str, float]:
    """{"kv": ..., "q": ...}: the epsilons of HF's MLA latent norms for a DeepSeek-V3 config (a PretrainedConfig
    or config.json's dict; "q" with q LoRA only)."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    config = DeepseekV3Config(**hf_config) if isinstance(hf_config, dict) else hf_config
    with torch.device("meta"):
        attention = DeepseekV3Attention(config, layer_idx=0)
    eps = {"kv": float(attention.kv_a_layernorm.variance_epsilon)}
    if getattr(attention, "q_a_layernorm", None) is not None:  # some transformers versions leave it unset
        eps["q"] = float(attention.q_a_layernorm.variance_epsilon)
    return eps
