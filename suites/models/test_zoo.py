"""The model zoo, in the pytest parent process: no torch.distributed, no Megatron, no CPU patches.

These pin down what the Megatron parity checks rely on: weights that are deterministic by seed and
random everywhere (so a wrong mapping shows), a vocab that forces padding, and one resolver that
treats zoo names and local HF checkpoint dirs alike.
"""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.models import (
    ZOO,
    ModelNotFoundError,
    build_hf_model,
    is_complete,
    list_models,
    load_hf_config,
    materialize,
    resolve_model,
    zoo_dir,
)
from harness.models import checkpoints
from harness.models.zoo import VLLM_CPU_TWINS, ZERO_CENTERED_NORMS

TINY = [name for name in list_models() if name.startswith("tiny-")]
FAMILIES = ("tiny-qwen2", "tiny-qwen3", "tiny-llama")
# Tied by their family's design (every Gemma 3 ties lm_head to embed_tokens), not by a -tied suffix.
ALWAYS_TIED = ("qwen3-0.6b-shape", "tiny-gemma3", "gemma3-shape")
MLA = ("tiny-deepseek-v3", "tiny-moonlight")  # DeepSeek-V3's architecture: heads and widths of its own


def _state(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    return build_hf_model(name, seed=seed).state_dict()


def test_zoo_names():
    expected = {f"{family}{suffix}" for family in FAMILIES for suffix in ("", "-tied")}
    expected |= {"tiny-gpt-oss", "gpt-oss-shape"}  # gpt-oss (issue 37)
    assert set(list_models()) == expected | {"qwen3-0.6b-shape", "tiny-qwen3-kv4", "tiny-qwen3-hd32", "tiny-llama3",
                                                 "tiny-qwen3-moe", "tiny-qwen3-moe-hd32", "tiny-mixtral",
                                                 "tiny-qwen3-tied-hd32", "tiny-qwen3-kv4-hd32", "tiny-qwen2-moe",
                                                 "qwen3-8b-shape", "qwen3-30b-a3b-shape",
                                                 "tiny-gemma3", "gemma3-shape",
                                                 "tiny-glm4-moe", "glm4.5-moe-shape", "glm4.5-air-shape",
                                                 "tiny-deepseek-v3", "deepseek-v3-shape",
                                                 "tiny-moonlight", "moonlight-shape", "qwen2-moe-shape"} | \
        set(VLLM_CPU_TWINS)  # the vLLM CPU tier's twins of issue 37's families: test_vllm_cpu_twins below
    assert list(ZOO) == list_models() == sorted(list_models())
    for name in set(list_models()) - set(VLLM_CPU_TWINS):
        assert ZOO[name].tied == (name.removesuffix("-hd32").endswith("-tied") or name in ALWAYS_TIED)


@pytest.mark.parametrize("name", list(VLLM_CPU_TWINS))
def test_vllm_cpu_twins_are_their_tiny_model_with_heads_vllm_runs(name):
    """Each twin differs from its tiny model in the listed keys only (and what DeepSeek-V3's config derives
    from qk_rope_head_dim), has heads vLLM's CPU kernels take, and keeps its weight adjustment and tying."""
    base, changes = VLLM_CPU_TWINS[name]
    twin, tiny = load_hf_config(name).to_dict(), load_hf_config(base).to_dict()
    different = {key for key in twin.keys() | tiny.keys() if twin.get(key) != tiny.get(key)}
    assert different - {"head_dim", "qk_head_dim"} == set(changes) - {"head_dim"}
    assert all(twin[key] == value for key, value in changes.items())
    config = load_hf_config(name)
    heads = config.kv_lora_rank + config.qk_rope_head_dim if base in MLA else config.head_dim
    assert heads == (576 if base in MLA else 32)
    assert (ZOO[name].adjust_weights, ZOO[name].tied) == (ZOO[base].adjust_weights, ZOO[base].tied)


# MLA and the vLLM twins: their own tests
@pytest.mark.parametrize("name", [name for name in TINY if name not in MLA and name not in VLLM_CPU_TWINS])
def test_tiny_shape_exercises_padding_and_layouts(name):
    config = load_hf_config(name)
    assert config.vocab_size % 2 and config.vocab_size % 4, "vocab must force Megatron padding"
    for pp in (1, 2, 4):
        assert config.num_hidden_layers % pp == 0
    kv_heads = 4 if "-kv4" in name else 2  # kv4: full multi-head attention, TP4-valid
    head_dim = 32 if name.endswith("-hd32") else 16  # hd32: the smallest head vLLM's CPU kernels take
    # gpt-oss: square experts (width = hidden) and max_position_embeddings = YaRN's factor x original window
    width, positions = (64, 131072) if name == "tiny-gpt-oss" else (128, 128)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size, config.max_position_embeddings) == \
        (64, 4, kv_heads, head_dim, width, positions)
    assert config.tie_word_embeddings == (name.removesuffix("-hd32").endswith("-tied") or name in ALWAYS_TIED)


