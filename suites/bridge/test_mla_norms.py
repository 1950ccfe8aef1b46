"""MLA's latent norms take HF's epsilon (harness.bridge.mla_norms): HF's DeepseekV3Attention builds them without
the config's rms_norm_eps. The end-to-end catch is the catalog's mla-norm-eps-from-config (suites/sensitivity);
here, what the module reads off HF and which Megatron modules it sets on either spec."""
from __future__ import annotations

import types

import pytest
import torch

from harness.bridge.mla_norms import match_hf_mla_norms
from harness.compat.transformers import hf_mla_norm_eps
from harness.models import build_hf_model, load_hf_config


@pytest.mark.parametrize("model", ["tiny-moonlight", "tiny-deepseek-v3"])
def test_the_epsilons_are_those_of_hf_s_own_modules(model):
    attention = build_hf_model(model).model.layers[0].self_attn
    expected = {"kv": attention.kv_a_layernorm.variance_epsilon}
    if getattr(attention, "q_a_layernorm", None) is not None:
        expected["q"] = attention.q_a_layernorm.variance_epsilon
    assert hf_mla_norm_eps(load_hf_config(model)) == expected


def test_moonlight_s_latent_norm_is_not_its_rms_norm_eps():
    config = load_hf_config("tiny-moonlight")
    assert config.rms_norm_eps == 1e-5 and hf_mla_norm_eps(config) == {"kv": 1e-6}


def _chunk(attention) -> torch.nn.Module:
    layer = types.SimpleNamespace(self_attention=attention, layer_number=1)
    return types.SimpleNamespace(decoder=types.SimpleNamespace(layers=[layer]))


def test_the_norm_fused_into_te_s_up_projection_is_set():
    fused = types.SimpleNamespace(eps=1e-5)  # TE's LayerNormColumnParallelLinear keeps its norm's eps
    attention = types.SimpleNamespace(kv_layernorm=torch.nn.Identity(), linear_kv_up_proj=fused)
    assert match_hf_mla_norms([_chunk(attention)], None, eps={"kv": 1e-6}) == 1
    assert fused.eps == 1e-6


def test_the_local_spec_s_norm_is_set():
    norm = torch.nn.RMSNorm(8, eps=1e-5)
    attention = types.SimpleNamespace(kv_layernorm=norm, linear_kv_up_proj=torch.nn.Linear(8, 8))
    assert match_hf_mla_norms([_chunk(attention)], None, eps={"kv": 1e-6}) == 1
    assert norm.eps == 1e-6


def test_an_mla_layer_without_the_norm_is_an_error():
    attention = types.SimpleNamespace(kv_layernorm=torch.nn.Identity(), linear_kv_up_proj=torch.nn.Linear(8, 8))
    with pytest.raises(RuntimeError, match="no kv latent norm"):
        match_hf_mla_norms([_chunk(attention)], None, eps={"kv": 1e-6})
