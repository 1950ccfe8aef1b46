"""The model zoo: small HF causal LMs defined by configs in code, with seeded random weights.

No model hub is needed: every zoo model is an HF config plus `randomize_weights(seed)`. The tiny
models are shaped so that each layout the harness runs is legal (4 layers: PP 1/2/4; 4 heads and
2 KV heads: TP 1/2) and so that bugs show: the vocabulary (251, prime) is not divisible by 2 or 4,
so Megatron must pad it, and every weight, norms and biases included, is random (see
`harness.models.randomize`). `qwen3-0.6b-shape` is the real Qwen3-0.6B architecture with random
weights, for GPU runs.

Naming: `<family>` is untied, `<family>-tied` ties lm_head to embed_tokens. `tiny-llama3` is
`tiny-llama` with Llama-3 RoPE scaling whose original window (32) is shorter than its 128 positions;
`tiny-qwen3-hd32` has head_dim 32, the smallest that vLLM's CPU attention runs; `tiny-qwen3-tied-hd32` is its
tied twin (`tiny-qwen3-tied` with head_dim 32).

Mixture-of-Experts: `tiny-qwen3-moe` (Qwen3-MoE: 4 experts of width 32, top-2, softmax router with
the top-k probabilities renormalised) and `tiny-mixtral` (Mixtral: 4 experts of width 128, top-2,
softmax over the top-k logits), every layer sparse. 4 experts allow ep 1/2/4; the expert widths
split over etp 1/2/4. `tiny-qwen3-moe-hd32` is `tiny-qwen3-moe` with head_dim 32 (vLLM's CPU attention).
`tiny-qwen2-moe` (Qwen2-MoE: QKV bias, 4 experts of width 32, top-2 of a softmax over every expert,
not renormalised, plus a shared expert of width 128 scaled by a sigmoid gate): stack A only
(Megatron-Bridge 0.6.2 has no Qwen2-MoE bridge); no head_dim-32 twin (the vLLM suite runs Qwen3-MoE).
`tiny-deepseek-v3` (DeepSeek-V3: multi-head latent attention with q and kv LoRA ranks, YaRN RoPE with
mscale, a dense first layer, then 16 routed experts in 4 groups scored by a sigmoid plus a random
`e_score_correction_bias`, top-4 from the best 2 groups, renormalised and scaled by 2.5, and a shared
expert): stack A only (issue 37). `deepseek-v3-shape` is the published DeepSeek-V3 architecture cut to
4 layers, random weights: defined for GPU runs, never built in CI (its config is checked).
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    DeepseekV3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.initialization import no_init_weights

from harness.models.randomize import randomize_weights

# Eager attention: the plain softmax(QK^T)V reference that the Megatron parity checks compare to.
ATTN_IMPLEMENTATION = "eager"
TINY_VOCAB_SIZE = 251  # prime: not divisible by 2 or 4, so Megatron's vocab padding is exercised

_TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=TINY_VOCAB_SIZE,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    # Base 1e4, not Qwen's 1e6: with sequences <= 128 a large base barely rotates, and a wrong
    # rope base would then hide.
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    hidden_act="silu",
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# Mixture-of-Experts on the tiny shape: 4 experts (ep 1/2/4), top-2, every layer sparse.
_TINY_QWEN3_MOE: dict[str, Any] = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
)
# Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) on the tiny shape: Qwen2's QKV bias, 4 routed experts of
# width 32, top-2 from a softmax over every expert *without* renormalisation (`norm_topk_prob=False`, the
# published checkpoints' setting), and a shared expert of width 128 (4 x 32, as A2.7B's 5632 = 4 x 1408)
# whose output is scaled by a sigmoid gate (`shared_expert_gate`, hidden -> 1); every layer sparse.
_TINY_QWEN2_MOE: dict[str, Any] = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=128,
    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
    qkv_bias=True, use_sliding_window=False,
)
# DeepSeek-V3 on the tiny scale (issue 37), every feature on: MLA with q_lora_rank 32 and kv_lora_rank 32
# (kv_a_proj_with_mqa's 32 + 8 rows split over tp 1/2/4), per-head nope 16 + rope 8 for q/k and v 16;
# YaRN with DeepSeek-V3's beta_fast/slow and mscale/mscale_all_dim (1.0, 1.0: the softmax scale
# times mscale^2 = 1.30 at factor 4), an original window of 32 of the 128 positions; first_k_dense_replace 1
# (layer 0 a dense MLP of width 128); then 16 routed experts of width 16 (ep 1/2/4/8, etp 1/2) in 4 groups,
# scored by a sigmoid plus the per-expert `e_score_correction_bias` (random, see harness.models.randomize),
# the best 2 groups by the sum of their top 2 scores, the top 4 experts in them (4 / 2 = 2 per group: the
# top-2 group score megatron-core computes as topk // group_topk, HF always as 2), renormalised and scaled
# by routed_scaling_factor 2.5; 2 shared experts (width 32). That the groups, the bias and the scale each
# change the output is measured by the catalog's DeepSeek-V3 variants (docs/moe.md).
_TINY_DEEPSEEK_V3: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    intermediate_size=128, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
    n_group=4, topk_group=2, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1, vocab_size=TINY_VOCAB_SIZE, max_position_embeddings=128, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
    rope_interleave=True, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
    output_router_logits=False, num_nextn_predict_layers=0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# The published deepseek-ai/DeepSeek-V3 config.json (architecture only), cut to 4 layers (3 dense, as the
# checkpoint's first_k_dense_replace, then 1 sparse); no MTP layer (the checkpoint's one: HF computes none).
_DEEPSEEK_V3_SHAPE: dict[str, Any] = dict(
    hidden_size=7168, num_hidden_layers=4, num_attention_heads=128, num_key_value_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
    n_group=8, topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=3, vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
    rope_interleave=True, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
    output_router_logits=False, num_nextn_predict_layers=0, tie_word_embeddings=False, bos_token_id=0,
    eos_token_id=1,
)
_TINY_MIXTRAL: dict[str, Any] = dict(
    num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, sliding_window=None,
    output_router_logits=False,
)

# Llama-3.x RoPE scaling (`rope_type: llama3`), scaled down to the tiny shape: Llama 3.1 has an
# original window of 8192 positions; here it is 32 of the 128, so positions 32..127 lie beyond it.
# With head_dim 16 and base 1e4 the 8 frequencies have wavelengths 6.3, 20, 63, ..., 2e4 positions:
# the first (< 32/4) is kept, the second (between 32/4 and 32) is smoothed (/3.3), the other six are
# divided by the factor 8, so all three branches of the formula are used. Megatron-Core hard-codes
# low/high_freq_factor 1/4 (kept here) and original window 8192 (not kept: see
# harness.bridge.mbridge_compat, override 4).
_TINY_LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}

# The published Qwen/Qwen3-0.6B config.json (architecture only).
_QWEN3_0P6B_SHAPE: dict[str, Any] = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151936,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    max_window_layers=28,
    use_sliding_window=False,
    sliding_window=None,
    bos_token_id=151643,
    eos_token_id=151645,
    tie_word_embeddings=True,
)


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: an HF config class plus the keyword arguments that define the model."""

    name: str
    config_class: Callable[..., PretrainedConfig]
    config_kwargs: dict[str, Any] = field(hash=False)
    description: str

    @property
    def tied(self) -> bool:
        return bool(self.config_kwargs.get("tie_word_embeddings", False))

    def config(self) -> PretrainedConfig:
        # A deep copy: config classes may normalize nested dicts (rope_parameters) in place.
        return self.config_class(**copy.deepcopy(self.config_kwargs))