def test_family_features():
    assert load_hf_config("tiny-qwen2").model_type == "qwen2"
    assert any(k.endswith("q_proj.bias") for k in _state("tiny-qwen2"))  # QKV bias
    assert any(k.endswith("k_norm.weight") for k in _state("tiny-qwen3"))  # QK-norm
    llama = _state("tiny-llama")
    assert not any(k.endswith(".bias") or "q_norm" in k for k in llama)
    assert load_hf_config("tiny-llama").rope_parameters["rope_type"] == "default"
    assert load_hf_config("tiny-llama3").rope_parameters == {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    assert _state("tiny-llama3").keys() == llama.keys()  # only the RoPE differs


def test_qwen2_moe_family_features():
    """Qwen2-MoE: QKV bias, routed experts whose top-k is not renormalised, and a shared expert (4 x the
    routed width, as Qwen1.5-MoE-A2.7B's) behind a sigmoid gate, hidden -> 1; every layer sparse."""
    config = load_hf_config("tiny-qwen2-moe")
    assert config.model_type == "qwen2_moe" and config.qkv_bias and not config.norm_topk_prob
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.shared_expert_intermediate_size) == (4, 2, 32, 128)
    assert config.decoder_sparse_step == 1 and config.mlp_only_layers == [] and not config.output_router_logits
    state = _state("tiny-qwen2-moe")
    assert state["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert state["model.layers.3.mlp.shared_expert.down_proj.weight"].shape == (64, 128)
    assert any(k.endswith("q_proj.bias") for k in state) and not any("q_norm" in k for k in state)


def test_gemma3_family_features():
    """Gemma 3 text: every feature on at the tiny shape (harness.models.zoo: 3 sliding-window layers of 8
    keys then a global one, local/global RoPE bases, query_pre_attn_scalar != head_dim, QK-norm, pre/post
    feedforward norms, gelu-tanh, tied), its norms zero-centered with nonzero random w."""
    config = load_hf_config("tiny-gemma3")
    assert config.model_type == "gemma3_text" and config.hidden_activation == "gelu_pytorch_tanh"
    assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention"] and config.sliding_window == 8
    assert config.rope_parameters == {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "default", "rope_theta": 100000.0}}
    assert config.query_pre_attn_scalar == 24 != config.head_dim and config.tie_word_embeddings
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    model = build_hf_model("tiny-gemma3")
    assert float(model.model.embed_tokens.embed_scale) == 8.0  # sqrt(hidden 64)
    state = model.state_dict()
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
        w = state[f"model.layers.3.{norm}.weight"]
        assert abs(w.mean()) < 0.1 and 0.05 < w.std() < 0.2, norm  # w ~ 0.1 N(0, 1): scale 1 + w


