"""The model zoo: small HF causal LMs defined by configs in code, with seeded random weights.

No model hub is needed: every zoo model is an HF config plus `randomize_weights(seed)`. The tiny
models are shaped so that each layout the harness runs is legal (4 layers: PP 1/2/4; 4 heads and
2 KV heads: TP 1/2) and so that bugs show: the vocabulary (251, prime) is not divisible by 2 or 4,
so Megatron must pad it, and every weight, norms and biases included, is random (see
`harness.models.randomize`). `qwen3-0.6b-shape` is the real Qwen3-0.6B architecture with random
weights, for GPU runs; `qwen3-8b-shape` and `qwen3-30b-a3b-shape` are Qwen3-8B and Qwen3-30B-A3B (128
experts, top-8) at their real widths with 4 layers (issue 37's real shapes; config-checked on the CPU tier,
built on GPUs only).

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
(Megatron-Bridge 0.6.2 has no Qwen2-MoE bridge). VLLM_CPU_TWINS: the twins of tiny-qwen2-moe, tiny-glm4-moe,
tiny-gpt-oss, tiny-gemma3 (`-hd32`), tiny-deepseek-v3 and tiny-moonlight (`-mla576`) that vLLM's CPU kernels run.
`tiny-gemma3` (Gemma 3 text, `gemma3_text`: zero-centered norms, embedding scale, sliding-window and
global layers, query_pre_attn_scalar, QK-norm, pre/post-feedforward norms, local/global RoPE bases,
GeGLU-tanh, tied) and `gemma3-shape` (gemma-3-1b's text dims, 4 layers, random weights; config only in
CI): stack A only (harness.bridge.gemma3; Megatron-Bridge 0.6.2's Gemma 3 is TE-only).
`tiny-glm4-moe` (GLM-4.5-MoE: partial RoPE on half of each head, q/k/v biases, QK-norm, a dense first
layer, then 4 routed experts of width 32 scored by a sigmoid plus a random `e_score_correction_bias`,
top-2, renormalised and scaled by routed_scaling_factor 2.5, and one shared expert, ungated): stack A only
(issue 37). `glm4.5-moe-shape` and `glm4.5-air-shape` are the published zai-org/GLM-4.5 and GLM-4.5-Air
architectures at 4 layers (one dense first layer), random weights: config-checked on the CPU tier, never
built in CI.
`tiny-gpt-oss` (gpt-oss: attention sinks, sliding-window attention on every other layer, YaRN RoPE,
q/k/v/o biases, 4 square experts (width = hidden, as gpt-oss-20b's 2880) with biases and a clamped
SwiGLU, top-2, a router with a bias): stack B only (mbridge 0.15.1 has no gpt-oss bridge); its expert
weights are scaled after the draw so that the clamp at 7 bites (`_gpt_oss_weights`).
`gpt-oss-shape` is gpt-oss-20b's architecture cut to 4 layers: config checks only, never built in CI.
`tiny-deepseek-v3` (DeepSeek-V3: multi-head latent attention with q and kv LoRA ranks, YaRN RoPE with
mscale, a dense first layer, then 16 routed experts in 4 groups scored by a sigmoid plus a random
`e_score_correction_bias`, top-4 from the best 2 groups, renormalised and scaled by 2.5, and a shared
expert): stack A only (issue 37). `deepseek-v3-shape` is the published DeepSeek-V3 architecture cut to
4 layers, random weights: defined for GPU runs, never built in CI (its config is checked).
`tiny-moonlight` and `moonlight-shape` are Moonlight-16B-A3B's DeepSeek-V3 architecture without q LoRA
(one q_proj), plain RoPE and no expert groups; `moonlight-shape` and `qwen2-moe-shape` (Qwen1.5-MoE-A2.7B) are
the MLA and Qwen2-MoE families at real widths that one GPU holds (4 layers; config-checked on the CPU tier).
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
    Glm4MoeConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    GptOssConfig,
    DeepseekV3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers import Gemma3TextConfig
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
# GLM-4.5-MoE (zai-org/GLM-4.5, GLM-4.5-Air) on the tiny shape, every feature of the family on: RoPE on the
# first half of each head (partial_rotary_factor 0.5: 8 of 16 dims, rotate-half pairs within them), q/k/v
# biases (`attention_bias`), per-head QK-norm (`use_qk_norm`, GLM-4.5's setting; Air's is off), a dense first
# layer (`first_k_dense_replace` 1, width 128), then 4 routed experts of width 32 (ep 1/2/4, etp 1/2) scored
# by a sigmoid, chosen by score + `e_score_correction_bias` (random, see harness.models.randomize: it changes
# the top 2 for a good part of the tokens), top-2, the chosen scores renormalised and scaled by
# routed_scaling_factor 2.5 (GLM-4.5's value), plus one shared expert of width 32 (no gate). n_group 1,
# topk_group 1 (the published configs' values: no group-limited routing); no MTP layer (HF computes none).
_TINY_GLM4_MOE: dict[str, Any] = dict(
    partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, first_k_dense_replace=1,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
    routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True, output_router_logits=False,
    num_nextn_predict_layers=0,
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
# Moonlight (moonshotai/Moonlight-16B-A3B, model_type deepseek_v3: the DeepSeek-V3 architecture that verl's and
# slime's RL examples train) differs from DeepSeek-V3 where a conversion can go wrong: no q LoRA (`q_lora_rank`
# None: one q_proj where DeepSeek-V3 has q_a_proj, q_a_layernorm and q_b_proj), plain RoPE (base 50000, no YaRN),
# no group-limited routing (n_group 1), 2 shared experts, routed_scaling_factor 2.446 and rms_norm_eps 1e-5 (which
# HF's MLA latent norms ignore: harness.bridge.mla_norms). `tiny-moonlight` is tiny-deepseek-v3 with those
# differences (RoPE base 1e4 as the other tiny models: short sequences).
_TINY_MOONLIGHT: dict[str, Any] = dict(
    _TINY_DEEPSEEK_V3, q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=2.446,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
)
# The published moonshotai/Moonlight-16B-A3B config.json (architecture only) at 4 of its 27 layers (the first
# dense, as the checkpoint's first_k_dense_replace 1, then 3 with 64 experts of width 1408, top-6): ~2.4B
# parameters, which one GPU trains at tp1 in fp32 where DeepSeek-V3's shape (11B in its one sparse layer) fits none.
_MOONLIGHT_SHAPE: dict[str, Any] = dict(
    hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
    q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    intermediate_size=11264, moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6,
    n_group=1, topk_group=1, n_shared_experts=2, routed_scaling_factor=2.446, norm_topk_prob=True,
    first_k_dense_replace=1, vocab_size=163840, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    rope_interleave=True, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
    output_router_logits=False, num_nextn_predict_layers=0, tie_word_embeddings=False, bos_token_id=163584,
    eos_token_id=163585,
)
_TINY_MIXTRAL: dict[str, Any] = dict(
    num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0, sliding_window=None,
    output_router_logits=False,
)

# Gemma 3 text on the tiny shape, every Gemma 3 feature on: a 3:1 local:global layer pattern (the real
# models' 5:1, shortened to 4 layers, the global layer last, so that under pp2 the stages' patterns
# differ: a stage-local layer index would show), a window of 8 keys (the parity batches are up to ~20
# tokens long, the sync prompts 16: the window cuts most rows), local/global RoPE bases 1e4/1e5 (the real
# global 1e6 barely rotates in 128 positions, so a swapped base would hide), query_pre_attn_scalar 24
# (!= head_dim 16: dropping it shows), gelu-tanh GeGLU, QK-norm, tied embeddings, no soft-capping (as
# every Gemma 3 checkpoint). Its norm weights are zero-centered (`_zero_center_norms`): w ~ 0.1 N(0, 1),
# so Gemma's scale (1 + w) is drawn as every other zoo norm's scale, and a converter using w itself scales
# by ~0.1 N(0, 1).
_TINY_GEMMA3: dict[str, Any] = dict(
    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 100000.0}},
    final_logit_softcapping=None, attn_logit_softcapping=None, attention_bias=False,
    use_bidirectional_attention=False,
)
# The published google/gemma-3-1b-pt config.json's text dims (hidden 1152, 4 heads, 1 KV head, head_dim
# 256, query_pre_attn_scalar 256, intermediate 6912, vocab 262144, window 512, pattern 6, bases 1e4 / 1e6)
# with 4 of its 26 layers (3 local, 1 global); random weights; config-checked only (never built in CI).
_GEMMA3_1B_SHAPE: dict[str, Any] = dict(
    hidden_size=1152, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    intermediate_size=6912, vocab_size=262144, max_position_embeddings=32768, rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=512,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    final_logit_softcapping=None, attn_logit_softcapping=None, attention_bias=False, attention_dropout=0.0,
    use_bidirectional_attention=False, pad_token_id=0, bos_token_id=2, eos_token_id=1, tie_word_embeddings=True,
)
# gpt-oss (issue 37) on the tiny shape. gpt-oss-20b's features, each where it shows: attention sinks
# (a learnable per-head logit in the softmax's denominator), sliding-window attention (window 8 of the
# parity batch's 24 positions) on layers 0 and 2 (HF's default layer_types: sliding, full, ...; what
# Megatron-Bridge's window_attn_skip_freq=2 builds), YaRN RoPE with gpt-oss's own parameters (factor 32
# over 4096 positions, beta 32/1, not truncated; with head_dim 16 and base 1.5e5 the 8 frequencies fall
# in all three of YaRN's bands: kept, ramped, interpolated), q/k/v/o biases, 4 experts of width 64 =
# hidden (square, as gpt-oss-20b's 2880 x 2880: Megatron-Bridge's GPTOSSBridge then cannot tell
# down_proj's orientation from its shape and takes HF's), top-2 over a router with a bias, expert biases,
# and the clamped SwiGLU (gate clamped at 7 above, up to [-7, 7], (up + 1) * gate * sigmoid(1.702 gate)).
_GPT_OSS_YARN: dict[str, Any] = {
    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 4096,
}
_TINY_GPT_OSS: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, vocab_size=TINY_VOCAB_SIZE,
    # factor x original window: HF warns when max_position_embeddings disagrees with YaRN's factor
    max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=8, rope_parameters=_GPT_OSS_YARN,
    attention_bias=True, attention_dropout=0.0, output_router_logits=False, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# The published openai/gpt-oss-20b config.json (architecture; 24 layers there, 4 here).
_GPT_OSS_20B_SHAPE: dict[str, Any] = dict(
    hidden_size=2880, num_hidden_layers=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
    intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
    max_position_embeddings=131072, rms_norm_eps=1e-5, sliding_window=128, rope_parameters=_GPT_OSS_YARN,
    attention_bias=True, attention_dropout=0.0, output_router_logits=False, tie_word_embeddings=False,
    pad_token_id=199999, eos_token_id=200002,
)
# How far the tiny model's expert gate_up weights are scaled after the seeded draw (std 1/sqrt(128) x
# 4): the pre-activations' std is then ~2.8 and a few percent pass 7, so the clamp changes the output.
GPT_OSS_GATE_UP_SCALE = 4.0


@torch.no_grad()
def _gpt_oss_weights(model: PreTrainedModel) -> None:
    """tiny-gpt-oss after randomize_weights: the sinks spread to N(0, 1) (the draw gives a 1-D weight
    1 + 0.1 N(0, 1), as a norm's) and the experts' gate_up weights scaled so the SwiGLU clamp bites."""
    for layer in model.model.layers:
        layer.self_attn.sinks.sub_(1.0).mul_(10.0)
        layer.mlp.experts.gate_up_proj.mul_(GPT_OSS_GATE_UP_SCALE)


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


# The published Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B config.json (architecture only) at 4 of their 36 and
# 48 layers (PP 1/2/4): the real widths, heads, head dims, experts and vocab at a size one GPU holds in fp32
# (~2.0B and ~3.1B parameters with 4 layers). Issue 37's `-shape` models: the bf16 regimes at real widths.
SHAPE_LAYERS = 4
_QWEN3_8B_SHAPE: dict[str, Any] = dict(
    _QWEN3_0P6B_SHAPE,
    hidden_size=4096,
    num_hidden_layers=SHAPE_LAYERS,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    max_window_layers=SHAPE_LAYERS,
    tie_word_embeddings=False,
)
_QWEN3_30B_A3B_SHAPE: dict[str, Any] = dict(
    _QWEN3_8B_SHAPE,
    hidden_size=2048,
    num_attention_heads=32,
    num_key_value_heads=4,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    router_aux_loss_coef=0.001,
    output_router_logits=False,
)
_QWEN3_30B_A3B_SHAPE.pop("max_window_layers")
# The published Qwen/Qwen1.5-MoE-A2.7B config.json (model_type qwen2_moe; architecture only) at 4 of its 24
# layers: hidden 2048, 16 heads of 128 (no GQA), q/k/v biases, 60 experts of width 1408, top-4 from a softmax
# over all 60 *without* renormalisation, and a shared expert of width 5632 behind its sigmoid gate (~2.9B
# parameters). Stack A only: Megatron-Bridge 0.6.2 has no Qwen2-MoE bridge.
_QWEN2_MOE_SHAPE: dict[str, Any] = dict(
    hidden_size=2048, num_hidden_layers=SHAPE_LAYERS, num_attention_heads=16, num_key_value_heads=16,
    intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
    num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
    vocab_size=151936, max_position_embeddings=8192, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, hidden_act="silu", attention_dropout=0.0,
    use_sliding_window=False, router_aux_loss_coef=0.001, output_router_logits=False, tie_word_embeddings=False,
    bos_token_id=151643, eos_token_id=151643,
)
# The published zai-org/GLM-4.5 (355B-A32B) and zai-org/GLM-4.5-Air (106B-A12B) config.json (architecture
# only) at 4 of their 92 and 46 layers, the first dense (first_k_dense_replace 3 and 1 in the checkpoints;
# 1 here so that 3 of the 4 layers are sparse). GLM-4.5: hidden 5120, 96 heads of 128, 8 KV heads, 160
# experts of width 1536, top-8, routed_scaling_factor 2.5, QK-norm; Air: hidden 4096, 96 heads of 128,
# 8 KV heads, 128 experts of width 1408, top-8, routed_scaling_factor 1.0, no QK-norm. Both: RoPE on half of
# each head, base 1e6, q/k/v biases, one shared expert, n_group 1, vocab 151552; the checkpoints' one MTP
# layer is not built (HF computes none: num_nextn_predict_layers 0 here).
_GLM45_SHAPE: dict[str, Any] = dict(
    hidden_size=5120, num_hidden_layers=SHAPE_LAYERS, num_attention_heads=96, num_key_value_heads=8,
    head_dim=128, intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160,
    num_experts_per_tok=8, n_shared_experts=1, routed_scaling_factor=2.5, n_group=1, topk_group=1,
    norm_topk_prob=True, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
    partial_rotary_factor=0.5, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    vocab_size=151552, max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
    attention_dropout=0.0, output_router_logits=False, num_nextn_predict_layers=0, tie_word_embeddings=False,
    pad_token_id=151329, eos_token_id=[151329, 151336, 151338],
)
_GLM45_AIR_SHAPE: dict[str, Any] = dict(
    _GLM45_SHAPE, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=128,
    routed_scaling_factor=1.0, use_qk_norm=False,
)


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: an HF config class plus the keyword arguments that define the model."""

    name: str
    config_class: Callable[..., PretrainedConfig]
    config_kwargs: dict[str, Any] = field(hash=False)
    description: str
    # Applied after randomize_weights (tiny-gpt-oss: its clamp must bite); None for every other model.
    adjust_weights: Callable[[PreTrainedModel], None] | None = field(default=None, hash=False, compare=False)

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
        name="tiny-glm4-moe",
        config_class=Glm4MoeConfig,
        config_kwargs={**_TINY_SHAPE, **_TINY_GLM4_MOE, "tie_word_embeddings": False},
        description="tiny GLM-4.5-MoE (RoPE on half of each head, QKV bias, QK-norm; a dense first layer, then 4 "
                    "experts of width 32, sigmoid + expert bias, top-2, scaled by 2.5, a shared expert), "
                    f"untied lm_head, vocab {TINY_VOCAB_SIZE}",
    ))
    entries.append(ZooModel(
        name="glm4.5-moe-shape",
        config_class=Glm4MoeConfig,
        config_kwargs=_GLM45_SHAPE,
        description=f"GLM-4.5 (355B-A32B) architecture at {SHAPE_LAYERS} layers (1 dense, 3 with 160 experts, "
                    "top-8), random weights; for GPU runs, never built in CI",
    ))
    entries.append(ZooModel(
        name="glm4.5-air-shape",
        config_class=Glm4MoeConfig,
        config_kwargs=_GLM45_AIR_SHAPE,
        description=f"GLM-4.5-Air (106B-A12B) architecture at {SHAPE_LAYERS} layers (1 dense, 3 with 128 experts, "
                    "top-8), random weights; for GPU runs, never built in CI",
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
        name="tiny-moonlight",
        config_class=DeepseekV3Config,
        config_kwargs={**_TINY_MOONLIGHT, "tie_word_embeddings": False},
        description="tiny Moonlight (DeepSeek-V3's architecture without q LoRA: one q_proj; plain RoPE; 16 "
                    "experts of width 16, sigmoid + expert bias, top-4 without groups, scaled by 2.446, 2 shared "
                    f"experts), untied lm_head, vocab {TINY_VOCAB_SIZE}",
    ))
    entries.append(ZooModel(
        name="moonlight-shape",
        config_class=DeepseekV3Config,
        config_kwargs=_MOONLIGHT_SHAPE,
        description="Moonlight-16B-A3B architecture (DeepSeek-V3's, no q LoRA) at 4 layers (1 dense, 3 with 64 "
                    "experts, top-6), random weights; for GPU runs, never built in CI",
    ))
    entries.append(ZooModel(
        name="qwen2-moe-shape",
        config_class=Qwen2MoeConfig,
        config_kwargs=_QWEN2_MOE_SHAPE,
        description="Qwen1.5-MoE-A2.7B architecture at 4 layers (60 experts, top-4, a gated shared expert), "
                    "random weights; for GPU runs, never built in CI",
    ))
    entries.append(ZooModel(
        name="tiny-mixtral",
        config_class=MixtralConfig,
        config_kwargs={**_TINY_SHAPE, **_TINY_MIXTRAL, "tie_word_embeddings": False},
        description=f"tiny Mixtral (4 experts of width 128, top-2), untied lm_head, vocab {TINY_VOCAB_SIZE}",
    ))
    entries.append(ZooModel(
        name="tiny-gemma3",
        config_class=Gemma3TextConfig,
        config_kwargs={**{k: v for k, v in _TINY_SHAPE.items() if k not in ("hidden_act", "rope_parameters")},
                       **_TINY_GEMMA3, "tie_word_embeddings": True},
        description="tiny Gemma 3 text (zero-centered norms, embedding scale, 3 sliding-window layers of 8 keys "
                    "+ 1 global, local/global RoPE bases, query_pre_attn_scalar 24, QK-norm, post-norms, GeGLU-tanh), "
                    f"tied lm_head/embed_tokens, vocab {TINY_VOCAB_SIZE}",
    ))
    entries.append(ZooModel(
        name="gemma3-shape",
        config_class=Gemma3TextConfig,
        config_kwargs=_GEMMA3_1B_SHAPE,
        description="gemma-3-1b's text dims (vocab 262144), 4 of its layers, random weights; config only in CI",
    ))
    entries.append(ZooModel(
        name="tiny-gpt-oss",
        config_class=GptOssConfig,
        config_kwargs=_TINY_GPT_OSS,
        description="tiny gpt-oss (attention sinks, sliding window 8 on every other layer, YaRN, q/k/v/o "
                    "biases; 4 square experts with biases and a clamped SwiGLU, top-2), untied lm_head, "
                    f"vocab {TINY_VOCAB_SIZE}",
        adjust_weights=_gpt_oss_weights,
    ))
    entries.append(ZooModel(
        name="gpt-oss-shape",
        config_class=GptOssConfig,
        config_kwargs=_GPT_OSS_20B_SHAPE,
        description="gpt-oss-20b architecture (4 of its 24 layers), random weights; config checks only",
    ))
    entries.append(ZooModel(
        name="qwen3-0.6b-shape",
        config_class=Qwen3Config,
        config_kwargs=_QWEN3_0P6B_SHAPE,
        description="Qwen3-0.6B architecture (tied), random weights; for GPU runs",
    ))
    entries.append(ZooModel(
        name="qwen3-8b-shape",
        config_class=Qwen3Config,
        config_kwargs=_QWEN3_8B_SHAPE,
        description=f"Qwen3-8B architecture at {SHAPE_LAYERS} layers (untied), random weights; for GPU runs",
    ))
    entries.append(ZooModel(
        name="qwen3-30b-a3b-shape",
        config_class=Qwen3MoeConfig,
        config_kwargs=_QWEN3_30B_A3B_SHAPE,
        description=f"Qwen3-30B-A3B architecture at {SHAPE_LAYERS} layers (128 experts, top-8), random weights; "
                    "for GPU runs",
    ))
    entries.extend(_vllm_twins({entry.name: entry for entry in entries}))
    return {entry.name: entry for entry in sorted(entries, key=lambda e: e.name)}


