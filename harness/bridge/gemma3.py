"""Gemma 3's text model (HF `gemma3_text`, `Gemma3ForCausalLM`) on megatron-core's local spec: the
harness's own bridge pieces, because neither bridge can build it here.

- mbridge 0.15.1 registers only the vision-language `gemma3` (`Gemma3Bridge(VLMBridge)`: SigLIP tower,
  projector, `language_model.` names) and builds it from Transformer Engine modules only (TENorm,
  TELayerNormColumnParallelLinear, its MemoryEfficientAttention): nothing for `gemma3_text`, nothing on CPU.
- Megatron-Bridge 0.6.2's `Gemma3ModelBridge` converts `Gemma3ForCausalLM`, but its layer spec is TE
  only too (TELayerNormColumnParallelLinear, `Gemma3TEDotProductAttention` for the sliding window,
  `TERowParallelLinearLayerNorm` for the post-norms), and it picks local layers by a fixed
  `interleaved_attn_pattern` (5, 1), not by the checkpoint's `layer_types`: refused there by name
  (harness.bridge.preflight.BRIDGE_MODEL_TYPES).
- megatron-core 0.16.1's local spec has no place for what Gemma 3 adds: its torch norm
  (WrappedTorchNorm) asserts `layernorm_zero_centered_gamma` is off; TransformerLayer has no norm after
  the attention or after the MLP; GPTModel has one RoPE base for every layer and does not scale the
  embedding; and its DotProductAttention's sliding window *replaces* any attention mask it is given
  (FusedScaleMaskSoftmax.forward_torch_softmax), so a packed batch's block-diagonal mask would be lost.

What this module adds (each small, each a subclass of the megatron-core module it changes):
- `ZeroCenteredRMSNorm`: HF's Gemma3RMSNorm, `(x / rms(x)) * (1 + w)` computed in float32 and rounded
  once (HF's own rounding, which differs from Llama's), built from `layernorm_zero_centered_gamma`; in
  every norm slot (input, pre-MLP, q/k, final) and after attention and MLP;
- `RowParallelLinearPostNorm`: linear_proj / linear_fc2 with Gemma's post-attention /
  post-feedforward norm applied to the reduced output (Megatron-Bridge's TE layer's names:
  `linear_proj.post_layernorm.weight`, `linear_fc2.post_layernorm.weight`);
- `SlidingWindowAttention`: megatron-core's DotProductAttention; on the layers
  `is_layer_window_attention(config.window_size, config.window_attn_skip_freq, n)` marks local (the
  bridge sets the list from HF's `layer_types`) it masks keys more than `sliding_window - 1` behind the
  query, combined with the mask it is given;
- `Gemma3SelfAttention`: picks the local RoPE (`rope_parameters["sliding_attention"]`) on local
  layers and the global one on the others, from `DualRotaryEmbedding`'s stacked pair;
- `ScaledEmbedding`: the word embedding times sqrt(hidden) rounded to the activation dtype first (HF's
  `embed_scale.to(weight.dtype)`).

The query scale is megatron-core's own `softmax_scale` (query_pre_attn_scalar ** -0.5); gelu-tanh is
`F.gelu(approximate="tanh")`, HF's `gelu_pytorch_tanh`. Attention logit soft-capping and the final
one are refused by preflight (no Gemma 3 checkpoint sets them: Gemma 3 replaced Gemma 2's soft-capping
with QK-norm).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from harness.bridge.norms import LocalRMSNorm, use_local_norms

MODEL_TYPE = "gemma3_text"
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def gemma3_rope_thetas(hf_config: PretrainedConfig) -> tuple[float, float]:
    """(local, global) RoPE bases of a checked Gemma 3 text config."""
    params = hf_config.rope_parameters
    return float(params[LOCAL]["rope_theta"]), float(params[GLOBAL]["rope_theta"])


def window_pattern(hf_config: PretrainedConfig) -> list[int]:
    """megatron-core's `window_attn_skip_freq` list: 1 for a sliding-window layer, 0 for a global one."""
    return [1 if kind == LOCAL else 0 for kind in hf_config.layer_types]