def test_gemma3_shape_is_gemma_3_1b_text():
    """gemma3-shape: google/gemma-3-1b-pt's text dims with 4 of its 26 layers (config only: 262144 x 1152
    embeddings take seconds to draw)."""
    from harness.bridge.preflight import UnsupportedModelError, bridge_converts, check_model_supported

    config = load_hf_config("gemma3-shape")
    assert config.model_type == "gemma3_text"
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.intermediate_size, config.vocab_size, config.query_pre_attn_scalar, config.sliding_window) == \
        (1152, 4, 1, 256, 6912, 262144, 256, 512)
    assert config.num_hidden_layers == 4 and config.layer_types[-1] == "full_attention"
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000
    assert config.tie_word_embeddings
    if bridge_converts("gemma3-shape"):  # its every feature is one the harness builds
        assert check_model_supported("gemma3-shape").model_type == "gemma3_text"
    else:  # Megatron-Bridge 0.6.2: refused by name (suites/bridge/test_preflight.py)
        with pytest.raises(UnsupportedModelError, match="gemma3_text"):
            check_model_supported("gemma3-shape")


def test_gpt_oss_family_features():
    """gpt-oss: every feature where it shows. Sinks spread to N(0, 1) (nonzero, of both signs); the sliding
    window (8) shorter than the parity batch (24 positions) on layers 0 and 2; YaRN in all three of its
    bands; biases everywhere; square experts; and the SwiGLU clamp biting on real activations."""
    import math

    from harness.data.rl_batch import STANDARD_SEQ_LEN

    config = load_hf_config("tiny-gpt-oss")
    assert config.model_type == "gpt_oss" and config.attention_bias and not config.tie_word_embeddings
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert 1 < config.sliding_window < STANDARD_SEQ_LEN
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    assert config.intermediate_size == config.hidden_size  # square, as gpt-oss-20b's
    rope = config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 32.0 and rope["truncate"] is False
    # YaRN's correction range (HF's find_correction_dim) over the head's 8 frequencies: some kept, some ramped,
    # some interpolated.
    dim, base, window = config.head_dim, rope["rope_theta"], rope["original_max_position_embeddings"]
    bound = [dim * math.log(window / (beta * 2 * math.pi)) / (2 * math.log(base)) for beta in (32.0, 1.0)]
    assert 0 < bound[0] < bound[1] < dim // 2 - 1
    model = build_hf_model("tiny-gpt-oss")
    state = model.state_dict()
    sinks = torch.stack([state[f"model.layers.{i}.self_attn.sinks"] for i in range(4)])
    assert sinks.abs().min() > 0 and sinks.min() < 0 < sinks.max() and 0.5 < sinks.std() < 2
    for name in ("mlp.router.bias", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias",
                 "self_attn.o_proj.bias", "self_attn.q_proj.bias"):
        assert state[f"model.layers.1.{name}"].abs().min() > 0, name
    assert state["model.layers.0.mlp.experts.down_proj"].shape == (4, 64, 64)
    # The clamp bites: the experts' pre-activations on a real forward pass 7 (the gate above, up either way).
    seen = []
    experts = model.model.layers[1].mlp.experts
    hook = experts.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        model(torch.randint(3, config.vocab_size, (2, STANDARD_SEQ_LEN), generator=torch.Generator().manual_seed(0)))
    hook.remove()
    pre = seen[0] @ experts.gate_up_proj + experts.gate_up_proj_bias[:, None, :]  # every expert, every token
    clamped = ((pre[..., ::2] > experts.limit).float().mean().item(),
               (pre[..., 1::2].abs() > experts.limit).float().mean().item())
    assert all(0.001 < share < 0.2 for share in clamped), clamped


def test_gpt_oss_shape_is_the_real_architecture():
    config = load_hf_config("gpt-oss-shape")  # config only: never built (~2.5e9 parameters)
    assert config.model_type == "gpt_oss"
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.intermediate_size, config.num_local_experts, config.num_experts_per_tok, config.vocab_size,
            config.sliding_window) == (2880, 64, 8, 64, 2880, 32, 4, 201088, 128)
    assert 2 <= config.num_hidden_layers <= 4 and config.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["rope_theta"] == 150000.0
    assert config.attention_bias and not config.tie_word_embeddings and ZOO["gpt-oss-shape"].adjust_weights is None


