"""RMSNorm for Megatron's local (non-Transformer-Engine) spec that works with sequence parallelism.

Megatron's local spec builds its norms with `WrappedTorchNorm`, which asserts
`config.sequence_parallel` is off (megatron/core/transformer/torch_norm.py). Nothing in the norm's
forward needs that: RMSNorm is per token, so it is exact on sequence-sharded activations. What
sequence parallelism does need is in the backward: each TP rank then sees only its slice of the
sequence, so a norm weight's grad on one rank is a partial sum, and Megatron's
`finalize_model_grads` (`_allreduce_non_tensor_model_parallel_grads`) sums over the TP group the
grads of exactly the params that carry `param.sequence_parallel = True`. Transformer Engine's
norms (TENorm) and Megatron's own FusedLayerNorm set that attribute to `config.sequence_parallel`;
`LocalRMSNorm` does the same, and is otherwise torch.nn.RMSNorm (same `weight`) with HF's
precision policy in its forward: normalize in float32, round to the activation dtype, then multiply
by the weight in that dtype (HF's Llama/Qwen RMSNorm and vLLM's kernel do this; torch's fused
RMSNorm and Transformer Engine round once, after the weight). In bf16 that one rounding decides
whether Megatron's logprobs equal HF's bit for bit (tp1, CPU and H100) or differ by up to ~0.05.
`FusedRMSNorm` keeps torch's forward (`norm_precision="fused"`).

Where the norms sit with sequence parallelism on (s: sequence, b: batch, tp: TP size):
- input_layernorm, pre_mlp_layernorm, final_layernorm: input [s/tp, b, h], sequence-sharded; the
  attribute is what makes their grads right.
- q_layernorm / k_layernorm (Qwen3): input [s, b, heads/tp, d] (linear_qkv has gathered the
  sequence), so not sequence-sharded but head-sharded, with one [d] weight shared by all heads:
  their grad is partial over TP with or without sequence parallelism. Megatron 0.16.1 sums them
  over TP by name whenever `config.qk_layernorm` (the same `elif` as the sequence-parallel case, so
  a param is reduced once even when both apply). TE sets `sequence_parallel` on them too; so do we,
  which keeps the attribute meaning "this replicated weight's grad is partial over TP".

The other local-spec modules are sequence-parallel aware already: the embedding reduce-scatters
(or scatters) its output along the sequence, ColumnParallelLinear (linear_qkv, linear_fc1,
output_layer) all-gathers its input along the sequence, RowParallelLinear (linear_proj,
linear_fc2) reduce-scatters its output, DotProductAttention sees the full sequence, and RoPE
scales its length by TP. GPTModel's logits come out as [b, s, padded_vocab / tp] (full sequence).
The input's sequence length must be divisible by TP.

On CPU the sequence-parallel *backward* also allocates with `device=torch.cuda.current_device()`
inside autograd backward (tensor_parallel layers/mappings), where torch 2.13 does not keep
harness.backends.cpu_patches' TorchFunctionMode active: there it fails with "Cannot
access accelerator device" until the CPU backend handles that; the forward is unaffected.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

import torch


class LocalRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm built from a Megatron TransformerConfig, usable with sequence parallelism.

    Constructor as Megatron's spec builder calls a norm class:
    `build_module(norm, config=config, hidden_size=..., eps=...)`. Sets `weight.sequence_parallel`
    to `config.sequence_parallel` (as TENorm and FusedLayerNorm do).
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        # The settings WrappedTorchNorm rejects, except sequence parallelism.
        if config.normalization != "RMSNorm":
            raise ValueError(f"LocalRMSNorm is an RMSNorm; config.normalization is "
                             f"{config.normalization!r}")
        for flag in ("layernorm_zero_centered_gamma", "persist_layer_norm",
                     "memory_efficient_layer_norm"):
            if getattr(config, flag, False):
                raise ValueError(f"config.{flag} is not supported by LocalRMSNorm (torch RMSNorm)")
        super().__init__(hidden_size, eps=eps)
        self.config = config
        self.sequence_parallel = bool(config.sequence_parallel)
        self.weight.sequence_parallel = self.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF's (and vLLM's) precision policy: normalize in float32, round to the activation dtype,
        # then scale by the weight in that dtype. torch.nn.RMSNorm (and Transformer Engine) round
        # once, after the weight: in bf16 that alone moved logprobs by up to ~0.05 against HF.
        normalized = x.float()
        normalized = normalized * torch.rsqrt(normalized.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normalized.to(x.dtype)


class FusedRMSNorm(LocalRMSNorm):
    """torch.nn.RMSNorm's own forward: one rounding, after the weight (the "fused" policy, as
    Transformer Engine's norms compute)."""

    forward = torch.nn.RMSNorm.forward


# The local spec's norm precision policies (the TE spec has TE's norms, which round as "fused").
NORM_PRECISIONS: dict[str, type] = {"hf": LocalRMSNorm, "fused": FusedRMSNorm}


def _stock_norm_classes() -> tuple[type, ...]:
    """The norm classes Megatron's local spec puts in norm slots (torch, or apex when installed)."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return (WrappedTorchNorm, FusedLayerNorm)


def _weightless_norm_classes() -> tuple[type, ...]:
    """Slot values with no parameters: nothing to replace."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import L2Norm

    return (IdentityOp, L2Norm)


# Norm slots of a GPT layer spec: (attribute path from the layer's submodules, slot name).
_LAYER_NORM_SLOTS = ("input_layernorm", "pre_cross_attn_layernorm", "pre_mlp_layernorm")
_ATTENTION_NORM_SLOTS = ("q_layernorm", "k_layernorm", "kv_layernorm")