class ZeroCenteredRMSNorm(LocalRMSNorm):
    """Gemma's RMSNorm: `(x / rms(x)) * (1 + w)` in float32, rounded once to the activation dtype
    (HF's Gemma3RMSNorm: "Llama does x.to(float16) * w whilst Gemma3 is (x * w).to(float16)"). The
    stored weight is HF's `w` as is (zero-centered: 0 is the identity scale).

    `zero_centered` False computes `w * x` instead: a converter that loads Gemma's `w` into a plain
    RMSNorm (the catalog's `gemma-norm-not-zero-centered`)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        if config.normalization != "RMSNorm" or not config.layernorm_zero_centered_gamma:
            raise ValueError("ZeroCenteredRMSNorm needs normalization='RMSNorm' and layernorm_zero_centered_gamma")
        torch.nn.RMSNorm.__init__(self, hidden_size, eps=eps)
        torch.nn.init.zeros_(self.weight)  # the identity scale, as HF initialises it (every weight is loaded)
        self.config = config
        self.sequence_parallel = bool(config.sequence_parallel)
        self.weight.sequence_parallel = self.sequence_parallel
        self.zero_centered = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normalized = x.float()
        normalized = normalized * torch.rsqrt(normalized.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = 1.0 + self.weight.float() if self.zero_centered else self.weight.float()
        return (normalized * scale).to(x.dtype)


@functools.cache
def _row_parallel_linear():
    from megatron.core.tensor_parallel import RowParallelLinear

    class RowParallelLinearPostNorm(RowParallelLinear):
        """RowParallelLinear whose (reduced, or under sequence parallelism reduce-scattered) output goes
        through Gemma's post-attention / post-feedforward norm (no bias: Gemma has none)."""

        def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any) -> None:
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_layernorm = ZeroCenteredRMSNorm(config, output_size, eps=config.layernorm_epsilon)

        def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
            output, bias = super().forward(input_, *args, **kwargs)
            if bias is not None:
                raise ValueError("RowParallelLinearPostNorm: a bias added after the post-norm would be wrong")
            return self.post_layernorm(output), None

    return RowParallelLinearPostNorm


@functools.cache
def _sliding_window_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.utils import is_layer_window_attention

    class SlidingWindowAttention(DotProductAttention):
        """DotProductAttention that keeps the mask it is given on sliding-window layers (stock 0.16.1
        replaces it with the window's) and applies the window `(left, 0)` on top of it."""

        KEEPS_MASK = True  # harness.logprobs.megatron: packed rows keep their block-diagonal mask here

        def __init__(self, config: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, layer_number, *args, **kwargs)
            local = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            self.window = tuple(config.window_size) if local else None
            self.scale_mask_softmax.window_size = None  # the window goes into the mask below instead

        def forward(self, query, key, value, attention_mask, *args: Any, **kwargs: Any):
            if self.window is not None:
                sq, sk = query.shape[0], key.shape[0]
                rows = torch.arange(sq, device=query.device).unsqueeze(1) + (sk - sq)
                cols = torch.arange(sk, device=query.device).unsqueeze(0)
                # True = masked (Megatron's convention): the future and keys beyond the window.
                outside = (cols > rows + self.window[1]) | (cols < rows - self.window[0])
                outside = outside.view(1, 1, sq, sk)
                attention_mask = outside if attention_mask is None else (attention_mask.bool() | outside)
            return super().forward(query, key, value, attention_mask, *args, **kwargs)

    return SlidingWindowAttention


@functools.cache
def _self_attention():
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.utils import is_layer_window_attention

    class Gemma3SelfAttention(SelfAttention):
        """SelfAttention that takes `DualRotaryEmbedding`'s [local, global] pair and applies its own."""

        def __init__(self, config: Any, submodules: Any, layer_number: int, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, submodules, layer_number, *args, **kwargs)
            self.local_rope = is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                                        layer_number)

        def forward(self, hidden_states, attention_mask, *args: Any, rotary_pos_emb=None, **kwargs: Any):
            if rotary_pos_emb is not None:
                if not (isinstance(rotary_pos_emb, torch.Tensor) and rotary_pos_emb.dim() == 5
                        and rotary_pos_emb.shape[0] == 2):
                    raise RuntimeError("Gemma3SelfAttention needs DualRotaryEmbedding's stacked [local, global] "
                                       "RoPE; the model has another rotary embedding")
                rotary_pos_emb = rotary_pos_emb[0 if self.local_rope else 1]
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)

    return Gemma3SelfAttention