def test_qwen3_0p6b_shape_is_the_real_architecture():
    config = load_hf_config("qwen3-0.6b-shape")  # config only: building the weights takes ~20 s
    assert config.model_type == "qwen3"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.intermediate_size,
            config.vocab_size) == (1024, 28, 16, 8, 128, 3072, 151936)
    assert config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 1_000_000


@pytest.mark.parametrize("name, model_type, dims, moe", [
    # Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B's published config.json: hidden, heads, KV heads, head_dim,
    # intermediate, vocab; the experts' (count, top-k, width, renormalised top-k)
    ("qwen3-8b-shape", "qwen3", (4096, 32, 8, 128, 12288, 151936), None),
    ("qwen3-30b-a3b-shape", "qwen3_moe", (2048, 32, 4, 128, 6144, 151936), (128, 8, 768, True)),
])
def test_the_real_shapes_are_the_published_architectures_at_4_layers(name, model_type, dims, moe):
    config = load_hf_config(name)  # config only: the weights (2-3B parameters) are built on GPUs
    assert config.model_type == model_type and config.num_hidden_layers == 4 and not config.tie_word_embeddings
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.intermediate_size, config.vocab_size) == dims
    assert config.rope_parameters["rope_theta"] == 1_000_000
    if moe:
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                config.norm_topk_prob) == moe
        assert config.decoder_sparse_step == 1 and not config.mlp_only_layers  # every layer sparse


# ----------------------------------------------------------------------------- GLM-4.5-MoE (issue 37)
def test_glm4_moe_family_features():
    """GLM-4.5-MoE: RoPE on half of each head, q/k/v biases, QK-norm, a dense first layer, then 4 routed
    experts (sigmoid + a random expert bias, top-2, renormalised, x 2.5) and one ungated shared expert."""
    config = load_hf_config("tiny-glm4-moe")
    assert config.model_type == "glm4_moe" and config.rope_parameters["partial_rotary_factor"] == 0.5
    assert config.attention_bias and config.use_qk_norm and config.norm_topk_prob
    assert (config.first_k_dense_replace, config.n_routed_experts, config.num_experts_per_tok,
            config.moe_intermediate_size, config.n_shared_experts, config.routed_scaling_factor) == (1, 4, 2, 32, 1, 2.5)
    assert (config.n_group, config.topk_group, config.num_nextn_predict_layers) == (1, 1, 0)
    state = _state("tiny-glm4-moe")
    assert state["model.layers.0.mlp.gate_proj.weight"].shape == (128, 64)  # the dense first layer
    assert state["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (64, 32)
    assert not any(k.startswith("model.layers.0.mlp.gate.") or "shared_expert_gate" in k for k in state)
    assert any(k.endswith("q_proj.bias") for k in state) and any(k.endswith("k_norm.weight") for k in state)
    assert all(state[f"model.layers.{i}.mlp.gate.e_score_correction_bias"].abs().min() > 0 for i in (1, 2, 3))


@pytest.mark.nightly  # CI: the catalog's glm-expert-bias-not-loaded, caught at dp2 (top-1 agreement 0.58)
def test_the_glm4_moe_expert_bias_changes_which_experts_win():
    """The tiny model's e_score_correction_bias decides the top 2 for some tokens in every sparse layer
    (so a bridge that drops it shows: the catalog's glm-expert-bias-not-loaded)."""
    model = build_hf_model("tiny-glm4-moe")
    tokens = torch.randint(3, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    inputs = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda gate, args, out, i=i: inputs.__setitem__(i, args[0]))
             for i, layer in enumerate(model.model.layers) if i >= model.config.first_k_dense_replace]
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    assert sorted(inputs) == [1, 2, 3]
    for i, hidden in inputs.items():
        gate = model.model.layers[i].mlp.gate
        scores = torch.sigmoid(torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(), gate.weight))
        with_bias = torch.topk(scores + gate.e_score_correction_bias, 2, dim=-1).indices.sort(dim=-1).values
        without = torch.topk(scores, 2, dim=-1).indices.sort(dim=-1).values
        changed = (with_bias != without).any(dim=-1).float().mean().item()
        assert changed > 0, f"layer {i}: the expert bias changes no token's top 2"