# Issue 37's families on vLLM's CPU tier (suites/rollout/test_vllm_families.py), twin -> (tiny model, changes):
# head_dim 32, the smallest head vLLM's CPU attention takes, everything else as the tiny model. vLLM's
# Qwen2-MoE ignores config.head_dim (hidden // heads), so its twin is 128 wide (4 heads of 32, as HF computes).
# DeepSeek-V3's MLA runs on vLLM's CPU MLA kernel, whose only latent head is 576 (kv_lora_rank 512 + rope 64,
# DeepSeek-V3's own); vLLM also reads the router from config keys transformers 5 does not write, which HF and
# the bridges ignore: topk_method "noaux_tc" (the expert bias: without it vLLM 0.32.0's load stops on a KeyError
# for e_score_correction_bias) and scoring_func "sigmoid" (its default is softmax). tiny-moonlight's twin keeps its
# plain RoPE (vLLM's CPU rotary op needs harness.compat.vllm `cpu-rope-3d-query` for it) and takes
# rms_norm_eps 1e-4: with Moonlight's 1e-5 the latent norm's epsilon
# (harness.compat.vllm `mla-norm-eps-like-hf`) moved vLLM's logprobs 2.1x the weight-sync bound, under the
# sensitivity margin. Each twin keeps its family's stacks and weight adjustment.
VLLM_CPU_TWINS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-qwen2-moe-hd32": ("tiny-qwen2-moe", {"head_dim": 32, "hidden_size": 128}),
    "tiny-glm4-moe-hd32": ("tiny-glm4-moe", {"head_dim": 32}),
    "tiny-gpt-oss-hd32": ("tiny-gpt-oss", {"head_dim": 32}),
    "tiny-gemma3-hd32": ("tiny-gemma3", {"head_dim": 32}),
    "tiny-deepseek-v3-mla576": ("tiny-deepseek-v3", {"kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                                     "topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
    "tiny-moonlight-mla576": ("tiny-moonlight", {"kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                                 "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                                                 "rms_norm_eps": 1e-4}),
}


def _vllm_twins(entries: dict[str, ZooModel]) -> list[ZooModel]:
    twins = []
    for name, (base_name, changes) in VLLM_CPU_TWINS.items():
        base = entries[base_name]
        what = ", ".join(f"{key} {value}" for key, value in changes.items())
        twins.append(ZooModel(
            name=name, config_class=base.config_class, config_kwargs={**base.config_kwargs, **changes},
            description=f"{base.description}; {what} (vLLM's CPU kernels)", adjust_weights=base.adjust_weights))
    return twins


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
    if config.model_type in ZERO_CENTERED_NORMS:
        _zero_center_norms(model)
    if ZOO[str(name_or_path)].adjust_weights is not None:
        ZOO[str(name_or_path)].adjust_weights(model)
    return model.to(dtype).eval()


# Families whose RMSNorm scales by (1 + w) (HF's Gemma3RMSNorm): a stored w of 0 is the identity.
ZERO_CENTERED_NORMS = ("gemma3_text",)


@torch.no_grad()
def _zero_center_norms(model: PreTrainedModel) -> None:
    """w -= 1 for every norm weight (1-D, named *norm.weight): randomize_weights draws a norm's scale
    ~ 1 + 0.1 N(0, 1), which a zero-centered norm computes as 1 + w; the scales stay those draws, and
    w itself is the nonzero 0.1 N(0, 1)."""
    for name, param in model.named_parameters():
        if param.dim() == 1 and name.endswith("norm.weight"):
            param.sub_(1.0)


def checkpoint_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """`model`'s weights under the names its checkpoint stores (detached copies): transformers 5 holds a
    MoE layer's experts fused (`mlp.experts.gate_up_proj` [experts, 2 x width, hidden]) and writes them
    per expert (`mlp.experts.<e>.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.<e>.w1.weight`),
    which is what the bridges read and export. Dense models: their state dict as it is."""
    return as_checkpoint_tensors(model, {name: tensor.detach().clone() for name, tensor in model.state_dict().items()})


def as_checkpoint_tensors(model: PreTrainedModel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors named and shaped as `model`'s parameters (its weights, or their gradients) under its
    checkpoint's names (checkpoint_state_dict): the fused experts split per expert."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(tensors)))
