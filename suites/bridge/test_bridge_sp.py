"""Sequence parallelism with Megatron's local (no-TE) spec: the parts checkable in the pytest parent.

Megatron's WrappedTorchNorm asserts sequence parallelism is off, so harness.bridge puts
LocalRMSNorm in every norm slot of the local spec. Under sequence parallelism each TP rank sees a
slice of the sequence, so a norm weight's grad is partial over TP; Megatron's finalize_model_grads
sums exactly the grads of params marked `sequence_parallel = True` (as TE's norms mark theirs).
Here: the norm marks its weight from the config, computes plain RMSNorm, and is what the local spec
builds in every norm slot. No torch.distributed: distributed SP parity lives in the parity suite.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402

from harness.bridge.norms import (  # noqa: E402
    LocalRMSNorm,
    local_block_spec,
    norm_slots,
    use_local_norms,
)

# Norm slots that hold weights: every layer's input/pre-MLP norm, plus the final norm.
_LAYER_NORMS = ("input_layernorm", "pre_mlp_layernorm")
_QK_NORMS = ("self_attention.q_layernorm", "self_attention.k_layernorm")


def _config(sequence_parallel: bool, qk_layernorm: bool = True, **overrides) -> TransformerConfig:
    """The tiny zoo shape (4 layers, hidden 64, 4 heads / 2 KV heads of 16) at TP 2."""
    fields = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  kv_channels=16, ffn_hidden_size=128, normalization="RMSNorm",
                  layernorm_epsilon=1e-6, qk_layernorm=qk_layernorm,
                  tensor_model_parallel_size=2, sequence_parallel=sequence_parallel)
    return TransformerConfig(**{**fields, **overrides})


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_norm_marks_its_weight_from_the_config(sequence_parallel):
    norm = LocalRMSNorm(config=_config(sequence_parallel), hidden_size=64, eps=1e-6)
    assert norm.weight.sequence_parallel is sequence_parallel
    assert norm.sequence_parallel is sequence_parallel
    assert [name for name, _ in norm.named_parameters()] == ["weight"]  # as torch.nn.RMSNorm
    assert norm.weight.shape == (64,) and norm.eps == 1e-6


def test_norm_is_plain_rmsnorm():
    norm = LocalRMSNorm(config=_config(True), hidden_size=64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64, generator=torch.Generator().manual_seed(0)) + 0.5)
    x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(1))  # [s/tp, b, h]
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)
    # Per token: normalizing a sequence shard gives that shard of the full result.
    torch.testing.assert_close(norm(x[:4]), norm(x)[:4], rtol=0, atol=0)


@pytest.mark.parametrize("overrides, message", [
    ({"normalization": "LayerNorm"}, "RMSNorm"),
    ({"layernorm_zero_centered_gamma": True}, "layernorm_zero_centered_gamma"),
    ({"memory_efficient_layer_norm": True}, "memory_efficient_layer_norm"),
])
def test_norm_rejects_what_it_does_not_implement(overrides, message):
    with pytest.raises(ValueError, match=message):
        LocalRMSNorm(config=_config(True, **overrides), hidden_size=64)


@pytest.mark.parametrize("qk_layernorm", [True, False], ids=["qwen3", "qwen2-llama"])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_local_spec_has_local_norm_in_every_norm_slot(sequence_parallel, qk_layernorm):
    config = _config(sequence_parallel, qk_layernorm)
    spec = local_block_spec(config, pp_rank=0)
    slots = dict(norm_slots(spec))
    assert len(spec.layer_specs) == 4
    weighted = [f"layer_specs[{i}].{slot}" for i in range(4) for slot in _LAYER_NORMS]
    weighted += [f"layer_specs[{i}].{slot}" for i in range(4) for slot in _QK_NORMS if qk_layernorm]
    weighted.append("layer_norm")
    assert {name: slots[name] for name in weighted} == dict.fromkeys(weighted, LocalRMSNorm)
    # The rest are weightless (cross-attention norm; q/k norm without qk_layernorm).
    others = {name: cls for name, cls in slots.items() if name not in weighted}
    assert others and set(others.values()) == {IdentityOp}
    assert WrappedTorchNorm not in slots.values()


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_norms_built_from_the_spec_carry_the_attribute(sequence_parallel):
    """As Megatron builds them: build_module(slot, config=..., hidden_size=..., eps=...)."""
    config = _config(sequence_parallel)
    spec = local_block_spec(config, pp_rank=0)
    layer = spec.layer_specs[0].submodules
    built = [build_module(layer.input_layernorm, config=config, hidden_size=64, eps=1e-6),
             build_module(layer.pre_mlp_layernorm, config=config, hidden_size=64, eps=1e-6),
             build_module(layer.self_attention.submodules.q_layernorm, hidden_size=16,
                          config=config, eps=1e-6),
             build_module(spec.layer_norm, config=config, hidden_size=64, eps=1e-6)]
    assert all(type(norm) is LocalRMSNorm for norm in built)
    assert all(norm.weight.sequence_parallel is sequence_parallel for norm in built)


def test_replacing_norms_leaves_megatrons_spec_alone():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = _config(False)
    stock = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization="RMSNorm", pp_rank=0)
    before = [cls for _, cls in norm_slots(stock)]
    replaced = use_local_norms(stock)
    assert [cls for _, cls in norm_slots(stock)] == before  # the input is not modified
    assert WrappedTorchNorm in before and WrappedTorchNorm not in dict(norm_slots(replaced)).values()
    # Everything but the norms is the same spec.
    assert replaced.layer_specs[0].submodules.mlp == stock.layer_specs[0].submodules.mlp
    assert replaced.layer_specs[0].submodules.self_attention.submodules.linear_qkv is \
        stock.layer_specs[0].submodules.self_attention.submodules.linear_qkv


def test_unknown_norm_class_is_an_error_not_a_silent_skip():
    stock = local_block_spec(_config(True), pp_rank=0)
    layer = stock.layer_specs[0]
    odd = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, pre_mlp_layernorm=torch.nn.LayerNorm))
    with pytest.raises(TypeError, match="pre_mlp_layernorm"):
        use_local_norms(dataclasses.replace(stock, layer_specs=[odd]))
