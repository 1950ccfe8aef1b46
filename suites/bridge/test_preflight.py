"""Every model feature the bridge would not convert faithfully is refused in the parent, before any
rank starts: `harness.bridge.preflight.check_model_supported`, called by `mrh parity`,
`prepare_model` and `run_in_layout(model=...)`. Parent-side only: no world, no Megatron.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.bridge.backends import current
from harness.bridge.preflight import (
    UnsupportedModelError,
    bridge_converts,
    check_model_supported,
    checkpoint_tensor_names,
    expected_tensor_names,
)
from harness.models import list_models, load_hf_config, resolve_model

TINY_MODELS = [name for name in list_models() if name.startswith("tiny-")]
_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def local_checkpoint(directory, base: str = "tiny-llama", config: dict | None = None,
                     add: dict[str, torch.Tensor] | None = None, drop: tuple[str, ...] = ()):
    """A copy of zoo model `base` as a local HF checkpoint dir, its config.json updated with
    `config` (None values delete a key) and its tensors with `add` / `drop`."""
    path = directory / f"{base}-edited"
    shutil.copytree(resolve_model(base), path)
    fields = json.loads((path / "config.json").read_text())
    fields.update(config or {})
    (path / "config.json").write_text(json.dumps({k: v for k, v in fields.items() if v is not None}))
    if add or drop:
        state = load_file(path / "model.safetensors")
        state = {**{k: v for k, v in state.items() if k not in drop}, **(add or {})}
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


# (base model, config changes, tensors to add, tensors to drop) -> words the one error must contain
UNSUPPORTED = {
    "model-type": ("tiny-llama", {"model_type": "gemma"}, None, (), "model_type 'gemma'"),
    "hidden-act": ("tiny-llama", {"hidden_act": "gelu"}, None, (), "hidden_act 'gelu'"),
    "sliding-window-qwen2": ("tiny-qwen2", {"use_sliding_window": True, "sliding_window": 16,
                                            "max_window_layers": 0}, None, (), "sliding-window"),
    "sliding-layer-types": ("tiny-qwen3", {"layer_types": ["sliding_attention", "full_attention"] * 2,
                                           "sliding_window": 16}, None, (), "sliding-window"),
    "rope-yarn": ("tiny-llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 32}},
                  None, (), "rope type 'yarn'"),
    "rope-linear": ("tiny-llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
                    None, (), "rope type 'linear'"),
    "llama3-incomplete": ("tiny-llama", {"rope_parameters": {k: v for k, v in _LLAMA3.items()
                                                             if k != "low_freq_factor"}},
                          None, (), "low_freq_factor"),
    "llama3-empty-band": ("tiny-llama", {"rope_parameters": {**_LLAMA3, "high_freq_factor": 1.0}},
                          None, (), "must exceed low_freq_factor"),
    "partial-rotary": ("tiny-llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5}},
                       None, (), "partial_rotary_factor 0.5"),
    "llama-attention-bias": ("tiny-llama", {"attention_bias": True}, None, (), "attention_bias=True (o_proj"),
    "llama-mlp-bias": ("tiny-llama", {"mlp_bias": True}, None, (), "mlp_bias=True"),
    "qwen3-attention-bias": ("tiny-qwen3", {"attention_bias": True}, None, (), "attention_bias=True (q/k/v/o_proj"),
    "extra-tensor": ("tiny-llama", None, {"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, (),
                     "no Megatron counterpart (they would be dropped silently): model.layers.0.self_attn.o_proj.bias"),
    "missing-tensor": ("tiny-qwen2", None, None, ("model.layers.3.self_attn.v_proj.bias",),
                       "lacks tensors the model needs: model.layers.3.self_attn.v_proj.bias"),
}


def _params(table):
    return [pytest.param(*case, id=name) for name, case in table.items()]


@pytest.mark.parametrize("base, config, add, drop, message", _params(UNSUPPORTED))
def test_unsupported_feature_is_one_error(tmp_path, base, config, add, drop, message):
    path = local_checkpoint(tmp_path, base, config, add, drop)
    with pytest.raises(UnsupportedModelError) as error:
        check_model_supported(path)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name", list_models())
def test_every_zoo_model_is_supported(name):
    """By this run's bridge: each converts the families it has (Megatron-Bridge 0.6.2 has no Mixtral),
    and refuses the others by name before any rank works."""
    if not bridge_converts(name):
        with pytest.raises(UnsupportedModelError, match=f"not supported by the {current()} bridge"):
            check_model_supported(name)
        return
    assert check_model_supported(name).to_dict() == load_hf_config(name).to_dict()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_expected_names_are_exactly_what_hf_saves(name):
    """The parent's list of the tensors the Megatron model loads agrees with HF's own checkpoint
    (the rank-side guard checks the same against mbridge's real mapping)."""
    path = resolve_model(name)
    assert checkpoint_tensor_names(path) == expected_tensor_names(load_hf_config(name))
    if bridge_converts(name):
        assert check_model_supported(path).model_type == load_hf_config(name).model_type


def test_supported_variants_pass(tmp_path):
    """Not otherwise: llama3 RoPE, Qwen2's QKV bias, and a tied checkpoint that also stores its
    lm_head duplicate are all fine."""
    check_model_supported(local_checkpoint(tmp_path, "tiny-llama", {"rope_parameters": _LLAMA3}))
    check_model_supported(resolve_model("tiny-qwen2"))
    embed = load_file(resolve_model("tiny-qwen3-tied") / "model.safetensors")["model.embed_tokens.weight"]
    check_model_supported(local_checkpoint(tmp_path, "tiny-qwen3-tied", add={"lm_head.weight": embed}))


def test_preflight_imports_no_megatron():
    code = ("import sys, harness.bridge.preflight, harness.parity.runner, harness.parallel.state; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'mbridge')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


# ----------------------------------------------------------------------------- call sites
class _NoWorld:
    """A world whose use fails the test: the model must be refused before anything runs."""

    size, device = 2, "cpu"

    def run(self, *args, **kwargs):
        pytest.fail("world.run was called for a model the bridge does not support")


def _untouched(*args, **kwargs):
    pytest.fail("a rank function ran")


@pytest.mark.parametrize("case", ["extra-tensor", "rope-yarn", "sliding-window-qwen2"])
def test_run_in_layout_refuses_before_world_run(tmp_path, case):
    from harness.parallel.state import run_in_layout

    base, config, add, drop, message = UNSUPPORTED[case]
    path = local_checkpoint(tmp_path, base, config, add, drop)
    for model in (path, str(path)):
        with pytest.raises(UnsupportedModelError) as error:
            run_in_layout(_NoWorld(), "tp2", _untouched, model=model)
        assert message in str(error.value)


def test_run_in_layout_refuses_an_hf_config_before_world_run():
    from transformers import Qwen3Config

    from harness.parallel.state import run_in_layout

    config = load_hf_config("tiny-qwen3").to_dict()
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        run_in_layout(_NoWorld(), "tp2", _untouched, model=Qwen3Config(**{**config, "hidden_act": "gelu"}))


def test_prepare_model_refuses(tmp_path):
    from harness.parity.runner import prepare_model

    path = local_checkpoint(tmp_path, "tiny-llama", {"hidden_act": "relu"})
    with pytest.raises(UnsupportedModelError, match="hidden_act 'relu'"):
        prepare_model(str(path))


def _parity_args(model: str):
    import argparse

    from harness.parity.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", model, "--layouts", "tp1,tp2"])


def test_mrh_parity_exits_2_before_any_world(tmp_path, monkeypatch, capsys):
    import harness.parity.cli as cli

    monkeypatch.setattr(cli, "WorldPool", _untouched)  # starting the world pool fails the test
    path = local_checkpoint(tmp_path, "tiny-llama", add={"model.layers.2.mlp.down_proj.bias": torch.zeros(64)})
    assert cli.main(_parity_args(str(path))) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.layers.2.mlp.down_proj.bias" in err, err


def test_mrh_parity_command_exits_2_with_one_line(tmp_path):
    """The real command: exit 2, one line on stderr naming the feature, no layout started."""
    path = local_checkpoint(tmp_path, "tiny-llama", {"rope_parameters": {"rope_type": "dynamic",
                                                                          "rope_theta": 10000.0, "factor": 2.0}})
    mrh = shutil.which("mrh") or str(Path(sys.executable).with_name("mrh"))
    done = subprocess.run([mrh, "parity", "--model", str(path), "--layouts", "tp2"],
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "rope type 'dynamic'" in lines[0], done.stderr
    assert done.stdout == ""


# ----------------------------------------------------------------------------- Qwen2-MoE (issue 37)
def _assert_family_refuses(tmp_path, model: str, model_type: str, config, drop, message: str) -> None:
    """A checkpoint of `model` with `config` changed and `drop` removed is one error naming `message`, or,
    where this stack's bridge converts no `model_type`, naming the bridge (the refusal by name comes first)."""
    path = local_checkpoint(tmp_path, model, config, None, drop)
    if not bridge_converts(model):
        message = f"model_type '{model_type}' is not supported by the {current()} bridge"
    with pytest.raises(UnsupportedModelError) as error:
        check_model_supported(path)
    assert message in str(error.value) and "\n" not in str(error.value)


# What mbridge 0.15.1's Qwen2MoEBridge would build otherwise than HF (harness.bridge.preflight): it routes
# with megatron-core's pre-softmax router (no renormalisation), makes every layer sparse and always builds
# the shared expert and q/k/v biases. Megatron-Bridge 0.6.2 has no Qwen2-MoE bridge: there every one of
# these, the zoo model too, is refused by the bridge's name first.
QWEN2_MOE_UNSUPPORTED = {
    "qwen2-moe-norm-topk": ({"norm_topk_prob": True}, (), "norm_topk_prob=True"),
    "qwen2-moe-sparse-step": ({"decoder_sparse_step": 2}, (), "dense layers between the sparse ones"),
    "qwen2-moe-mlp-only": ({"mlp_only_layers": [1]}, (), "dense layers between the sparse ones"),
    "qwen2-moe-no-qkv-bias": ({"qkv_bias": False}, (), "qkv_bias=False"),
    "qwen2-moe-router-logits": ({"output_router_logits": True}, (), "output_router_logits=True"),
    "qwen2-moe-gate-missing": (None, ("model.layers.2.mlp.shared_expert_gate.weight",),
                               "lacks tensors the model needs: model.layers.2.mlp.shared_expert_gate.weight"),
}


@pytest.mark.parametrize("config, drop, message", _params(QWEN2_MOE_UNSUPPORTED))
def test_qwen2_moe_unsupported_feature_is_one_error(tmp_path, config, drop, message):
    _assert_family_refuses(tmp_path, "tiny-qwen2-moe", "qwen2_moe", config, drop, message)


def test_qwen2_moe_is_refused_by_name_where_the_bridge_has_none(monkeypatch, capsys):
    """`mrh parity --model tiny-qwen2-moe` on a bridge without Qwen2-MoE (Megatron-Bridge 0.6.2): exit 2
    and one line naming the bridge before any world starts; on mbridge the same preflight passes."""
    import harness.parity.cli as cli

    if bridge_converts("tiny-qwen2-moe"):
        assert check_model_supported("tiny-qwen2-moe").model_type == "qwen2_moe"
        return
    monkeypatch.setattr(cli, "WorldPool", _untouched)
    assert cli.main(_parity_args("tiny-qwen2-moe")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"not supported by the {current()} bridge" in err, err


# ----------------------------------------------------------------------------- Gemma 3 text (issue 37)
# What the harness's Gemma 3 pieces (harness.bridge.gemma3, on mbridge) do not build, refused in one line
# before any rank starts. Megatron-Bridge 0.6.2's Gemma 3 bridge is Transformer Engine only: there every
# one of these, the zoo model too, is refused by the bridge's name first, saying why.
_GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 100000.0}}
GEMMA3_UNSUPPORTED = {
    "gemma3-final-softcap": ({"final_logit_softcapping": 30.0}, (), "final_logit_softcapping=30.0"),
    "gemma3-attn-softcap": ({"attn_logit_softcapping": 50.0}, (), "attn_logit_softcapping=50.0"),
    "gemma3-gelu-exact": ({"hidden_activation": "gelu"}, (), "hidden_activation 'gelu'"),
    "gemma3-bidirectional": ({"use_bidirectional_attention": True}, (), "use_bidirectional_attention=True"),
    "gemma3-attention-bias": ({"attention_bias": True}, (), "attention_bias=True"),
    "gemma3-linear-rope": ({"rope_parameters": {**_GEMMA3_ROPE, "full_attention": {
        "rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}}, (), "rope type 'linear' is not supported"),
    "gemma3-local-rope-scaled": ({"rope_parameters": {**_GEMMA3_ROPE, "sliding_attention": {
        "rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}}, (), "local RoPE"),
    "gemma3-post-norm-missing": (None, ("model.layers.1.post_feedforward_layernorm.weight",),
                                 "lacks tensors the model needs: model.layers.1.post_feedforward_layernorm.weight"),
}


@pytest.mark.parametrize("config, drop, message", _params(GEMMA3_UNSUPPORTED))
def test_gemma3_unsupported_feature_is_one_error(tmp_path, config, drop, message):
    path = local_checkpoint(tmp_path, "tiny-gemma3", config, None, drop)
    if not bridge_converts("tiny-gemma3"):
        message = f"model_type 'gemma3_text' is not supported by the {current()} bridge"
# ----------------------------------------------------------------------------- GLM-4.5-MoE (issue 37)
# What the bridges would build otherwise than HF's Glm4MoeForCausalLM (harness.bridge.preflight.
# _unsupported_glm4_moe), on either stack.
GLM4_MOE_UNSUPPORTED = {
    "glm4-moe-groups": ({"n_group": 2, "topk_group": 1}, (), "n_group=2, topk_group=1"),
    "glm4-moe-two-shared": ({"n_shared_experts": 2}, (), "n_shared_experts=2"),
    "glm4-moe-unnormalised": ({"norm_topk_prob": False}, (), "norm_topk_prob=False"),
    "glm4-moe-top1": ({"num_experts_per_tok": 1}, (), "num_experts_per_tok=1"),
    "glm4-moe-no-qkv-bias": ({"attention_bias": False}, (), "attention_bias=False"),
    "glm4-moe-all-dense": ({"first_k_dense_replace": 4}, (), "makes every one of the 4 layers dense"),
    "glm4-moe-router-logits": ({"output_router_logits": True}, (), "output_router_logits=True"),
    "glm4-moe-odd-rotary": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.3}}, (),
                            "partial_rotary_factor 0.3 with head_dim 16"),
    "glm4-moe-bias-missing": (None, ("model.layers.2.mlp.gate.e_score_correction_bias",),
                              "lacks tensors the model needs: model.layers.2.mlp.gate.e_score_correction_bias"),
}


@pytest.mark.parametrize("config, drop, message", _params(GLM4_MOE_UNSUPPORTED))
def test_glm4_moe_unsupported_feature_is_one_error(tmp_path, config, drop, message):
    path = local_checkpoint(tmp_path, "tiny-glm4-moe", config, None, drop)
# ----------------------------------------------------------------------------- gpt-oss (issue 37)
# What Megatron-Bridge 0.6.2's GPTOSSBridge would build otherwise than HF (harness.bridge.preflight): it always
# builds q/k/v/o biases, the sliding window on every other layer (window_attn_skip_freq=2, from layer 0), and
# gpt-oss's own YaRN (hard-coded, whatever the checkpoint says). mbridge 0.15.1 has no gpt-oss bridge: there
# every one of these, the zoo model too, is refused by the bridge's name first.
_GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}
GPT_OSS_UNSUPPORTED = {
    "gpt-oss-no-attention-bias": ({"attention_bias": False}, (), "attention_bias=False"),
    "gpt-oss-window-pattern": ({"layer_types": ["full_attention", "sliding_attention"] * 2}, (), "layer_types"),
    "gpt-oss-no-window": ({"sliding_window": 0}, (), "sliding_window=0"),
    "gpt-oss-other-yarn": ({"rope_parameters": {**_GPT_OSS_YARN, "factor": 8.0}}, (), "hard-codes gpt-oss's YaRN"),
    "gpt-oss-yarn-truncated": ({"rope_parameters": {**_GPT_OSS_YARN, "truncate": True}}, (), "'truncate': True"),
    "gpt-oss-default-rope": ({"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}, (),
                             "always builds YaRN"),
    "gpt-oss-router-logits": ({"output_router_logits": True}, (), "output_router_logits=True"),
    "gpt-oss-sinks-missing": (None, ("model.layers.1.self_attn.sinks",),
                              "lacks tensors the model needs: model.layers.1.self_attn.sinks"),
    "gpt-oss-expert-bias-missing": (None, ("model.layers.2.mlp.experts.down_proj_bias",),
                                    "lacks tensors the model needs: model.layers.2.mlp.experts.down_proj_bias"),
}


@pytest.mark.parametrize("config, drop, message", _params(GPT_OSS_UNSUPPORTED))
def test_gpt_oss_unsupported_feature_is_one_error(tmp_path, config, drop, message):
    _assert_family_refuses(tmp_path, "tiny-gpt-oss", "gpt_oss", config, drop, message)


def test_gemma3_is_refused_by_name_where_the_bridge_cannot_build_it(monkeypatch, capsys):
    """`mrh parity --model tiny-gemma3` on Megatron-Bridge 0.6.2 (its Gemma 3 is TE only): exit 2 and one
    line naming the bridge and why, before any world starts; on mbridge the same preflight passes."""
    import harness.parity.cli as cli

    if bridge_converts("tiny-gemma3"):
        assert check_model_supported("tiny-gemma3").model_type == "gemma3_text"
        return
    monkeypatch.setattr(cli, "WorldPool", _untouched)
    assert cli.main(_parity_args("tiny-gemma3")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"not supported by the {current()} bridge" in err, err
    assert "Transformer Engine" in err, err
def test_glm4_moe_mtp_layers_are_ignored_explicitly_and_nothing_else(tmp_path):
    """A GLM-4.5 checkpoint's MTP layer (`num_nextn_predict_layers` 1: tensors under model.layers.<layers>)
    is not loaded, as HF's causal LM does not load it; a tensor one layer further is still refused."""
    mtp = {"model.layers.4.eh_proj.weight": torch.zeros(64, 128), "model.layers.4.enorm.weight": torch.ones(64)}
    path = local_checkpoint(tmp_path, "tiny-glm4-moe", {"num_nextn_predict_layers": 1}, mtp)
    assert check_model_supported(path).num_nextn_predict_layers == 1
    beyond = local_checkpoint(tmp_path / "beyond", "tiny-glm4-moe", {"num_nextn_predict_layers": 1},
                              {**mtp, "model.layers.5.enorm.weight": torch.ones(64)})
    with pytest.raises(UnsupportedModelError, match="no Megatron counterpart.*model.layers.5.enorm.weight"):
        check_model_supported(beyond)


def test_glm4_moe_passes_the_preflight_with_its_partial_rope():
    """Both bridges convert GLM-4.5-MoE (mbridge: override 14; Megatron-Bridge: GLM45_LOCAL_EXPERTS): the
    zoo model passes, its partial RoPE as rotary_percent 0.5."""
    from harness.bridge.preflight import rope_settings

    assert bridge_converts("tiny-glm4-moe")
    assert rope_settings(check_model_supported("tiny-glm4-moe")).rotary_percent == 0.5


def test_glm4_moe_tp_must_divide_the_shared_expert():
    """tp splits the shared expert as the dense MLP (etp splits only the routed experts): a width tp does not
    divide is one layout error before any rank starts, even where etp 1 leaves the routed experts whole."""
    from harness.parallel.layout import LayoutError, parse_layout, resolve, validate

    config = load_hf_config("tiny-glm4-moe")
    layout = resolve(parse_layout("tp2ep2etp1-sp"), 2)
    assert validate(layout, 2, config) == layout
    config.moe_intermediate_size = 33
    with pytest.raises(LayoutError, match="tp=2 does not divide the shared experts' width=33"):
        validate(layout, 2, config)

def test_gpt_oss_is_refused_by_name_where_the_bridge_has_none(monkeypatch, capsys):
    """`mrh parity --model tiny-gpt-oss` on mbridge 0.15.1 (no gpt-oss bridge; megatron-core 0.16.1 has the
    pieces, nothing maps HF's GptOss onto them): exit 2 and one line naming the bridge and what is missing,
    before any world starts. On Megatron-Bridge 0.6.2 the same preflight passes, the 20b shape's too."""
    import harness.parity.cli as cli

    if bridge_converts("tiny-gpt-oss"):
        assert current() == "megatron-bridge"
        assert check_model_supported("tiny-gpt-oss").model_type == "gpt_oss"
        assert check_model_supported("gpt-oss-shape").model_type == "gpt_oss"
        return
    assert current() == "mbridge"
    monkeypatch.setattr(cli, "WorldPool", _untouched)
    assert cli.main(_parity_args("tiny-gpt-oss")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not supported by the mbridge bridge" in err, err
    assert "mbridge 0.15.1 has no gpt_oss bridge" in err and "megatron-bridge" in err, err


# ----------------------------------------------------------------------------- DeepSeek-V3 (issue 37)
# What mbridge 0.15.1's DeepseekV3Bridge with megatron-core 0.16.1 (and the harness's overrides 15-17), or
# Megatron-Bridge 0.6.2's DeepSeekV3Bridge with megatron-core 0.19.2, would build otherwise than HF's
# DeepseekV3ForCausalLM, refused before any rank starts, on both stacks.
_DSV3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
DEEPSEEK_V3_UNSUPPORTED = {
    "dsv3-norm-topk": ({"norm_topk_prob": False}, (), "norm_topk_prob=False"),
    "dsv3-group-score": ({"num_experts_per_tok": 2}, (), "megatron-core scores a group by its top"),
    "dsv3-groups-split": ({"n_group": 3}, (), "n_group=3 does not divide n_routed_experts=16"),
    "dsv3-no-shared": ({"n_shared_experts": 0}, (), "n_shared_experts=0"),
    "dsv3-rope-plain-halves": ({"rope_interleave": False}, (), "rope_interleave=False"),
    "dsv3-mtp": ({"num_nextn_predict_layers": 1}, (), "num_nextn_predict_layers=1 (MTP)"),
    "dsv3-fp8": ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                          "weight_block_size": [128, 128]}}, (), "FP8-quantised checkpoint"),
    "dsv3-yarn-no-mscale-all-dim": ({"rope_parameters": {k: v for k, v in _DSV3_YARN.items() if k != "mscale_all_dim"}},
                                    (), "rope type 'yarn' needs mscale_all_dim"),
    "dsv3-yarn-attention-factor": ({"rope_parameters": {**_DSV3_YARN, "attention_factor": 1.0}}, (),
                                   "explicit attention_factor"),
    "dsv3-rope-linear": ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, (),
                         "rope type 'linear' is not supported (supported: default, yarn)"),
    "dsv3-attention-bias": ({"attention_bias": True}, (), "attention_bias=True"),
    "dsv3-bias-missing": (None, ("model.layers.1.mlp.gate.e_score_correction_bias",),
                          "lacks tensors the model needs: model.layers.1.mlp.gate.e_score_correction_bias"),
}


@pytest.mark.parametrize("config, drop, message", _params(DEEPSEEK_V3_UNSUPPORTED))
def test_deepseek_v3_unsupported_feature_is_one_error(tmp_path, config, drop, message):
    _assert_family_refuses(tmp_path, "tiny-deepseek-v3", "deepseek_v3", config, drop, message)


def test_moonlight_without_the_low_rank_query_is_converted_by_both_bridges():
    """q_lora_rank None (Moonlight: one q_proj, megatron-core's linear_q_proj, which both bridges map) passes,
    its expected tensors naming q_proj and none of DeepSeek-V3's low-rank query."""
    from harness.bridge.preflight import BRIDGE_MODEL_TYPES

    assert all("deepseek_v3" in types for types in BRIDGE_MODEL_TYPES.values())
    config = check_model_supported("tiny-moonlight")
    assert config.model_type == "deepseek_v3" and config.q_lora_rank is None and bridge_converts("tiny-moonlight")
    attention = {name.split(".self_attn.")[1] for name in expected_tensor_names(config) if ".self_attn." in name}
    assert "q_proj.weight" in attention and not {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"} & attention


# A checkpoint whose query tensors are the other MLA query's: one error before any rank (the bridge would map
# the config's query and leave the stored one unread, or find its own missing deep inside a rank).
_LOW_RANK_QUERY = ("q_a_proj", "q_a_layernorm", "q_b_proj")


def test_moonlight_checkpoint_with_the_low_rank_query_tensors_is_refused(tmp_path):
    """config.json's q_lora_rank null kept (local_checkpoint drops None values, and DeepseekV3Config would
    read an absent q_lora_rank as 1536), DeepSeek-V3's low-rank query tensors stored beside q_proj."""
    state = load_file(resolve_model("tiny-deepseek-v3") / "model.safetensors")
    path = tmp_path / "tiny-moonlight-edited"
    shutil.copytree(resolve_model("tiny-moonlight"), path)
    assert json.loads((path / "config.json").read_text())["q_lora_rank"] is None
    stored = load_file(path / "model.safetensors")
    low_rank = {n: t for n, t in state.items() if n.split(".")[-2] in _LOW_RANK_QUERY}
    save_file({**stored, **low_rank}, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="no Megatron counterpart .*self_attn.q_a_layernorm.weight"):
        check_model_supported(path)


def test_deepseek_v3_checkpoint_with_a_plain_query_is_refused(tmp_path):
    """q_lora_rank 32 in config.json, the tensors Moonlight's one q_proj: the low-rank query is missing."""
    state = load_file(resolve_model("tiny-moonlight") / "model.safetensors")
    plain = {n: t for n, t in state.items() if n.endswith("self_attn.q_proj.weight")}
    drop = tuple(n for n in load_file(resolve_model("tiny-deepseek-v3") / "model.safetensors")
                 if n.split(".")[-2] in _LOW_RANK_QUERY)
    path = local_checkpoint(tmp_path, "tiny-deepseek-v3", add=plain, drop=drop)
    with pytest.raises(UnsupportedModelError, match="no Megatron counterpart .*self_attn.q_proj.weight"):
        check_model_supported(path)


def test_deepseek_v3_layouts_mla_cannot_split_are_refused():
    """MLA's down projections are column-parallel on the local spec: tp must divide q_lora_rank and
    kv_lora_rank + qk_rope_head_dim (and the shared experts' width), one line before any rank starts."""
    from harness.parallel.layout import LayoutError, parse_layout, validate

    config = load_hf_config("tiny-deepseek-v3")
    validate(parse_layout("tp4-sp"), 4, model=config)  # 32, 32 + 8, 2 x 16 all split over 4
    config.kv_lora_rank, config.q_lora_rank = 30, 30  # 30 + 8 = 38
    with pytest.raises(LayoutError) as error:
        validate(parse_layout("tp4-sp"), 4, model=config)
    assert "tp=4 does not divide q_lora_rank=30" in str(error.value)
    assert "tp=4 does not divide kv_lora_rank + qk_rope_head_dim=38" in str(error.value)
    validate(parse_layout("tp2-sp"), 2, model=config)


def test_deepseek_v3_is_converted_by_both_bridges():
    """DeepSeek-V3 passes the preflight on mbridge and on Megatron-Bridge (issue 37: stack B's parity and
    training run in suites/moe); no bridge refuses it by name."""
    from harness.bridge.preflight import BRIDGE_MODEL_TYPES, BRIDGE_REFUSAL_REASONS

    assert all("deepseek_v3" in types for types in BRIDGE_MODEL_TYPES.values())
    assert not [key for key in BRIDGE_REFUSAL_REASONS if key[1] == "deepseek_v3"]
    assert bridge_converts("tiny-deepseek-v3")
    assert check_model_supported("tiny-deepseek-v3").model_type == "deepseek_v3"
