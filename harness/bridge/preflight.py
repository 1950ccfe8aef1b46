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
- DeepSeek-V3 (mbridge only): a router megatron-core cannot reproduce (norm_topk_prob=False, a group
  score other than HF's top 2, n_group not dividing the experts), no shared experts, no low-rank query,
  plain-halves RoPE, MTP layers, an FP8-quantised checkpoint, a YaRN without every value megatron-core
  takes (`_yarn_values`); MLA's TP splits are layout checks (`harness.parallel.layout`);
- hidden_act other than silu (mbridge always builds SwiGLU);
- sliding-window attention (Megatron's local spec attends to the full causal context);
- RoPE types other than default and llama3, and partial rotary (mbridge maps neither);
- biases Megatron has no slot for: Llama `attention_bias` (its o_proj bias) and `mlp_bias`, Qwen3
  `attention_bias` (the bridges build no bias but Qwen2's q/k/v one);
- a checkpoint whose tensors are not exactly the ones the Megatron model loads (an extra tensor
  would be dropped, a missing one fails deep inside a rank).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
# What each bridge converts: Megatron-Bridge 0.6.2 has no Mixtral bridge ("Model architecture
# 'MixtralForCausalLM' is not yet supported") and no Qwen2-MoE one (nothing in megatron.bridge.models
# registers Qwen2MoeForCausalLM; its qwen package has Qwen2, Qwen3, Qwen3-MoE, Qwen3-Next, Qwen3.5).
# DeepSeek-V3 (issue 37) is converted and tested on mbridge only: on Megatron-Bridge it is refused by name
# (untested there, not claimed).
BRIDGE_MODEL_TYPES = {"mbridge": SUPPORTED_MODEL_TYPES, "megatron-bridge": ("llama", "qwen2", "qwen3", "qwen3_moe")}
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
    yarn: Mapping[str, float] | None = None  # YARN_ROPE_KEYS -> value, for rope_type yarn (DeepSeek-V3's MLA)


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
    """The RoPE base and Llama-3 scaling; raises for RoPE variants the bridge would not reproduce."""
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default"))
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
    if partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor {partial}: mbridge rotates the whole head")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError("the HF config has no rope_theta (in rope_parameters or top level)")
    if rope_type == "default":
        return RopeSettings(float(theta))
    return RopeSettings(float(theta), _llama3_values(params))


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
    """What mbridge 0.15.1's DeepseekV3Bridge with megatron-core 0.16.1 would build otherwise than HF's
    DeepseekV3ForCausalLM (the harness's overrides 13 and 14 included)."""
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
    if getattr(hf_config, "q_lora_rank", None) is None:
        found.append("q_lora_rank=None (a plain q_proj): the harness maps and checks only DeepSeek-V3's "
                     "low-rank query (q_a_proj, q_a_layernorm, q_b_proj)")
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
    found = []
    if model_type != "qwen2" and getattr(hf_config, "attention_bias", False):
        what = "o_proj" if model_type == "llama" else "q/k/v/o_proj"
        found.append(f"attention_bias=True ({what} biases: Megatron's layers here have none)")
    if model_type == "llama" and getattr(hf_config, "mlp_bias", False):
        found.append("mlp_bias=True (gate/up/down_proj biases: Megatron's MLP here has none)")
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
    if hf_config.model_type == "deepseek_v3":
        found += _unsupported_deepseek_v3(hf_config)
    if getattr(hf_config, "output_router_logits", False):
        found.append("output_router_logits=True (HF trains with its load-balancing loss over every layer at "
                     "once; megatron-core's aux loss is per layer, another loss: the harness trains MoE models "
                     "without one, MOE_TRAINING_SETTINGS)")
    if hf_config.model_type == "mixtral" and getattr(hf_config, "router_jitter_noise", 0.0):
        found.append(f"router_jitter_noise={hf_config.router_jitter_noise}: Megatron's router adds no jitter")
    return found


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
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by the {bridge} bridge "
            f"(it converts: {', '.join(BRIDGE_MODEL_TYPES[bridge])})")


def check_hf_config(hf_config: PretrainedConfig) -> RopeSettings:
    """Raise UnsupportedModelError for a config feature the Megatron side would drop silently."""
    model_type = hf_config.model_type
    _check_model_type(model_type)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf_config.hidden_act!r}: mbridge builds SwiGLU (silu)")
    layer_types = set(getattr(hf_config, "layer_types", None) or ["full_attention"])
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
    if hf_config.model_type == "deepseek_v3":
        return _deepseek_v3_tensor_names(hf_config, names)
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}_proj.weight" for p in "qkvo")]
    experts = range(num_experts(hf_config))
    if hf_config.model_type in ("qwen3_moe", "qwen2_moe"):
        per_layer += ["mlp.gate.weight",
                      *(f"mlp.experts.{e}.{p}_proj.weight" for e in experts for p in ("gate", "up", "down"))]
        if hf_config.model_type == "qwen2_moe":  # the shared expert and its sigmoid gate
            per_layer += [*(f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")),
                          "mlp.shared_expert_gate.weight"]
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


def _deepseek_v3_tensor_names(hf_config: PretrainedConfig, names: set[str]) -> set[str]:
    """DeepSeek-V3's: MLA (the low-rank query), the first first_k_dense_replace layers dense, the rest
    sparse with the router's e_score_correction_bias and the shared experts."""
    attention = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 *(f"self_attn.{p}.weight" for p in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                                                     "kv_a_layernorm", "kv_b_proj", "o_proj"))]
    dense = [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    sparse = ["mlp.gate.weight", "mlp.gate.e_score_correction_bias",
              *(f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")),
              *(f"mlp.experts.{e}.{p}_proj.weight" for e in range(num_experts(hf_config))
                for p in ("gate", "up", "down"))]
    for layer in range(hf_config.num_hidden_layers):
        mlp = dense if layer < hf_config.first_k_dense_replace else sparse
        names.update(f"model.layers.{layer}.{name}" for name in attention + mlp)
    return names


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
    on_disk = {n for n in checkpoint_tensor_names(path) if not n.endswith(NOT_WEIGHTS)}
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
