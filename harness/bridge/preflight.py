"""Is an HF model one the bridge converts faithfully? Answered in the parent, before any rank starts.

Parent-side: needs transformers and safetensors only (no Megatron, no mbridge, no torch.distributed).
`check_model_supported` is the one gate every entry point calls first (`mrh parity`,
`harness.parity.runner.prepare_model`, `harness.parallel.state.run_in_layout(model=...)`); the
bridge repeats `check_hf_config` and checks the tensors it really uses inside each rank as a second
guard (`harness.bridge.mbridge_compat.make_bridge`, `harness.bridge.load`).

What is refused, and why each would otherwise go wrong without an error:
- model types other than llama/qwen2/qwen3 and the MoE qwen3_moe/qwen2_moe/mixtral (only their
  mappings are checked against HF); Megatron-Bridge 0.6.2 converts neither Mixtral nor Qwen2-MoE (it has
  no bridge for either: refused by name there, `BRIDGE_MODEL_TYPES`);
- MoE features the bridges do not build: dense layers between sparse ones (Qwen3-MoE and Qwen2-MoE
  `mlp_only_layers`, `decoder_sparse_step` != 1: neither bridge sets `moe_layer_freq`), top-k
  probabilities left unnormalised (Qwen3-MoE `norm_topk_prob=False`: Megatron's softmax router
  renormalises over the top k) and the converse (Qwen2-MoE `norm_topk_prob=True`: mbridge's
  Qwen2MoEBridge routes with `moe_router_pre_softmax=True`, a softmax over every expert and no
  renormalisation), a Qwen2-MoE without its shared expert or its q/k/v biases (mbridge builds both),
  router jitter noise (Mixtral `router_jitter_noise`: random routing in training), HF's load-balancing
  loss (`output_router_logits=True`: not megatron-core's per-layer aux loss);
- GLM-4.5-MoE (glm4_moe; mbridge's GLM4MoEBridge, and Megatron-Bridge 0.6.2's GLM45Bridge with a
  workaround, harness.compat.megatron_bridge) where the bridges and megatron-core would compute otherwise
  than HF's Glm4MoeForCausalLM (`_unsupported_glm4_moe`): group-limited routing (n_group or topk_group
  != 1: mbridge sets no moe_router_num_groups; the published GLM-4.5 configs have 1 and 1), more or
  fewer than one shared expert (both bridges size the shared expert moe_intermediate_size, one expert),
  unnormalised top-k scores (megatron-core's sigmoid router renormalises them) or top-1 (megatron-core
  does not renormalise one score, HF does), no q/k/v biases (mbridge always builds them), every layer
  dense. MTP layers (`num_nextn_predict_layers`) are ignored explicitly, as HF's causal LM ignores them:
  neither side computes them, and their checkpoint tensors (`model.layers.<num_hidden_layers + i>.*`) are
  not loaded (`glm4_moe_mtp_layers`);
- DeepSeek-V3 (both bridges; Megatron-Bridge since issue 37's stack-B port): a router megatron-core cannot reproduce (norm_topk_prob=False, a group
  score other than HF's top 2, n_group not dividing the experts), no shared experts,
  plain-halves RoPE, MTP layers, an FP8-quantised checkpoint, a YaRN without every value megatron-core
  takes (`_yarn_values`); MLA's TP splits are layout checks (`harness.parallel.layout`). The query is either
  DeepSeek-V3's low-rank one or (q_lora_rank None: Moonlight) one q_proj, the checkpoint's tensors checked
  against the config's (`_deepseek_v3_tensor_names`);
- hidden_act other than silu (mbridge always builds SwiGLU);
- sliding-window attention (Megatron's local spec attends to the full causal context), but Gemma 3's;
- Gemma 3 text (`gemma3_text`, built by the harness's own pieces on mbridge, harness.bridge.gemma3):
  an activation other than gelu-tanh, attention or final logit soft-capping, bidirectional attention,
  attention biases, layer types other than sliding/full, a missing window, a local RoPE other than
  default, and (`rope_settings`) a global RoPE other than default/llama3 (gemma-3-4b and larger scale
  theirs linearly: refused); on Megatron-Bridge 0.6.2 refused by name (`BRIDGE_REFUSAL_REASONS`);
- RoPE types other than default and llama3, and partial rotary but GLM-4.5-MoE's (mbridge maps neither
  elsewhere; GLM's `partial_rotary_factor` becomes megatron-core's `rotary_percent`, `RopeSettings.rotary_percent`);
- biases Megatron has no slot for: Llama `attention_bias` (its o_proj bias) and `mlp_bias`, Qwen3
  `attention_bias` (the bridges build no bias but Qwen2's q/k/v one);
- a checkpoint whose tensors are not exactly the ones the Megatron model loads (an extra tensor
  would be dropped, a missing one fails deep inside a rank);
- gpt-oss (issue 37): on mbridge, by name (`BRIDGE_REFUSAL_REASONS`: mbridge 0.15.1 has no gpt-oss bridge); on
  Megatron-Bridge 0.6.2 what its GPTOSSBridge builds otherwise than HF: no attention biases (it always
  builds them), a sliding-window pattern other than HF's default alternation from layer 0
  (`window_attn_skip_freq=2`), no window, a rope type other than YaRN or a YaRN other than the one it
  hard-codes (`GPT_OSS_BRIDGE_YARN`). Its sliding window, sinks, biases and YaRN are built (the checks
  above that refuse them for the other families let gpt_oss through).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "gemma3_text", "glm4_moe", "deepseek_v3")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3")
# What each bridge converts: Megatron-Bridge 0.6.2 has no Mixtral bridge ("Model architecture
# 'MixtralForCausalLM' is not yet supported") and no Qwen2-MoE one (nothing in megatron.bridge.models
# registers Qwen2MoeForCausalLM; its qwen package has Qwen2, Qwen3, Qwen3-MoE, Qwen3-Next, Qwen3.5).
# GLM-4.5-MoE (issue 37): mbridge's GLM4MoEBridge (override 14) and Megatron-Bridge's GLM45Bridge (its routed
# experts' SequentialMLP names added: harness.compat.megatron_bridge.GLM45_LOCAL_EXPERTS).
# DeepSeek-V3 (issue 37): mbridge's DeepseekV3Bridge (overrides 15-17) and Megatron-Bridge's DeepSeekV3Bridge (MLA's
# local core attention and rope-key gradient from harness.compat.megatron_core, the router settings of override 16:
# harness.bridge.backends.megatron_bridge).
BRIDGE_MODEL_TYPES = {"mbridge": SUPPORTED_MODEL_TYPES,
                      "megatron-bridge": ("llama", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3")}
# Why a bridge refuses a family it has a bridge class for (appended to the refusal).
BRIDGE_REFUSAL_REASONS = {
    ("megatron-bridge", "gemma3_text"): "Megatron-Bridge 0.6.2's Gemma3ModelBridge builds Transformer Engine "
    "modules only (TELayerNormColumnParallelLinear, Gemma3TEDotProductAttention for the sliding window, "
    "TERowParallelLinearLayerNorm for the post-norms) and picks local layers by a fixed (5, 1) pattern, not "
    "the checkpoint's layer_types; the harness's own Gemma 3 pieces (harness.bridge.gemma3) run on mbridge",
    ("mbridge", "gpt_oss"): "mbridge 0.15.1 has no gpt_oss bridge: nothing maps GptOssForCausalLM (attention "
                            "sinks, alternating sliding window, clamped SwiGLU, expert biases, YaRN) onto "
                            "megatron-core 0.16.1's softmax_type/window_size/activation_func_clamp_value; run "
                            "it on stack B (--mrh-bridge=megatron-bridge: Megatron-Bridge 0.6.2's GPTOSSBridge)",
}
# gpt-oss (issue 37): Megatron-Bridge 0.6.2 only (its GPTOSSBridge). mbridge 0.15.1 registers no gpt_oss
# bridge (mbridge.models: llama, qwen2, qwen3, qwen2moe, qwen3moe, mixtral, deepseek_v3, glm4moe, gemma3,
# mimo and VL models); megatron-core 0.16.1 itself has the pieces (softmax_type="learnable",
# window_size, activation_func_clamp_value, glu_linear_offset, YaRN) but nothing maps GptOssForCausalLM
# onto them there. The mbridge entry keeps the tuple it was given above.
SUPPORTED_MODEL_TYPES += ("gpt_oss",)
MOE_MODEL_TYPES += ("gpt_oss",)
BRIDGE_MODEL_TYPES["megatron-bridge"] += ("gpt_oss",)
SUPPORTED_ROPE_TYPES = ("default", "llama3")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# HF checkpoints sometimes carry tensors that are not model weights.
NOT_WEIGHTS = ("rotary_emb.inv_freq",)


class UnsupportedModelError(ValueError):
    """The HF config or checkpoint describes something the bridge would not convert faithfully."""


@dataclass(frozen=True)
class RopeSettings:
    """What Megatron's RotaryEmbedding needs to reproduce HF's inv_freq."""

    theta: float
    llama3: Mapping[str, float] | None = None  # LLAMA3_ROPE_KEYS -> value, for rope_type llama3
    yarn: Mapping[str, Any] | None = None  # YARN_ROPE_KEYS -> value, for gpt-oss's rope_type yarn
    rotary_percent: float = 1.0  # the rotated fraction of each head (GLM-4.5-MoE's partial_rotary_factor)


# Partial rotary (RoPE on the first `partial_rotary_factor` of each head, the rest passed through): GLM-4.5-MoE
# only, where HF and megatron-core's `rotary_percent` rotate the same dims (the first ones, rotate-half pairs).
PARTIAL_ROTARY_MODEL_TYPES = ("glm4_moe",)


# YaRN (DeepSeek-V3 only: megatron-core's MLA builds YarnRotaryEmbedding; its dense attention has none).
# megatron-core needs every value (mbridge fills a missing one with its own default, where HF's default
# differs: without mscale_all_dim HF applies no softmax mscale and scales cos/sin by 0.1 ln(factor) + 1,
# megatron-core multiplies the softmax scale by mscale(factor, 1)^2 and leaves cos/sin as they are).
YARN_ROPE_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                  "mscale_all_dim")
YARN_MODEL_TYPES = ("deepseek_v3",)


def rope_parameters(hf_config: PretrainedConfig) -> dict[str, Any]:
    # transformers 5: rope_parameters (rope_scaling is an alias of it); 4: rope_scaling or None.
    return dict(getattr(hf_config, "rope_parameters", None)
                or getattr(hf_config, "rope_scaling", None) or {})


def rope_settings(hf_config: PretrainedConfig) -> RopeSettings:
    """The RoPE base and Llama-3 scaling; raises for RoPE variants the bridge would not reproduce.
    Gemma 3: its global layers' (`rope_parameters["full_attention"]`; the local ones are checked by
    check_hf_config)."""
    params = rope_parameters(hf_config)
    if hf_config.model_type == GEMMA3:
        params = dict(params.get("full_attention") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "yarn" and hf_config.model_type == "gpt_oss":
        return _gpt_oss_yarn(hf_config, params)
    if rope_type == "yarn" and hf_config.model_type in YARN_MODEL_TYPES:
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
        if theta is None:
            raise UnsupportedModelError("the HF config has no rope_theta (in rope_parameters or top level)")
        return RopeSettings(float(theta), yarn=_yarn_values(params))
    if hf_config.model_type in YARN_MODEL_TYPES and rope_type != "default":
        raise UnsupportedModelError(f"{hf_config.model_type}: rope type {rope_type!r} is not supported (supported: "
                                    "default, yarn): megatron-core's MLA builds only those")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}): "
            "the bridge would build another RoPE and silently differ from HF")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0) and hf_config.model_type not in PARTIAL_ROTARY_MODEL_TYPES:
        raise UnsupportedModelError(f"partial_rotary_factor {partial}: mbridge rotates the whole head")
    rotary_percent = _rotary_percent(hf_config, partial)
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("the HF config has no rope_theta (in rope_parameters or top level)")
    if rotary_percent != 1.0 and rope_type != "default":
        raise UnsupportedModelError(f"partial_rotary_factor {partial} with rope type {rope_type!r}: only the "
                                    "default RoPE is built on part of the head")
    if rope_type == "default":
        return RopeSettings(float(theta), rotary_percent=rotary_percent)
    return RopeSettings(float(theta), _llama3_values(params))


def _rotary_percent(hf_config: PretrainedConfig, partial: Any) -> float:
    """GLM-4.5-MoE's partial_rotary_factor as megatron-core's rotary_percent: HF rotates
    int(head_dim x factor) dims, megatron-core int(kv_channels x rotary_percent); both need an even count."""
    if partial in (None, 1, 1.0):
        return 1.0
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if not isinstance(partial, (int, float)) or not 0 < partial < 1 or (head_dim * partial) % 2:
        raise UnsupportedModelError(f"partial_rotary_factor {partial} with head_dim {head_dim}: the rotated dims "
                                    "must be a positive even number below head_dim")
    return float(partial)


def _llama3_values(params: Mapping[str, Any]) -> dict[str, float]:
    missing = [key for key in LLAMA3_ROPE_KEYS if params.get(key) is None]
    if missing:
        raise UnsupportedModelError(f"rope type 'llama3' needs {', '.join(missing)} in rope_parameters")
    values = {key: params[key] for key in LLAMA3_ROPE_KEYS}
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values.values()):
        raise UnsupportedModelError(f"rope type 'llama3': every parameter must be a positive number, got {values}")
    if values["high_freq_factor"] <= values["low_freq_factor"]:
        # HF's smoothing divides by (high - low): equal values give NaN inv_freq.
        raise UnsupportedModelError(
            f"rope type 'llama3': high_freq_factor {values['high_freq_factor']} must exceed "
            f"low_freq_factor {values['low_freq_factor']}")
    return values


# gpt-oss's YaRN as Megatron-Bridge 0.6.2's GPTOSSBridge.provider_bridge hard-codes it (yarn_* on the
# provider: factor 32 over 4096 positions, beta 32/1, correction range not rounded, mscale from the
# factor alone), whatever the checkpoint's rope_parameters say: another YaRN is refused.
GPT_OSS_BRIDGE_YARN = {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                       "truncate": False, "mscale": None, "mscale_all_dim": None}


def _gpt_oss_yarn(hf_config: PretrainedConfig, params: Mapping[str, Any]) -> RopeSettings:
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor {partial}: the bridge rotates the whole head")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("the HF config has no rope_theta (in rope_parameters or top level)")
    missing = [key for key in ("factor", "original_max_position_embeddings") if params.get(key) is None]
    if missing:
        raise UnsupportedModelError(f"rope type 'yarn' needs {', '.join(missing)} in rope_parameters")
    if params.get("attention_factor") is not None:
        raise UnsupportedModelError(f"rope type 'yarn' with an explicit attention_factor {params['attention_factor']}: "
                                    "megatron-core derives it from the factor and mscale (none to set it to)")
    # HF's defaults where the checkpoint leaves them out (modeling_rope_utils._compute_yarn_parameters).
    values = {"factor": params.get("factor"),
              "original_max_position_embeddings": params.get("original_max_position_embeddings"),
              "beta_fast": params.get("beta_fast") or 32.0, "beta_slow": params.get("beta_slow") or 1.0,
              "truncate": bool(params.get("truncate", True)),
              "mscale": params.get("mscale"), "mscale_all_dim": params.get("mscale_all_dim")}
    differ = {k: v for k, v in values.items() if v != GPT_OSS_BRIDGE_YARN[k]}
    if differ:
        raise UnsupportedModelError(
            f"rope type 'yarn' with {differ}: Megatron-Bridge 0.6.2's GPTOSSBridge hard-codes gpt-oss's YaRN "
            f"({GPT_OSS_BRIDGE_YARN}) whatever the checkpoint says")
    return RopeSettings(float(theta), yarn=values)


def _gpt_oss_unsupported(hf_config: PretrainedConfig) -> list[str]:
    """What Megatron-Bridge 0.6.2's GPTOSSBridge builds otherwise than HF for a gpt_oss config."""
    found = []
    if not getattr(hf_config, "attention_bias", True):
        found.append("attention_bias=False: GPTOSSBridge always builds q/k/v/o biases (add_bias_linear)")
    window = getattr(hf_config, "sliding_window", None)
    layers = hf_config.num_hidden_layers
    alternating = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not window or window < 1:
        found.append(f"sliding_window={window}: GPTOSSBridge always builds window_size (sliding_window - 1, 0)")
    if list(getattr(hf_config, "layer_types", None) or alternating) != alternating:
        found.append(f"layer_types {hf_config.layer_types}: GPTOSSBridge builds the sliding window on layers "
                     "0, 2, 4, ... and full attention on 1, 3, 5, ... (window_attn_skip_freq=2), HF's default")
    rope_type = rope_parameters(hf_config).get("rope_type", "default")
    if rope_type != "yarn":
        found.append(f"rope type {rope_type!r}: GPTOSSBridge always builds YaRN")
    return found