@pytest.mark.parametrize("name, dims, moe, qk_norm", [
    # zai-org/GLM-4.5 and zai-org/GLM-4.5-Air's published config.json: hidden, heads, KV heads, head_dim,
    # the dense layers' intermediate, vocab; the experts' (count, top-k, width, routed_scaling_factor).
    # transformers' Glm4MoeConfig defaults are GLM-4.5-Air's (hidden 4096, 10944, 1408, 128 experts, 1.0).
    ("glm4.5-moe-shape", (5120, 96, 8, 128, 12288, 151552), (160, 8, 1536, 2.5), True),
    ("glm4.5-air-shape", (4096, 96, 8, 128, 10944, 151552), (128, 8, 1408, 1.0), False),
])
def test_the_glm45_shapes_are_the_published_architectures_at_4_layers(name, dims, moe, qk_norm):
    from harness.bridge.preflight import check_model_supported, rope_settings

    config = check_model_supported(name)  # config only (and the preflight): never built on the CPU tier
    assert config.model_type == "glm4_moe" and config.num_hidden_layers == 4 and not config.tie_word_embeddings
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.intermediate_size, config.vocab_size) == dims
    assert (config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.routed_scaling_factor) == moe
    assert config.use_qk_norm == qk_norm and config.attention_bias and config.norm_topk_prob
    assert (config.n_shared_experts, config.n_group, config.topk_group, config.first_k_dense_replace) == (1, 1, 1, 1)
    assert rope_settings(config).rotary_percent == 0.5 and config.rope_parameters["rope_theta"] == 1_000_000


@pytest.mark.parametrize("name", TINY)
def test_same_seed_same_weights_other_seed_other_weights(name):
    first, again, other = _state(name, 0), _state(name, 0), _state(name, 1)
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert all(not torch.equal(first[k], other[k]) for k in first)


@pytest.mark.parametrize("name", TINY)
def test_every_weight_is_random(name):
    state = _state(name)
    constant = [k for k, v in state.items() if torch.all(v == 1) or torch.all(v == 0)]
    assert constant == [], f"not randomized: {constant}"
    # A zero-centered norm (Gemma: scale 1 + w) stores w: its scale is drawn as every other norm's.
    offset = 1.0 if load_hf_config(name).model_type in ZERO_CENTERED_NORMS else 0.0
    norms = [v + offset for k, v in state.items() if "norm" in k]
    assert norms and all(v.std() > 0.01 and abs(v.mean() - 1) < 0.1 for v in norms)


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_lm_head_is_the_embedding(family):
    tied, untied = build_hf_model(f"{family}-tied"), build_hf_model(family)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_dtype_is_the_rounded_float32_model():
    fp32, bf16 = build_hf_model("tiny-qwen3", torch.float32), build_hf_model("tiny-qwen3", torch.bfloat16)
    weight = "model.layers.0.self_attn.k_norm.weight"
    assert bf16.state_dict()[weight].dtype == torch.bfloat16
    assert torch.equal(bf16.state_dict()[weight], fp32.state_dict()[weight].bfloat16())


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen2-tied", "tiny-llama"])
def test_hf_forward(name):
    model = build_hf_model(name)
    assert model.config._attn_implementation == "eager"
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens).logits
    assert logits.shape == (2, 12, model.config.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0.1  # weights give non-flat softmax


def test_materialize_writes_a_complete_dir(tmp_path):
    path = materialize("tiny-qwen3-tied", tmp_path, seed=3)
    assert path == zoo_dir("tiny-qwen3-tied", tmp_path, 3) == tmp_path / "tiny-qwen3-tied-seed3"
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert is_complete(path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "temp dirs must not be left behind"
    on_disk = load_file(path / "model.safetensors")
    built = _state("tiny-qwen3-tied", seed=3)
    assert "lm_head.weight" not in on_disk  # tied: saved once, as embed_tokens
    assert all(torch.equal(on_disk[k], built[k]) for k in on_disk)
    assert set(built) - set(on_disk) == {"lm_head.weight"}
    assert json.loads((path / "config.json").read_text())["vocab_size"] == 251


def test_materialize_reuses_a_complete_dir(tmp_path, monkeypatch):
    path = materialize("tiny-llama", tmp_path)
    stamp = (path / "model.safetensors").stat().st_mtime_ns

    def must_not_rebuild(*args, **kwargs):
        raise AssertionError("a complete dir was rebuilt")

    monkeypatch.setattr(checkpoints, "build_hf_model", must_not_rebuild)
    assert materialize("tiny-llama", tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_materialize_replaces_an_incomplete_dir(tmp_path):
    partial = zoo_dir("tiny-qwen2", tmp_path, 0)
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    assert not is_complete(partial)
    assert materialize("tiny-qwen2", tmp_path) == partial
    assert is_complete(partial)


def test_materialize_concurrent_callers_agree(tmp_path):
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(materialize("tiny-qwen2", tmp_path)))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(paths)) == 1 and is_complete(paths[0])
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]