@functools.cache
def _rotary_embedding():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class DualRotaryEmbedding(RotaryEmbedding):
        """GPTModel's RoPE (the global base) with `local`, another RotaryEmbedding (the local base),
        stacked [local, global] for Gemma3SelfAttention. Made by `dual_rope` from the model's own."""

        def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
            return torch.stack([self.local(max_seq_len, offset, packed_seq, cp_group),
                                super().forward(max_seq_len, offset, packed_seq, cp_group)])

    return DualRotaryEmbedding


def dual_rope(rotary: torch.nn.Module, local_base: float, config: Any) -> torch.nn.Module:
    """GPTModel's RotaryEmbedding (global base) made a DualRotaryEmbedding in place, its local twin
    on the same device."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if type(rotary) is not RotaryEmbedding:
        raise TypeError(f"Gemma 3 needs megatron-core's RotaryEmbedding, the model has {type(rotary).__name__}")
    local = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                            rotary_interleaved=config.rotary_interleaved, rotary_base=local_base,
                            use_cpu_initialization=True, cp_group=rotary.cp_group)
    local.inv_freq = local.inv_freq.to(rotary.inv_freq.device)
    rotary.__class__ = _rotary_embedding()
    rotary.local = local
    return rotary


@functools.cache
def _scaled_embedding():
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    class ScaledEmbedding(LanguageModelEmbedding):
        """The word embedding times `embed_scale` (sqrt(hidden)) rounded to the activation dtype
        first, as HF's Gemma3TextScaledWordEmbedding does; elementwise, so after the TP reduction and
        the sequence-parallel scatter it is the same product."""

        embed_scale: float = 1.0

        def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            embeddings = super().forward(*args, **kwargs)
            return embeddings * torch.tensor(self.embed_scale, dtype=embeddings.dtype, device=embeddings.device)

    return ScaledEmbedding


def gemma3_block_spec(config: Any, *, vp_stage: Optional[int] = None) -> Any:
    """megatron-core's local GPT block spec with Gemma 3's pieces (module docstring)."""
    import inspect

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    extra = {"vp_stage": vp_stage} if "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters else {}
    spec = use_local_norms(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                      normalization=config.normalization, **extra),
                           ZeroCenteredRMSNorm)
    row_post_norm, attention, self_attention = _row_parallel_linear(), _sliding_window_attention(), _self_attention()
    layers, done = [], {}
    for layer_spec in spec.layer_specs:
        if id(layer_spec) not in done:
            sub = layer_spec.submodules
            attn = sub.self_attention
            attn = dataclasses.replace(attn, module=self_attention, submodules=dataclasses.replace(
                attn.submodules, core_attention=attention, linear_proj=row_post_norm))
            mlp = dataclasses.replace(sub.mlp, submodules=dataclasses.replace(sub.mlp.submodules,
                                                                              linear_fc2=row_post_norm))
            done[id(layer_spec)] = dataclasses.replace(
                layer_spec, submodules=dataclasses.replace(sub, self_attention=attn, mlp=mlp))
        layers.append(done[id(layer_spec)])
    return dataclasses.replace(spec, layer_specs=layers)


def gemma3_config_args(hf_config: PretrainedConfig) -> dict[str, Any]:
    """The TransformerConfig fields of a checked Gemma 3 text config beyond mbridge's base mapping."""
    return dict(
        qk_layernorm=True,
        layernorm_zero_centered_gamma=True,
        activation_func=functools.partial(F.gelu, approximate="tanh"),  # HF's gelu_pytorch_tanh
        gated_linear_unit=True,
        bias_activation_fusion=False,
        softmax_scale=hf_config.query_pre_attn_scalar ** -0.5,
        # HF's window holds `sliding_window` keys, the query's own included: (sliding_window - 1, 0).
        window_size=(hf_config.sliding_window - 1, 0),
        window_attn_skip_freq=window_pattern(hf_config),
    )