def _yarn_values(params: Mapping[str, Any]) -> dict[str, float]:
    missing = [key for key in YARN_ROPE_KEYS if params.get(key) is None]
    if missing:
        raise UnsupportedModelError(
            f"rope type 'yarn' needs {', '.join(missing)} in rope_parameters (megatron-core's YaRN takes each; "
            "mbridge would fill in its own default, where HF's differs)")
    if params.get("attention_factor") is not None:
        raise UnsupportedModelError("rope type 'yarn': an explicit attention_factor (megatron-core derives it "
                                    "from mscale and mscale_all_dim)")
    if params.get("truncate", True) is not True:
        raise UnsupportedModelError("rope type 'yarn' with truncate=False (megatron-core rounds the correction "
                                    "range out to whole dimensions)")
    values = {key: params[key] for key in YARN_ROPE_KEYS}
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values.values()):
        raise UnsupportedModelError(f"rope type 'yarn': every parameter must be a positive number, got {values}")
    return values


def _unsupported_deepseek_v3(hf_config: PretrainedConfig) -> list[str]:
    """What mbridge 0.15.1's DeepseekV3Bridge with megatron-core 0.16.1 (the harness's overrides 15 and 16
    included), or Megatron-Bridge 0.6.2's DeepSeekV3Bridge with megatron-core 0.19.2 (the same router settings),
    would build otherwise than HF's DeepseekV3ForCausalLM."""
    found = []
    experts, top_k = hf_config.n_routed_experts, hf_config.num_experts_per_tok
    groups, group_top_k = getattr(hf_config, "n_group", None) or 1, getattr(hf_config, "topk_group", None) or 1
    if not getattr(hf_config, "norm_topk_prob", True):
        found.append("norm_topk_prob=False: megatron-core's sigmoid router renormalises the top-k scores")
    if experts % groups:
        found.append(f"n_group={groups} does not divide n_routed_experts={experts}")
    elif groups > 1 and group_top_k < groups and top_k != 2 * group_top_k:
        found.append(f"num_experts_per_tok={top_k} with topk_group={group_top_k}: megatron-core scores a group by "
                     f"its top num_experts_per_tok // topk_group experts, HF by its top 2 (they agree only where "
                     "num_experts_per_tok = 2 x topk_group)")
    if not getattr(hf_config, "n_shared_experts", None):
        found.append(f"n_shared_experts={getattr(hf_config, 'n_shared_experts', None)}: the harness's DeepSeek-V3 "
                     "has shared experts (mbridge sizes them moe_intermediate_size x n_shared_experts)")
    if not getattr(hf_config, "rope_interleave", True):
        found.append("rope_interleave=False: megatron-core's MLA always rotates DeepSeek's interleaved pairs")
    if getattr(hf_config, "quantization_config", None):
        found.append("an FP8-quantised checkpoint (quantization_config): the harness reads unquantised weights")
    if getattr(hf_config, "num_nextn_predict_layers", None):
        found.append(f"num_nextn_predict_layers={hf_config.num_nextn_predict_layers} (MTP): HF computes no MTP "
                     "layer, and mbridge maps one only for the 61-layer checkpoint")
    return found