def _swap(where: str, value: Any, norm_cls: type) -> Any:
    if isinstance(value, type) and issubclass(value, _stock_norm_classes() + (norm_cls,)):
        return norm_cls
    if isinstance(value, type) and issubclass(value, _weightless_norm_classes()):
        return value
    raise TypeError(f"{where}: unexpected norm {value!r} in the local spec (expected Megatron's "
                    "WrappedTorchNorm/FusedLayerNorm, IdentityOp or L2Norm)")


def _replace_layer_norms(layer_spec: Any, norm_cls: type, where: str) -> Any:
    layer = layer_spec.submodules
    changes = {slot: _swap(f"{where}.{slot}", getattr(layer, slot), norm_cls)
               for slot in _LAYER_NORM_SLOTS if hasattr(layer, slot)}
    attention = getattr(layer, "self_attention", None)
    attn_sub = getattr(attention, "submodules", None)
    if attn_sub is not None and dataclasses.is_dataclass(attn_sub):
        attn_changes = {
            slot: _swap(f"{where}.self_attention.{slot}", getattr(attn_sub, slot), norm_cls)
            for slot in _ATTENTION_NORM_SLOTS if hasattr(attn_sub, slot)}
        changes["self_attention"] = dataclasses.replace(
            attention, submodules=dataclasses.replace(attn_sub, **attn_changes))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer, **changes))


def use_local_norms(block_spec: Any, norm_cls: type = LocalRMSNorm) -> Any:
    """A copy of a GPT decoder block spec (TransformerBlockSubmodules) with `norm_cls` in every
    norm slot that holds Megatron's torch/apex norm; the input spec is not modified.

    Raises TypeError for a norm slot holding anything else (so a norm class added by a later
    Megatron cannot slip through unreplaced).
    """
    replaced: dict[int, Any] = {}  # one layer spec object may be shared by several layers
    layer_specs = []
    for index, layer_spec in enumerate(block_spec.layer_specs):
        if id(layer_spec) not in replaced:
            replaced[id(layer_spec)] = _replace_layer_norms(layer_spec, norm_cls,
                                                            f"layer_specs[{index}]")
        layer_specs.append(replaced[id(layer_spec)])
    return dataclasses.replace(
        block_spec, layer_specs=layer_specs,
        layer_norm=_swap("layer_norm", block_spec.layer_norm, norm_cls))


def norm_slots(block_spec: Any) -> Iterator[tuple[str, Any]]:
    """(name, class) for every norm slot of a GPT decoder block spec (for checks and tests)."""
    for index, layer_spec in enumerate(block_spec.layer_specs):
        layer = layer_spec.submodules
        for slot in _LAYER_NORM_SLOTS:
            if hasattr(layer, slot):
                yield f"layer_specs[{index}].{slot}", getattr(layer, slot)
        attn_sub = getattr(getattr(layer, "self_attention", None), "submodules", None)
        for slot in _ATTENTION_NORM_SLOTS:
            if attn_sub is not None and hasattr(attn_sub, slot):
                yield f"layer_specs[{index}].self_attention.{slot}", getattr(attn_sub, slot)
    yield "layer_norm", block_spec.layer_norm


def norm_class(norm_precision: str) -> type:
    if norm_precision not in NORM_PRECISIONS:
        raise ValueError(f"norm_precision must be one of {sorted(NORM_PRECISIONS)}, got {norm_precision!r}")
    return NORM_PRECISIONS[norm_precision]


def local_block_spec(config: Any, *, vp_stage: Optional[int] = None,
                     pp_rank: Optional[int] = None, norm_precision: str = "hf") -> Any:
    """Megatron's local-spec GPT decoder block spec for `config`, with our RMSNorm as every norm:
    LocalRMSNorm (norm_precision "hf", the default) or FusedRMSNorm ("fused"); the core attention is
    the harness's subclass of DotProductAttention that also takes CP and packed THD sequences
    (harness.parallel.cp_attention).

    `pp_rank` defaults to Megatron's parallel state (as in get_gpt_decoder_block_spec); pass it to
    build a spec without an initialized parallel state.
    """
    import inspect

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    params = inspect.signature(get_gpt_decoder_block_spec).parameters
    extra = {}
    if "vp_stage" in params:
        extra["vp_stage"] = vp_stage
    if "pp_rank" in params:
        extra["pp_rank"] = pp_rank
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                      normalization=config.normalization, **extra)
    # Megatron's local attention takes neither CP nor packed THD sequences: the harness's subclass does.
    from harness.parallel.cp_attention import use_gathered_kv_attention

    spec = use_gathered_kv_attention(spec, getattr(config, "context_parallel_size", 1))
    return use_local_norms(spec, norm_class(norm_precision))


def resolve_norm_precision(norm_precision: str, spec: str) -> str:
    """"auto": "hf" on the local spec (LocalRMSNorm rounds as HF and vLLM do), "fused" on the TE
    spec (TE's norms round once, after the weight; TE offers nothing else)."""
    if norm_precision == "auto":
        return "fused" if spec == "te" else "hf"
    if norm_precision not in NORM_PRECISIONS:
        raise ValueError(f"norm_precision must be 'auto' or one of {sorted(NORM_PRECISIONS)}, "
                         f"got {norm_precision!r}")
    if spec == "te" and norm_precision != "fused":
        raise ValueError(f"norm_precision={norm_precision!r} needs the local spec: Transformer "
                         "Engine's norms round as 'fused'")
    return norm_precision