def test_resolve_model_accepts_zoo_names_and_local_dirs(tmp_path):
    zoo_path = resolve_model("tiny-qwen3", tmp_path / "cache", seed=2)
    assert zoo_path == zoo_dir("tiny-qwen3", tmp_path / "cache", 2)
    user_dir = tmp_path / "my-checkpoint"
    shutil.copytree(zoo_path, user_dir)
    (user_dir / checkpoints.MANIFEST).unlink()  # a user's dir has no zoo manifest
    assert resolve_model(str(user_dir), tmp_path / "cache") == user_dir
    assert resolve_model(user_dir) == user_dir
    assert load_hf_config(user_dir).vocab_size == 251
    from_dir, from_zoo = build_hf_model(user_dir), build_hf_model("tiny-qwen3", seed=2)
    tokens = torch.arange(10).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(from_dir(tokens).logits, from_zoo(tokens).logits)


def _assert_lists_zoo(message: str) -> None:
    for name in list_models():
        assert name in message


def test_resolve_model_unknown_name(tmp_path):
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("tiny-gpt5", tmp_path)
    assert "unknown model 'tiny-gpt5'" in str(error.value)
    _assert_lists_zoo(str(error.value))
    with pytest.raises(ModelNotFoundError, match="unknown zoo model 'tiny-gpt5'"):
        materialize("tiny-gpt5", tmp_path)


def test_resolve_model_dir_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model(tmp_path)
    assert "config.json is missing" in str(error.value) and str(tmp_path) in str(error.value)
    _assert_lists_zoo(str(error.value))


def test_resolve_model_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model(tmp_path)
    assert "no *.safetensors weights" in str(error.value)
    _assert_lists_zoo(str(error.value))


def test_resolve_model_dir_with_missing_shard(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelNotFoundError, match="model-00002-of-00002.safetensors"):
        resolve_model(tmp_path)


def test_deepseek_v3_family_features():
    """DeepSeek-V3 on the tiny scale, every feature on: MLA with q and kv LoRA ranks, YaRN with mscale, a
    dense first layer, 16 experts in 4 groups (top-4 of the best 2), a random e_score_correction_bias,
    routed_scaling_factor 2.5, 2 shared experts; TP 1/2/4 and PP 1/2/4 valid, the vocab padded."""
    config = load_hf_config("tiny-deepseek-v3")
    assert config.model_type == "deepseek_v3" and config.vocab_size % 2 and config.vocab_size % 4
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.q_lora_rank,
            config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == \
        (64, 4, 4, 32, 32, 16, 8, 16)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group,
            config.n_shared_experts, config.routed_scaling_factor, config.first_k_dense_replace) == (16, 4, 4, 2, 2, 2.5, 1)
    assert config.num_experts_per_tok == 2 * config.topk_group  # megatron-core's group score = HF's top-2
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] > 1
    assert config.rope_parameters["mscale_all_dim"] and config.norm_topk_prob and not config.num_nextn_predict_layers
    state = _state("tiny-deepseek-v3")
    assert "model.layers.0.mlp.down_proj.weight" in state and "model.layers.0.mlp.gate.weight" not in state
    bias = state["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.shape == (16,) and bias.std() > 0.01
    assert state["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"].shape == (32 + 8, 64)
    assert state["model.layers.3.mlp.shared_experts.down_proj.weight"].shape == (64, 32)


def test_deepseek_v3_shape_is_the_real_architecture():
    """The published DeepSeek-V3 dims, cut to 4 layers: defined for GPU runs, never built here (config only)."""
    config = load_hf_config("deepseek-v3-shape")
    assert config.model_type == "deepseek_v3"
    assert (config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
            config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.intermediate_size,
            config.moe_intermediate_size, config.vocab_size) == (7168, 128, 1536, 512, 128, 64, 128, 18432, 2048, 129280)
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group, config.topk_group,
            config.n_shared_experts, config.routed_scaling_factor, config.first_k_dense_replace) == (256, 8, 8, 4, 1, 2.5, 3)
    assert 2 <= config.num_hidden_layers <= 4 and config.num_hidden_layers > config.first_k_dense_replace
    assert config.rope_parameters["factor"] == 40 and config.rope_parameters["original_max_position_embeddings"] == 4096