def _unsupported_biases(hf_config: PretrainedConfig) -> list[str]:
    model_type = hf_config.model_type
    if model_type == "gpt_oss":  # q/k/v/o and expert biases: the bridge builds them (_gpt_oss_unsupported)
        return []
    found = []
    if model_type not in ("qwen2", "glm4_moe") and getattr(hf_config, "attention_bias", False):
        what = "o_proj" if model_type == "llama" else "q/k/v/o_proj"
        found.append(f"attention_bias=True ({what} biases: Megatron's layers here have none)")
    if model_type == "llama" and getattr(hf_config, "mlp_bias", False):
        found.append("mlp_bias=True (gate/up/down_proj biases: Megatron's MLP here has none)")
    return found


GEMMA3 = "gemma3_text"
GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")


def _unsupported_gemma3(hf_config: PretrainedConfig) -> list[str]:
    """What the harness's Gemma 3 text pieces (harness.bridge.gemma3) do not build."""
    found = []
    if getattr(hf_config, "hidden_activation", None) != "gelu_pytorch_tanh":
        found.append(f"hidden_activation {getattr(hf_config, 'hidden_activation', None)!r}: the bridge builds "
                     "GeGLU with gelu-tanh (gelu_pytorch_tanh)")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(hf_config, name, None) is not None:
            found.append(f"{name}={getattr(hf_config, name)}: soft-capping is not built (no Gemma 3 checkpoint "
                         "sets it; Gemma 2's)")
    if getattr(hf_config, "use_bidirectional_attention", False):
        found.append("use_bidirectional_attention=True: the bridge builds causal attention")
    if getattr(hf_config, "attention_bias", False):
        found.append("attention_bias=True: Megatron's layers here have no q/k/v/o biases")
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    if len(layer_types) != hf_config.num_hidden_layers or set(layer_types) - set(GEMMA3_LAYER_TYPES):
        found.append(f"layer_types {layer_types}: one of {', '.join(GEMMA3_LAYER_TYPES)} per layer")
    window = getattr(hf_config, "sliding_window", None)
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window >= 1):
        found.append(f"sliding_window={window}: sliding-window layers need a window of >= 1 keys")
    local = dict(rope_parameters(hf_config).get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default" or local.get("rope_theta") is None:
        found.append(f"local RoPE {local}: the bridge builds the default RoPE with a rope_theta on local layers")
    return found


def _unsupported_moe(hf_config: PretrainedConfig) -> list[str]:
    found = []
    if hf_config.model_type in ("qwen3_moe", "qwen2_moe"):
        if getattr(hf_config, "mlp_only_layers", None) or getattr(hf_config, "decoder_sparse_step", 1) != 1:
            found.append(f"dense layers between the sparse ones (mlp_only_layers={hf_config.mlp_only_layers}, "
                         f"decoder_sparse_step={hf_config.decoder_sparse_step}): the bridges build every layer sparse")
    if hf_config.model_type == "qwen3_moe" and not getattr(hf_config, "norm_topk_prob", True):
        found.append("norm_topk_prob=False: Megatron's softmax router renormalises the top-k probabilities")
    if hf_config.model_type == "qwen2_moe":
        if getattr(hf_config, "norm_topk_prob", False):
            found.append("norm_topk_prob=True: mbridge's Qwen2MoEBridge routes with moe_router_pre_softmax=True "
                         "(the top k of a softmax over every expert, not renormalised)")
        shared = getattr(hf_config, "shared_expert_intermediate_size", None)
        if not shared:
            found.append(f"shared_expert_intermediate_size={shared}: mbridge's Qwen2MoEBridge always builds the "
                         "shared expert")
        if not getattr(hf_config, "qkv_bias", True):
            found.append("qkv_bias=False: mbridge's Qwen2MoEBridge always builds q/k/v biases")
    if hf_config.model_type == "glm4_moe":
        found += _unsupported_glm4_moe(hf_config)
    if hf_config.model_type == "deepseek_v3":
        found += _unsupported_deepseek_v3(hf_config)
    if getattr(hf_config, "output_router_logits", False):
        found.append("output_router_logits=True (HF trains with its load-balancing loss over every layer at "
                     "once; megatron-core's aux loss is per layer, another loss: the harness trains MoE models "
                     "without one, MOE_TRAINING_SETTINGS)")
    if hf_config.model_type == "gpt_oss":
        found += _gpt_oss_unsupported(hf_config)
    if hf_config.model_type == "mixtral" and getattr(hf_config, "router_jitter_noise", 0.0):
        found.append(f"router_jitter_noise={hf_config.router_jitter_noise}: Megatron's router adds no jitter")
    return found


def _unsupported_glm4_moe(hf_config: PretrainedConfig) -> list[str]:
    """What mbridge 0.15.1's GLM4MoEBridge (with the harness's override 14) and Megatron-Bridge 0.6.2's
    GLM45Bridge would build otherwise than HF's Glm4MoeForCausalLM."""
    found = []
    groups, group_top_k = getattr(hf_config, "n_group", 1), getattr(hf_config, "topk_group", 1)
    if (groups, group_top_k) != (1, 1):
        found.append(f"n_group={groups}, topk_group={group_top_k}: mbridge's GLM4MoEBridge sets no "
                     "moe_router_num_groups, and the harness builds GLM without groups (GLM-4.5's configs have 1, 1)")
    if getattr(hf_config, "n_shared_experts", None) != 1:
        found.append(f"n_shared_experts={getattr(hf_config, 'n_shared_experts', None)}: both bridges build one "
                     "shared expert of width moe_intermediate_size")
    if not getattr(hf_config, "norm_topk_prob", True):
        found.append("norm_topk_prob=False: megatron-core's sigmoid router renormalises the top-k scores")
    if hf_config.num_experts_per_tok < 2:
        found.append(f"num_experts_per_tok={hf_config.num_experts_per_tok}: megatron-core's sigmoid router does "
                     "not renormalise a single score, HF does")
    if not getattr(hf_config, "attention_bias", False):
        found.append("attention_bias=False: mbridge's GLM4MoEBridge always builds q/k/v biases")
    if getattr(hf_config, "first_k_dense_replace", 0) >= hf_config.num_hidden_layers:
        found.append(f"first_k_dense_replace={hf_config.first_k_dense_replace} makes every one of the "
                     f"{hf_config.num_hidden_layers} layers dense")
    return found


def glm4_moe_mtp_layers(hf_config: PretrainedConfig) -> range:
    """The layer indices of GLM-4.5-MoE's MTP modules in its checkpoint (after the decoder's layers): HF's
    causal LM computes none (transformers ignores their tensors on load), nor does the harness (mbridge's
    GLM4MoEBridge sets no mtp_num_layers): ignored explicitly, never loaded, never exported."""
    if getattr(hf_config, "model_type", None) != "glm4_moe":
        return range(0)
    layers = hf_config.num_hidden_layers
    return range(layers, layers + int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0))