def _tiny(name: str, config_class: Callable[..., PretrainedConfig], feature: str,
          tied: bool) -> ZooModel:
    suffix = "-tied" if tied else ""
    tie_text = "tied lm_head/embed_tokens" if tied else "untied lm_head"
    return ZooModel(
        name=f"{name}{suffix}",
        config_class=config_class,
        config_kwargs={**_TINY_SHAPE, "tie_word_embeddings": tied},
        description=f"tiny {feature}, {tie_text}, vocab {TINY_VOCAB_SIZE}",
    )


def _build_zoo() -> dict[str, ZooModel]:
    entries = []
    for tied in (False, True):
        entries.append(_tiny("tiny-qwen2", Qwen2Config, "Qwen2 (QKV bias)", tied))
        entries.append(_tiny("tiny-qwen3", Qwen3Config, "Qwen3 (QK-norm)", tied))
        entries.append(_tiny("tiny-llama", LlamaConfig, "Llama", tied))
    # Full multi-head attention (4 KV heads): TP4 is valid, so 4-GPU suites reach every layout.
    entries.append(ZooModel(
        name="tiny-qwen3-kv4",
        config_class=Qwen3Config,
        config_kwargs={**_TINY_SHAPE, "num_key_value_heads": 4, "tie_word_embeddings": False},
        description=f"tiny Qwen3 (QK-norm) with 4 KV heads (TP4-valid), untied lm_head, vocab {TINY_VOCAB_SIZE}",
    ))
    # head_dim 32: the smallest head vLLM's CPU attention kernel takes (the rollout suite's vLLM model).
    entries.append(ZooModel(
        name="tiny-qwen3-hd32",
        config_class=Qwen3Config,
        config_kwargs={**_TINY_SHAPE, "head_dim": 32, "tie_word_embeddings": False},
        description=f"tiny Qwen3 (QK-norm) with head_dim 32 (vLLM's CPU kernels), untied lm_head, vocab {TINY_VOCAB_SIZE}",
    ))
    # Both: the vLLM suite's model at TP4 (4-GPU layouts), measured first on 4x H100 2026-11-27.
    entries.append(ZooModel(
        name="tiny-qwen3-kv4-hd32",
        config_class=Qwen3Config,
        config_kwargs={**_TINY_SHAPE, "num_key_value_heads": 4, "head_dim": 32, "tie_word_embeddings": False},
        description=f"tiny Qwen3 (QK-norm) with 4 KV heads (TP4-valid) and head_dim 32 (vLLM's CPU kernels), "
                    f"untied lm_head, vocab {TINY_VOCAB_SIZE}",
    ))
    # Its tied twin (vLLM's CPU tier on a tied model: the catalog's sync-tied-lm-head-stale).
    entries.append(ZooModel(
        name="tiny-qwen3-tied-hd32",
        config_class=Qwen3Config,
        config_kwargs={**_TINY_SHAPE, "head_dim": 32, "tie_word_embeddings": True},
        description=f"tiny Qwen3 (QK-norm) with head_dim 32 (vLLM's CPU kernels), tied lm_head/embed_tokens, "
                    f"vocab {TINY_VOCAB_SIZE}",
    ))
    entries.append(ZooModel(
        name="tiny-llama3",
        config_class=LlamaConfig,
        config_kwargs={**_TINY_SHAPE, "rope_parameters": _TINY_LLAMA3_ROPE, "tie_word_embeddings": False},
        description="tiny Llama with Llama-3 RoPE scaling (original window 32 of 128), untied lm_head, "
                    f"vocab {TINY_VOCAB_SIZE}",
    ))
    entries.append(ZooModel(
        name="tiny-qwen3-moe",
        config_class=Qwen3MoeConfig,
        config_kwargs={**_TINY_SHAPE, **_TINY_QWEN3_MOE, "tie_word_embeddings": False},
        description="tiny Qwen3-MoE (QK-norm; 4 experts of width 32, top-2, normalised top-k), untied lm_head, "
                    f"vocab {TINY_VOCAB_SIZE}",
    ))
    # head_dim 32 for vLLM's CPU attention kernel (suites/moe/test_vllm.py); otherwise tiny-qwen3-moe.
    entries.append(ZooModel(
        name="tiny-qwen3-moe-hd32",
        config_class=Qwen3MoeConfig,
        config_kwargs={**_TINY_SHAPE, **_TINY_QWEN3_MOE, "head_dim": 32, "tie_word_embeddings": False},
        description="tiny Qwen3-MoE (QK-norm; 4 experts of width 32, top-2, normalised top-k) with head_dim 32 "
                    f"(vLLM's CPU kernels), untied lm_head, vocab {TINY_VOCAB_SIZE}",
    ))
    entries.append(ZooModel(
        name="tiny-qwen2-moe",
        config_class=Qwen2MoeConfig,
        config_kwargs={**_TINY_SHAPE, **_TINY_QWEN2_MOE, "tie_word_embeddings": False},
        description="tiny Qwen2-MoE (QKV bias; 4 experts of width 32, top-2 of a softmax over all, unnormalised; "
                    f"a shared expert of width 128 behind a sigmoid gate), untied lm_head, vocab {TINY_VOCAB_SIZE}",
    ))
    entries.append(ZooModel(
        name="tiny-deepseek-v3",
        config_class=DeepseekV3Config,
        config_kwargs={**_TINY_DEEPSEEK_V3, "tie_word_embeddings": False},
        description="tiny DeepSeek-V3 (MLA with q/kv LoRA, YaRN with mscale; a dense first layer, then 16 experts "
                    "of width 16 in 4 groups, sigmoid + expert bias, top-4 of the best 2 groups, scaled by 2.5, "
                    f"2 shared experts), untied lm_head, vocab {TINY_VOCAB_SIZE}",
    ))
    entries.append(ZooModel(
        name="deepseek-v3-shape",
        config_class=DeepseekV3Config,
        config_kwargs=_DEEPSEEK_V3_SHAPE,
        description="DeepSeek-V3 architecture cut to 4 layers (3 dense, 1 with 256 experts), random weights; "
                    "for GPU runs, never built in CI",
    ))
    entries.append(ZooModel(
        name="tiny-mixtral",
        config_class=MixtralConfig,
        config_kwargs={**_TINY_SHAPE, **_TINY_MIXTRAL, "tie_word_embeddings": False},
        description=f"tiny Mixtral (4 experts of width 128, top-2), untied lm_head, vocab {TINY_VOCAB_SIZE}",
    ))
    entries.append(ZooModel(
        name="qwen3-0.6b-shape",
        config_class=Qwen3Config,
        config_kwargs=_QWEN3_0P6B_SHAPE,
        description="Qwen3-0.6B architecture (tied), random weights; for GPU runs",
    ))
    return {entry.name: entry for entry in sorted(entries, key=lambda e: e.name)}