def test_moonlight_family_features():
    """Moonlight: DeepSeek-V3's architecture without q LoRA (one q_proj, no q_a_layernorm), plain RoPE and no
    expert groups, routed_scaling_factor 2.446; the rest as tiny-deepseek-v3 (MLA's kv LoRA, a dense first layer,
    16 experts with a random expert bias, 2 shared experts)."""
    config = load_hf_config("tiny-moonlight")
    assert config.model_type == "deepseek_v3" and config.q_lora_rank is None and config.kv_lora_rank == 32
    assert config.rope_parameters["rope_type"] == "default"
    assert (config.n_group, config.topk_group, config.routed_scaling_factor, config.n_shared_experts) == (1, 1, 2.446, 2)
    state = _state("tiny-moonlight")
    assert state["model.layers.2.self_attn.q_proj.weight"].shape == (4 * (16 + 8), 64)
    assert not any("q_a_proj" in name or "q_a_layernorm" in name or "q_b_proj" in name for name in state)
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].std() > 0.01


@pytest.mark.parametrize("name, dims, moe", [
    # moonshotai/Moonlight-16B-A3B's config.json: hidden, heads, q LoRA rank, kv LoRA rank, nope, rope and v head
    # dims, intermediate, vocab; (experts, top-k, width, groups, shared, routed scale, dense first layers)
    ("moonlight-shape", (2048, 16, None, 512, 128, 64, 128, 11264, 163840), (64, 6, 1408, 1, 2, 2.446, 1)),
])
def test_moonlight_shape_is_the_real_architecture(name, dims, moe):
    config = load_hf_config(name)  # config only: ~2.4B parameters, built on GPUs
    assert config.model_type == "deepseek_v3" and config.num_hidden_layers == 4 and not config.tie_word_embeddings
    assert (config.hidden_size, config.num_attention_heads, config.q_lora_rank, config.kv_lora_rank,
            config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.intermediate_size,
            config.vocab_size) == dims
    assert (config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.n_group,
            config.n_shared_experts, config.routed_scaling_factor, config.first_k_dense_replace) == moe
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 50000.0} and config.norm_topk_prob


def test_qwen2_moe_shape_is_qwen1_5_moe_a2_7b():
    """Qwen/Qwen1.5-MoE-A2.7B's config.json at 4 layers: 60 experts of 1408, top-4 not renormalised, a gated
    shared expert of 5632, QKV bias, no GQA (config only: ~2.9B parameters, built on GPUs)."""
    config = load_hf_config("qwen2-moe-shape")
    assert config.model_type == "qwen2_moe" and config.num_hidden_layers == 4 and not config.tie_word_embeddings
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
            config.vocab_size) == (2048, 16, 16, 5632, 151936)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
            config.shared_expert_intermediate_size, config.norm_topk_prob) == (60, 4, 1408, 5632, False)
    assert config.qkv_bias and config.decoder_sparse_step == 1 and not config.mlp_only_layers
    assert config.rope_parameters["rope_theta"] == 1_000_000