# What both bridges set on a MoE model, whatever they default to (mbridge: no load balancing;
# Megatron-Bridge's Qwen3-MoE provider: an aux loss of 0.001, which moved the trained weights 1.8e-3
# off HF's): what HF trains with when `output_router_logits` is off, no load-balancing loss.
MOE_TRAINING_SETTINGS = {"moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": None}


def num_experts(hf_config: PretrainedConfig) -> int:
    """The routed experts of a MoE config (0 for a dense one)."""
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
               or getattr(hf_config, "n_routed_experts", None) or 0) \
        if hf_config.model_type in MOE_MODEL_TYPES else 0


def bridge_converts(model: str | os.PathLike | PretrainedConfig) -> bool:
    """Whether this process's bridge (harness.bridge.backends.current) converts `model`'s family (a
    zoo name, a checkpoint dir or a config): Megatron-Bridge 0.6.2 has no Mixtral."""
    from harness.bridge.backends import current

    if not isinstance(model, PretrainedConfig):
        from harness.models import load_hf_config

        model = load_hf_config(model)
    return model.model_type in BRIDGE_MODEL_TYPES[current()]


def _check_model_type(model_type: str | None) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by the harness bridge "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    from harness.bridge.backends import BridgeChoiceError, current

    try:
        bridge = current()
    except BridgeChoiceError:  # no bridge here at all: the rank side says so when it builds
        return
    if model_type not in BRIDGE_MODEL_TYPES[bridge]:
        reason = BRIDGE_REFUSAL_REASONS.get((bridge, model_type))
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by the {bridge} bridge "
            f"(it converts: {', '.join(BRIDGE_MODEL_TYPES[bridge])})" + (f": {reason}" if reason else ""))