ZOO: dict[str, ZooModel] = _build_zoo()


def list_models() -> list[str]:
    """Zoo model names, sorted."""
    return list(ZOO)


def is_zoo_name(name_or_path: str | os.PathLike) -> bool:
    return isinstance(name_or_path, str) and name_or_path in ZOO


def load_hf_config(name_or_path: str | os.PathLike) -> PretrainedConfig:
    """The HF config of a zoo model or of a local checkpoint dir (no weights are built)."""
    if is_zoo_name(name_or_path):
        return ZOO[str(name_or_path)].config()
    from harness.models.checkpoints import check_checkpoint_dir  # avoids an import cycle

    return AutoConfig.from_pretrained(check_checkpoint_dir(Path(name_or_path)))


def build_hf_model(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                   seed: int = 0) -> PreTrainedModel:
    """The HF model (eval mode, eager attention) of a zoo name or a local checkpoint dir.

    A zoo model gets `randomize_weights(seed)`; a checkpoint dir is loaded as saved (`seed` unused).
    """
    if not is_zoo_name(name_or_path):
        from harness.models.checkpoints import check_checkpoint_dir

        path = check_checkpoint_dir(Path(name_or_path))
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        return model.eval()
    config = ZOO[str(name_or_path)].config()
    # HF's own init would be overwritten by randomize_weights anyway; skipping it saves ~10 s
    # for the 0.6B shape. no_init_weights also skips tying, hence the explicit tie_weights().
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32)
    model.tie_weights()
    if config.tie_word_embeddings and model.get_output_embeddings().weight is not \
            model.get_input_embeddings().weight:
        raise RuntimeError(f"{name_or_path}: lm_head is not tied to embed_tokens after tie_weights()")
    # Random values are drawn in float32 whatever `dtype` is, so a bf16 model is the rounded fp32 one.
    randomize_weights(model, seed)
    return model.to(dtype).eval()


def checkpoint_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """`model`'s weights under the names its checkpoint stores (detached copies): transformers 5 holds a
    MoE layer's experts fused (`mlp.experts.gate_up_proj` [experts, 2 x width, hidden]) and writes them
    per expert (`mlp.experts.<e>.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.<e>.w1.weight`),
    which is what the bridges read and export. Dense models: their state dict as it is."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return dict(revert_weight_conversion(model, state))