def gemma3_bridge_class() -> type:
    """The harness's Gemma 3 text bridge: mbridge's LLMBridge with the harness's fixes
    (HarnessBridgeMixin) and Gemma 3's config, spec, names and model pieces."""
    from mbridge.core import LLMBridge

    from harness.bridge.mbridge_compat import HarnessBridgeMixin

    return _bridge(HarnessBridgeMixin, LLMBridge)


@functools.cache
def _bridge(mixin: type, base: type) -> type:
    class HarnessGemma3TextBridge(mixin, base):
        _DIRECT_MAPPING = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                           "decoder.final_layernorm.weight": "model.norm.weight",
                           "output_layer.weight": "lm_head.weight"}
        _ATTENTION_MAPPING = {
            "self_attention.linear_proj.post_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
            "self_attention.linear_proj.weight": ["model.layers.{layer_number}.self_attn.o_proj.weight"],
            "self_attention.q_layernorm.weight": ["model.layers.{layer_number}.self_attn.q_norm.weight"],
            "self_attention.k_layernorm.weight": ["model.layers.{layer_number}.self_attn.k_norm.weight"],
            "self_attention.linear_qkv.weight": [f"model.layers.{{layer_number}}.self_attn.{p}_proj.weight"
                                                 for p in "qkv"],
        }
        _MLP_MAPPING = {
            "mlp.linear_fc2.post_layernorm.weight": ["model.layers.{layer_number}.post_feedforward_layernorm.weight"],
            "mlp.linear_fc1.weight": ["model.layers.{layer_number}.mlp.gate_proj.weight",
                                      "model.layers.{layer_number}.mlp.up_proj.weight"],
            "mlp.linear_fc2.weight": ["model.layers.{layer_number}.mlp.down_proj.weight"],
        }
        _OTHER_MAPPING = {}
        # The local spec's standalone norms -> HF (the pre-MLP norm is Gemma's pre_feedforward_layernorm).
        _LOCAL_NORMS = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "pre_feedforward_layernorm"}

        def __init__(self, hf_config: PretrainedConfig, *, spec: str, **kwargs: Any) -> None:
            if spec != "local":
                raise NotImplementedError("Gemma 3 text is built on the local spec only (harness.bridge.gemma3)")
            super().__init__(hf_config, spec=spec, **kwargs)

        def _build_config(self):
            return self._build_base_config(**gemma3_config_args(self.hf_config))

        def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
            parts = mcore_weights_name.split(".")
            if len(parts) == 5 and parts[:2] == ["decoder", "layers"] and parts[3] in self._LOCAL_NORMS:
                return [f"model.layers.{parts[2]}.{self._LOCAL_NORMS[parts[3]]}.weight"]
            return super()._weight_name_mapping_mcore_to_hf(mcore_weights_name)

        def _get_gptmodel_args(self) -> dict:
            return dict(vocab_size=self.hf_config.vocab_size,
                        max_sequence_length=self.hf_config.max_position_embeddings,
                        position_embedding_type="rope", rotary_base=gemma3_rope_thetas(self.hf_config)[1])

        def _harness_set_rope_frequencies(self, model: torch.nn.Module, **unused: Any) -> None:
            # Called for every chunk mbridge builds (HarnessBridgeMixin._model_provider): Gemma's pieces.
            if getattr(model, "rotary_pos_emb", None) is not None:
                dual_rope(model.rotary_pos_emb, gemma3_rope_thetas(self.hf_config)[0], self.config)
            if getattr(model, "embedding", None) is not None:
                model.embedding.__class__ = _scaled_embedding()
                model.embedding.embed_scale = math.sqrt(self.hf_config.hidden_size)

        def _get_transformer_layer_spec(self, vp_stage: Optional[int] = None):
            import inspect

            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            self.has_vp_stage = "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters
            return gemma3_block_spec(self.config, vp_stage=vp_stage)

    return HarnessGemma3TextBridge