def check_hf_config(hf_config: PretrainedConfig) -> RopeSettings:
    """Raise UnsupportedModelError for a config feature the Megatron side would drop silently."""
    model_type = hf_config.model_type
    _check_model_type(model_type)
    if model_type == GEMMA3:
        gemma = _unsupported_gemma3(hf_config)
        if gemma:
            raise UnsupportedModelError(f"{model_type}: {'; '.join(gemma)}")
        return rope_settings(hf_config)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf_config.hidden_act!r}: mbridge builds SwiGLU (silu)")
    layer_types = set(getattr(hf_config, "layer_types", None) or ["full_attention"])
    if model_type == "gpt_oss":  # its alternating sliding window is built (_gpt_oss_unsupported checks it)
        layer_types = {"full_attention"}
    if getattr(hf_config, "use_sliding_window", False) or layer_types != {"full_attention"}:
        raise UnsupportedModelError(
            f"sliding-window attention is not supported (layer types {sorted(layer_types)}, "
            f"use_sliding_window={getattr(hf_config, 'use_sliding_window', False)})")
    biases = _unsupported_biases(hf_config)
    if biases:
        raise UnsupportedModelError(f"{model_type}: {'; '.join(biases)}")
    moe = _unsupported_moe(hf_config)
    if moe:
        raise UnsupportedModelError(f"{model_type}: {'; '.join(moe)}")
    return rope_settings(hf_config)


def expected_tensor_names(hf_config: PretrainedConfig) -> set[str]:
    """The HF tensor names the bridge's Megatron model loads for `hf_config` (a checked config)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not getattr(hf_config, "tie_word_embeddings", False):
        names.add("lm_head.weight")
    if hf_config.model_type == "glm4_moe":
        return _glm4_moe_tensor_names(hf_config, names)
    if hf_config.model_type == "deepseek_v3":
        return _deepseek_v3_tensor_names(hf_config, names)
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}_proj.weight" for p in "qkvo")]
    if hf_config.model_type == GEMMA3:  # the norms before and after the MLP, QK-norm
        per_layer += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
                      "self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    experts = range(num_experts(hf_config))
    if hf_config.model_type in ("qwen3_moe", "qwen2_moe"):
        per_layer += ["mlp.gate.weight",
                      *(f"mlp.experts.{e}.{p}_proj.weight" for e in experts for p in ("gate", "up", "down"))]
        if hf_config.model_type == "qwen2_moe":  # the shared expert and its sigmoid gate
            per_layer += [*(f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")),
                          "mlp.shared_expert_gate.weight"]
    elif hf_config.model_type == "gpt_oss":  # fused experts (as HF stores them), biases, sinks
        per_layer += ["mlp.router.weight", "mlp.router.bias", "self_attn.sinks", "self_attn.o_proj.bias",
                      *(f"mlp.experts.{p}"
                        for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")),
                      *(f"self_attn.{p}_proj.bias" for p in "qkv")]
    elif hf_config.model_type == "mixtral":
        per_layer += ["block_sparse_moe.gate.weight",
                      *(f"block_sparse_moe.experts.{e}.w{i}.weight" for e in experts for i in (1, 2, 3))]
    else:
        per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    if hf_config.model_type in ("qwen2", "qwen2_moe"):
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if hf_config.model_type in ("qwen3", "qwen3_moe"):
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for layer in range(hf_config.num_hidden_layers):
        names.update(f"model.layers.{layer}.{name}" for name in per_layer)
    return names


def _dense_first_then_routed(hf_config: PretrainedConfig, names: set[str], attention: list[str]) -> set[str]:
    """GLM-4.5-MoE's and DeepSeek-V3's layers: `attention`, then the first first_k_dense_replace layers'
    dense MLP, the rest's router (with its e_score_correction_bias), shared experts and routed experts."""
    dense = [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    sparse = ["mlp.gate.weight", "mlp.gate.e_score_correction_bias",
              *(f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")),
              *(f"mlp.experts.{e}.{p}_proj.weight" for e in range(num_experts(hf_config))
                for p in ("gate", "up", "down"))]
    for layer in range(hf_config.num_hidden_layers):
        mlp = dense if layer < hf_config.first_k_dense_replace else sparse
        names.update(f"model.layers.{layer}.{name}" for name in attention + mlp)
    return names


def _glm4_moe_tensor_names(hf_config: PretrainedConfig, names: set[str]) -> set[str]:
    """GLM-4.5-MoE's: q/k/v biases, QK-norm if on, the first first_k_dense_replace layers dense, the rest
    sparse with the router's e_score_correction_bias and the (ungated) shared expert."""
    attention = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}_proj.weight" for p in "qkvo"), *(f"self_attn.{p}_proj.bias" for p in "qkv")]
    if getattr(hf_config, "use_qk_norm", False):
        attention += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return _dense_first_then_routed(hf_config, names, attention)


def _deepseek_v3_tensor_names(hf_config: PretrainedConfig, names: set[str]) -> set[str]:
    """DeepSeek-V3's: MLA, the first first_k_dense_replace layers dense, the rest sparse with the router's
    e_score_correction_bias and the shared experts. The query is DeepSeek-V3's low-rank one (q_a_proj,
    q_a_layernorm, q_b_proj) or, with q_lora_rank None (Moonlight), one q_proj: a checkpoint holding the
    other's tensors is refused (they would be dropped silently)."""
    query = ("q_proj",) if hf_config.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    attention = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}.weight" for p in (*query, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                                                     "o_proj"))]
    return _dense_first_then_routed(hf_config, names, attention)


def checkpoint_tensor_names(path: Path) -> set[str]:
    """Every tensor name of a safetensors checkpoint dir, from its index or the file headers only."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:  # reads the header, not the data
            names.update(handle.keys())
    return names


def check_checkpoint_tensors(path: Path, hf_config: PretrainedConfig) -> None:
    """The checkpoint holds exactly the tensors the Megatron model loads (a tied model may also
    store lm_head.weight; non-weights such as rotary_emb.inv_freq are ignored)."""
    mtp = tuple(f"model.layers.{layer}." for layer in glm4_moe_mtp_layers(hf_config))  # ignored explicitly
    on_disk = {n for n in checkpoint_tensor_names(path) if not n.endswith(NOT_WEIGHTS) and not n.startswith(mtp)}
    expected = expected_tensor_names(hf_config)
    tolerated = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
    extra = sorted(on_disk - expected - tolerated)
    missing = sorted(expected - on_disk)
    if extra:
        raise UnsupportedModelError(
            f"{path}: checkpoint tensors with no Megatron counterpart (they would be dropped "
            f"silently): {_short(extra)}")
    if missing:
        raise UnsupportedModelError(f"{path}: checkpoint lacks tensors the model needs: {_short(missing)}")


def _short(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _load_config(path: Path) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers validates config.json (KeyError, ValueError, ...)
        reason = " ".join(str(exc).split()) or type(exc).__name__  # one line
        raise UnsupportedModelError(f"{path}/config.json: transformers refuses it: {reason}") from exc


def check_model_supported(model: str | os.PathLike | PretrainedConfig) -> PretrainedConfig:
    """Raise UnsupportedModelError (one line) unless the bridge converts `model` faithfully; return
    its HF config.

    `model` is a zoo name (its config is checked), a local HF checkpoint dir (config and the
    safetensors tensor names, read from the index or the file headers: no weights are loaded), or
    an HF config object. Unknown names and incomplete dirs raise ModelNotFoundError.
    """
    if isinstance(model, PretrainedConfig):
        check_hf_config(model)
        return model
    from harness.models import is_zoo_name, load_hf_config
    from harness.models.checkpoints import check_checkpoint_dir

    if is_zoo_name(model):
        config = load_hf_config(model)
        check_hf_config(config)
        return config
    path = check_checkpoint_dir(Path(model).expanduser())
    _check_model_type(json.loads((path / "config.json").read_text()).get("model_type"))
    config = _load_config(path)
    check_hf_config(config)
    check_checkpoint_tensors(path, config)
    return config
