"""The parity check's wrong variants, implemented: bridge (weights) and logprobs (feeding) entries
of the catalog (`harness.variants`, which says what each is and why).

Rank-side: `apply_variant(id, models)` makes freshly loaded chunks wrong in that way, on every rank
at once (some variants communicate over the tensor-parallel group).
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from harness.variants import VariantError, require

# A variant that changes how the batch is fed, not the weights (see harness.logprobs.megatron).
FORCED_PACKING = {"unmasked-padding": "none"}


def check_variant(variant_id: str | None, layout, config):
    """The catalog entry, after checking it is a parity variant that applies (parent side)."""
    return require(variant_id, check="parity", layout=layout, config=config)


# ----------------------------------------------------------------------------- rank-side
def _params(models: list[torch.nn.Module]):
    from harness.bridge import unwrap_model

    for chunk in unwrap_model(list(models)):
        yield chunk, dict(chunk.named_parameters())


def _layers(models, number: int):
    """The decoder layer with 1-based global `layer_number` on this rank (none if another stage holds it)."""
    from harness.bridge import unwrap_model

    for chunk in unwrap_model(list(models)):
        for layer in chunk.decoder.layers:
            if layer.layer_number == number:
                yield layer


@torch.no_grad()
def _swap_gate_up(models) -> None:
    for _, params in _params(models):
        for name, weight in params.items():
            if name.endswith("mlp.linear_fc1.weight"):
                # Each TP shard holds [gate_shard; up_shard] stacked on dim 0.
                gate, up = weight.chunk(2, dim=0)
                weight.copy_(torch.cat([up, gate], dim=0))


@torch.no_grad()
def _wrong_rope_base(models) -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for chunk, _ in _params(models):
        rope = chunk.rotary_pos_emb
        dim = rope.inv_freq.numel() * 2
        # inv_freq = base^(-2i/dim): a base 1.01x multiplies each by 1.01^(-2i/dim).
        exponent = -torch.arange(0, dim, 2, dtype=torch.float64, device=rope.inv_freq.device) / dim
        rope.inv_freq = (rope.inv_freq.double() * 1.01 ** exponent).to(rope.inv_freq.dtype)
    RotaryEmbedding.forward.cache_clear()  # freqs are memoized per (module, length)


_LAYER0_NORM = re.compile(r"decoder\.layers\.0\.(input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)$")


@torch.no_grad()
def _scale_norm(models) -> None:
    for chunk, params in _params(models):
        if chunk.decoder.layers[0].layer_number != 1:
            continue  # global layer 0 lives on the first (virtual) stage only
        for name, weight in params.items():
            if _LAYER0_NORM.search(name):
                weight.mul_(1.01)


@torch.no_grad()
def _skip_layer(models) -> None:
    """Global layer 1 (layer_number 2) as Megatron initializes it when nothing is loaded:
    weights ~ N(0, init_method_std), norm weights 1, biases 0."""
    from megatron.core import parallel_state as ps

    for layer in _layers(models, number=2):
        std = layer.config.init_method_std
        generator = torch.Generator().manual_seed(1000 + ps.get_tensor_model_parallel_rank())
        for name, param in sorted(layer.named_parameters()):
            if name.endswith("bias"):
                param.zero_()
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_((torch.randn(param.shape, generator=generator) * std).to(param.dtype))


@torch.no_grad()
def _swap_tp_shards(models) -> None:
    """Every linear_fc1 weight: this rank takes the shard of the mirrored TP rank (tp-1-r)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    size = ps.get_tensor_model_parallel_world_size()
    for _, params in _params(models):
        for name, weight in sorted(params.items()):
            if name.endswith("mlp.linear_fc1.weight"):
                shards = [torch.empty_like(weight) for _ in range(size)]
                dist.all_gather(shards, weight.contiguous(), group=group)
                weight.copy_(shards[size - 1 - rank])


@torch.no_grad()
def _unsync_tied_embedding(models) -> None:
    for chunk, params in _params(models):
        if getattr(chunk, "post_process", False) and not getattr(chunk, "pre_process", True):
            weight = params["output_layer.weight"]
            generator = torch.Generator().manual_seed(1234)
            fresh = torch.randn(weight.shape, generator=generator) * weight.float().std().item()
            weight.copy_(fresh.to(weight.dtype))


@torch.no_grad()
def _drop_rope_scaling(models) -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from harness.bridge import hf_config
    from harness.bridge.preflight import rope_settings

    config = hf_config(models)
    if rope_settings(config).llama3 is None:  # a no-op variant would "pass" its negative control
        raise VariantError("variant 'dropped-rope-scaling' needs a model with Llama-3 RoPE scaling")
    for chunk, _ in _params(models):
        rope = chunk.rotary_pos_emb
        plain = RotaryEmbedding(kv_channels=rope.inv_freq.numel() * 2, rotary_percent=1.0,
                                rotary_base=rope_settings(config).theta, use_cpu_initialization=True)
        rope.inv_freq = plain.inv_freq.to(rope.inv_freq.device)
    RotaryEmbedding.forward.cache_clear()  # freqs are memoized per (module, length)


def _moe_layers(models, what: str):
    """Every MoE layer (its MoELayer) on this rank; VariantError on a dense model."""
    from harness.bridge import unwrap_model

    layers = [layer.mlp for chunk in unwrap_model(list(models)) for layer in chunk.decoder.layers
              if hasattr(getattr(layer, "mlp", None), "router")]
    if not layers:
        raise VariantError(f"variant {what!r} needs a Mixture-of-Experts model")
    return layers


def _expert_pairs(experts):
    """The parameters of local experts 0 and 1, paired: SequentialMLP's (the local spec) or
    TEGroupedMLP's (TE's spec: each grouped linear keeps expert i's weight as `weight{i}`)."""
    local = getattr(experts, "local_experts", None)
    if local is not None:
        if len(local) < 2:
            raise VariantError("variant 'swapped-experts' needs two experts on a rank")
        return list(zip(local[0].parameters(), local[1].parameters(), strict=True))
    linears = [getattr(experts, name, None) for name in ("linear_fc1", "linear_fc2")]
    if any(linear is None or not hasattr(linear, "weight1") for linear in linears):
        raise VariantError("variant 'swapped-experts' needs SequentialMLP or TE grouped experts, two on a rank")
    return [(linear.weight0, linear.weight1) for linear in linears]


@torch.no_grad()
def _swap_experts(models) -> None:
    """Global experts 0 and 1 of every MoE layer swapped (both sit on expert-parallel rank 0)."""
    from megatron.core import parallel_state

    for moe in _moe_layers(models, "swapped-experts"):
        pairs = _expert_pairs(moe.experts)
        if parallel_state.get_expert_model_parallel_rank() == 0:
            for first, second in pairs:
                kept = first.clone()
                first.copy_(second)
                second.copy_(kept)


def _router_in_bf16(models) -> None:
    for moe in _moe_layers(models, "router-in-bf16"):
        router = moe.router
        if router.bias is not None or router.weight.dtype != torch.float32:
            raise VariantError("variant 'router-in-bf16' needs an fp32 router without bias")

        def gating(hidden, router=router):  # the logits in bf16, handed on in the run's dtype
            return torch.nn.functional.linear(hidden.to(torch.bfloat16), router.weight.to(torch.bfloat16)).to(hidden.dtype)
        router.gating = gating


def _topk_off_by_one(models) -> None:
    configs = {}
    for moe in _moe_layers(models, "topk-off-by-one"):
        if moe.router.topk < 2:
            raise VariantError("variant 'topk-off-by-one' needs top-k >= 2")
        moe.router.topk -= 1
        if hasattr(moe.token_dispatcher, "router_topk"):
            moe.token_dispatcher.router_topk -= 1
        configs[id(moe.config)] = moe.config  # one config object may serve every layer
    for config in configs.values():  # the dispatchers size their buffers from it
        config.moe_router_topk -= 1


def _mixtral_pre_softmax(models) -> None:
    from harness.bridge import hf_config

    if hf_config(models).model_type != "mixtral":
        raise VariantError("variant 'mixtral-pre-softmax' is mbridge's Mixtral routing: it needs a Mixtral model")
    for moe in _moe_layers(models, "mixtral-pre-softmax"):
        moe.config.moe_router_pre_softmax = True  # read at every forward


def _drop_shared_expert_gate(models) -> None:
    """The shared expert without its sigmoid gate, as megatron-core builds it when the bridge leaves
    `moe_shared_expert_gate` False (mbridge 0.15.1's Qwen2MoEBridge): its output added unscaled. The
    loaded gate weight stays in place, unread (SharedExpertMLP.forward reads the flag at every call)."""
    gated = [moe.shared_experts for moe in _moe_layers(models, "shared-expert-gate-dropped")
             if getattr(getattr(moe, "shared_experts", None), "use_shared_expert_gate", False)]
    if not gated:
        raise VariantError("variant 'shared-expert-gate-dropped' needs a MoE model whose shared expert has a "
                           "sigmoid gate (Qwen2-MoE)")
    for shared in gated:
        shared.use_shared_expert_gate = False


def _gemma3_modules(models, variant: str, kind: str) -> list[torch.nn.Module]:
    """This rank's modules of one of harness.bridge.gemma3's kinds; a VariantError if the model
    has none anywhere (checked on every rank: a pipeline stage may hold none of some kinds)."""
    from harness.bridge import unwrap_model
    from harness.bridge.gemma3 import ZeroCenteredRMSNorm

    chunks = unwrap_model(list(models))
    if not any(type(m).__name__ == "RowParallelLinearPostNorm" for c in chunks for m in c.modules()):
        raise VariantError(f"variant {variant!r} needs a Gemma 3 text model (harness.bridge.gemma3)")
    found = {"norm": lambda m: isinstance(m, ZeroCenteredRMSNorm),
             "embedding": lambda m: type(m).__name__ == "ScaledEmbedding",
             "attention": lambda m: type(m).__name__ == "SlidingWindowAttention" and m.window is not None}[kind]
    return [m for c in chunks for m in c.modules() if found(m)]


def _gemma_norm_not_zero_centered(models) -> None:
    """Every Gemma norm computes w * x with HF's w (a plain RMSNorm loaded with Gemma's weights)."""
    for norm in _gemma3_modules(models, "gemma-norm-not-zero-centered", "norm"):
        norm.zero_centered = False


def _gemma_embed_scale_dropped(models) -> None:
    """The word embedding not multiplied by sqrt(hidden) (megatron-core's LanguageModelEmbedding)."""
    for embedding in _gemma3_modules(models, "gemma-embed-scale-dropped", "embedding"):
        embedding.embed_scale = 1.0


def _gemma_sliding_window_ignored(models) -> None:
    """The sliding-window layers attend to the whole causal context, as the global ones."""
    for attention in _gemma3_modules(models, "gemma-sliding-window-ignored", "attention"):
        attention.window = None
# gpt-oss (issue 37): what a converter or a backend can drop from gpt-oss without an error.
def _core_attentions(models):
    """Every decoder layer's core attention (DotProductAttention) on this rank."""
    from harness.bridge import unwrap_model

    return [layer.self_attention.core_attention for chunk in unwrap_model(list(models))
            for layer in chunk.decoder.layers]


def _without_offset(stock):
    def forward(scores, mask, softmax_offset=None):
        return stock(scores, mask, None)
    return forward


def _drop_sinks(models) -> None:
    """Attention sinks ignored: the softmax over the scores alone (softmax_type "vanilla", what a
    backend without sink support computes), the loaded softmax_offset left in place, unread."""
    cores = [c for c in _core_attentions(models) if getattr(c, "softmax_offset", None) is not None]
    if not cores:
        raise VariantError("variant 'gpt-oss-sinks-dropped' needs a model with attention sinks (gpt-oss)")
    for core in cores:
        softmax = core.scale_mask_softmax
        softmax.forward = _without_offset(softmax.forward)


def _ignore_window(models) -> None:
    """The sliding window ignored: every layer attends to its whole causal context."""
    windowed = [c.scale_mask_softmax for c in _core_attentions(models)
                if getattr(c.scale_mask_softmax, "window_size", None) is not None]
    if not windowed:
        raise VariantError("variant 'gpt-oss-window-ignored' needs a model with sliding-window layers (gpt-oss)")
    for softmax in windowed:
        softmax.window_size = None  # read at every forward (FusedScaleMaskSoftmax.forward_torch_softmax)


def _drop_clamp(models) -> None:
    """The SwiGLU clamp left out (activation_func_clamp_value None): gate and up unclamped."""
    configs = {id(m.config): m.config for m in _moe_layers(models, "gpt-oss-clamp-missing")
               if getattr(m.config, "activation_func_clamp_value", None) is not None}
    if not configs:
        raise VariantError("variant 'gpt-oss-clamp-missing' needs a MoE model with a clamped SwiGLU (gpt-oss)")
    for config in configs.values():
        config.activation_func_clamp_value = None  # read at every forward (MLP.forward's glu)


@torch.no_grad()
def _drop_expert_biases(models) -> None:
    """The experts' linear_fc1/linear_fc2 biases not loaded (left at megatron-core's zero init)."""
    biases = [p for _, params in _params(models) for name, p in params.items()
              if ".mlp.experts." in name and name.endswith(".bias")]
    if not biases:
        raise VariantError("variant 'gpt-oss-expert-biases-dropped' needs experts with biases (gpt-oss)")
    for bias in biases:
        bias.zero_()


@torch.no_grad()
def _transpose_down_proj(models) -> None:
    """Each expert's linear_fc2 weight transposed: HF's down_proj [width, hidden] stored as it is where
    Megatron holds [hidden, width]. Square experts (width == hidden, gpt-oss-20b's 2880) load without a
    shape error either way."""
    weights = [p for _, params in _params(models) for name, p in params.items()
               if ".mlp.experts." in name and "linear_fc2.weight" in name]
    if not weights or any(w.shape[0] != w.shape[1] for w in weights):
        raise VariantError("variant 'gpt-oss-down-proj-transposed' needs square expert linear_fc2 weights "
                           "(gpt-oss at etp 1)")
    for weight in weights:
        weight.copy_(weight.t().contiguous())


def _family_moe_layers(models, what: str, model_type: str, needs: str):
    """The MoE layers of a `model_type` model, or one error naming the variant and what it needs."""
    from harness.bridge import hf_config

    if hf_config(models).model_type != model_type:
        raise VariantError(f"variant {what!r} needs {needs}")
    return _moe_layers(models, what)


# DeepSeek-V3 (issue 37): what a converter or a framework can leave out without an error.
def _deepseek_moe_layers(models, what: str):
    return _family_moe_layers(models, what, "deepseek_v3", "a DeepSeek-V3 model")


@torch.no_grad()
def _drop_expert_bias(models) -> None:
    """e_score_correction_bias never loaded: megatron-core's expert_bias left at its zeros (state)."""
    for moe in _deepseek_moe_layers(models, "expert-bias-dropped"):
        moe.router.expert_bias.zero_()


def _drop_routed_scaling(models) -> None:
    """routed_scaling_factor not passed: the routing weights renormalised but not scaled (read at every forward)."""
    for moe in _deepseek_moe_layers(models, "routed-scaling-dropped"):
        moe.config.moe_router_topk_scaling_factor = None


def _ignore_group_routing(models) -> None:
    """n_group/topk_group not passed (stock mbridge 0.15.1, compat override 16): the top k of every expert."""
    for moe in _deepseek_moe_layers(models, "group-limited-routing-ignored"):
        moe.config.moe_router_num_groups = None
        moe.config.moe_router_group_topk = None


@torch.no_grad()
def _swap_rope_nope(models) -> None:
    """q_b_proj's per-head rows (q_proj's without q LoRA: Moonlight) read as [rope, nope] instead of HF's
    [nope, rope] (state): each head's query rotates what should pass and passes what should rotate. Each TP
    rank holds whole heads."""
    from harness.bridge import hf_config, unwrap_model

    config = hf_config(models)
    if config.model_type != "deepseek_v3":
        raise VariantError("variant 'mla-rope-nope-swapped' needs a DeepSeek-V3 model")
    nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
    for chunk in unwrap_model(list(models)):
        for layer in chunk.decoder.layers:
            attention = layer.self_attention
            weight = (attention.linear_q_up_proj if config.q_lora_rank else attention.linear_q_proj).weight
            heads = weight.view(-1, nope + rope, weight.shape[-1])
            heads.copy_(torch.cat([heads[:, nope:], heads[:, :nope]], dim=1))


def _drop_yarn_mscale(models) -> None:
    """The softmax scale without YaRN's mscale^2 (1/sqrt(q head), as a plain attention computes it)."""
    from harness.bridge import hf_config, unwrap_model

    if hf_config(models).model_type != "deepseek_v3":
        raise VariantError("variant 'yarn-mscale-missing' needs a DeepSeek-V3 model")
    for chunk in unwrap_model(list(models)):
        for layer in chunk.decoder.layers:
            attention = layer.self_attention
            attention.core_attention.softmax_scale = attention.q_head_dim ** -0.5  # read at every forward


def _mla_norm_eps_from_config(models) -> None:
    """MLA's latent norms with the config's rms_norm_eps, as stock megatron-core builds them (and vLLM), where HF's
    take DeepseekV3RMSNorm's default (harness.bridge.mla_norms); read at every forward."""
    from harness.bridge import hf_config, unwrap_model
    from harness.bridge.mla_norms import match_hf_mla_norms
    from harness.compat.transformers import hf_mla_norm_eps

    config = hf_config(models)
    if config.model_type != "deepseek_v3":
        raise VariantError("variant 'mla-norm-eps-from-config' needs a DeepSeek-V3 model")
    match_hf_mla_norms(unwrap_model(list(models)), config, eps={k: config.rms_norm_eps for k in hf_mla_norm_eps(config)})


DEEPSEEK_V3_VARIANTS = {"expert-bias-dropped": _drop_expert_bias, "routed-scaling-dropped": _drop_routed_scaling,
                        "group-limited-routing-ignored": _ignore_group_routing,
                        "mla-rope-nope-swapped": _swap_rope_nope, "yarn-mscale-missing": _drop_yarn_mscale,
                        "mla-norm-eps-from-config": _mla_norm_eps_from_config}


# Variants that change how the model computes (code and configuration, not the state copy_state
# carries: how it routes, whether the shared expert is gated): harness.parity.runner applies them to
# the fp32 evaluation's model too.
ROUTING = frozenset({"router-in-bf16", "topk-off-by-one", "mixtral-pre-softmax", "shared-expert-gate-dropped",
                     "gemma-norm-not-zero-centered", "gemma-embed-scale-dropped", "gemma-sliding-window-ignored",
                     "routed-scaling-dropped", "group-limited-routing-ignored", "yarn-mscale-missing"})
ROUTING |= {"gpt-oss-sinks-dropped", "gpt-oss-window-ignored", "gpt-oss-clamp-missing"}  # gpt-oss: code, not state

IMPLEMENTED: dict[str, Callable] = {
    "swapped-experts": _swap_experts,
    "router-in-bf16": _router_in_bf16,
    "topk-off-by-one": _topk_off_by_one,
    "mixtral-pre-softmax": _mixtral_pre_softmax,
    "shared-expert-gate-dropped": _drop_shared_expert_gate,
    "gemma-norm-not-zero-centered": _gemma_norm_not_zero_centered,
    "gemma-embed-scale-dropped": _gemma_embed_scale_dropped,
    "gemma-sliding-window-ignored": _gemma_sliding_window_ignored,
    "gpt-oss-sinks-dropped": _drop_sinks,
    "gpt-oss-window-ignored": _ignore_window,
    "gpt-oss-clamp-missing": _drop_clamp,
    "gpt-oss-expert-biases-dropped": _drop_expert_biases,
    "gpt-oss-down-proj-transposed": _transpose_down_proj,
    "swapped-gate-up": _swap_gate_up,
    "wrong-rope-base": _wrong_rope_base,
    "scaled-norm": _scale_norm,
    "skipped-layer": _skip_layer,
    "swapped-tp-shards": _swap_tp_shards,
    "unsynced-tied-embedding": _unsync_tied_embedding,
    "unmasked-padding": lambda models: None,  # acts on the input, see FORCED_PACKING
    "tf32-in-fp32": lambda models: _require_tf32(),  # acts on the world (Variant.world_env)
    "dropped-rope-scaling": _drop_rope_scaling,
    # Context parallelism: how the logprobs are fed and gathered, not the weights
    # (harness.logprobs.context_parallel; `FEEDING`).
    "cp-labels-rolled-after-split": lambda models: None,
    "cp-chunks-contiguous": lambda models: None,
    **DEEPSEEK_V3_VARIANTS,
}
# Variants in the logprob path itself (handed to harness.logprobs.megatron.megatron_logprobs).
FEEDING = frozenset({"cp-labels-rolled-after-split", "cp-chunks-contiguous"})


# ----------------------------------------------------------------------------- GLM-4.5-MoE (issue 37)
# What a converter can drop from GLM-4.5-MoE's RoPE and router without an error (harness.variants.catalog,
# `_GLM4_MOE`). Prefixed `glm-`: the DeepSeek-V3 family shares the router's mechanisms; these are shown,
# and named, on glm4_moe only.
def _glm4_moe_layers(models, what: str):
    return _family_moe_layers(models, what, "glm4_moe", "a GLM-4.5-MoE model (model_type glm4_moe)")


@torch.no_grad()
def _glm_rope_on_the_full_head(models) -> None:
    """RoPE on every dim of the head (megatron-core's rotary_percent left at 1.0), where GLM rotates the
    first partial_rotary_factor of it and passes the rest through: the frequencies of a whole-head RoPE,
    whose cos/sin then cover the whole head (megatron-core rotates freqs.shape[-1] dims)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from harness.bridge import hf_config
    from harness.bridge.preflight import rope_settings

    _glm4_moe_layers(models, "glm-partial-rope-full-head")
    rope = rope_settings(hf_config(models))
    if rope.rotary_percent == 1.0:  # a no-op variant would "pass" its negative control
        raise VariantError("variant 'glm-partial-rope-full-head' needs a partial rotary model (partial_rotary_factor < 1)")
    for chunk, _ in _params(models):
        current = chunk.rotary_pos_emb
        full = RotaryEmbedding(kv_channels=chunk.config.kv_channels, rotary_percent=1.0, rotary_base=rope.theta,
                               use_cpu_initialization=True)
        current.inv_freq = full.inv_freq.to(current.inv_freq.device)
    RotaryEmbedding.forward.cache_clear()  # freqs are memoized per (module, length)


@torch.no_grad()
def _glm_expert_bias_not_loaded(models) -> None:
    """The routers' expert bias left as megatron-core initialises it (zeros): HF's
    e_score_correction_bias never loaded, experts chosen by the sigmoid scores alone."""
    routers = [moe.router for moe in _glm4_moe_layers(models, "glm-expert-bias-not-loaded")
               if getattr(moe.router, "expert_bias", None) is not None]
    if not routers:
        raise VariantError("variant 'glm-expert-bias-not-loaded' needs routers with an expert bias")
    if not any(bool(router.expert_bias.abs().max() > 0) for router in routers):
        raise VariantError("variant 'glm-expert-bias-not-loaded' needs a nonzero expert bias (a zero one is the fix)")
    for router in routers:
        router.expert_bias.zero_()


def _glm_routed_scaling_dropped(models) -> None:
    """The routing weights not scaled by routed_scaling_factor (megatron-core's
    moe_router_topk_scaling_factor left None): every routed expert's output 1/factor of HF's."""
    layers = _glm4_moe_layers(models, "glm-routed-scaling-dropped")
    configs = {id(c): c for moe in layers for c in (moe.config, moe.router.config)}  # read at every forward
    if any(c.moe_router_topk_scaling_factor in (None, 1, 1.0) for c in configs.values()):
        raise VariantError("variant 'glm-routed-scaling-dropped' needs routed_scaling_factor != 1 (GLM-4.5's 2.5)")
    for config in configs.values():
        config.moe_router_topk_scaling_factor = None


IMPLEMENTED.update({
    "glm-partial-rope-full-head": _glm_rope_on_the_full_head,
    "glm-expert-bias-not-loaded": _glm_expert_bias_not_loaded,
    "glm-routed-scaling-dropped": _glm_routed_scaling_dropped,
})
# The scaling is configuration the fp32 evaluation's model must get too (ROUTING); the other two are
# state (the RoPE frequencies, a plain tensor attribute, and the bias buffer), which copy_state carries.
ROUTING = ROUTING | frozenset({"glm-routed-scaling-dropped"})


def _require_tf32() -> None:
    """The control's world must really run TF32 (set before CUDA started: Variant.world_env),
    or the control would pass for the wrong reason."""
    from harness.backends import cuda_precision

    if not (torch.cuda.is_available() and cuda_precision.tf32_requested()
            and torch.backends.cuda.matmul.allow_tf32):
        raise VariantError("variant 'tf32-in-fp32' runs on CUDA ranks started with MRH_TF32=1 "
                           f"(this rank: {cuda_precision.state()})")


def apply_variant(variant_id: str | None, models: list[torch.nn.Module]) -> None:
    """Make `models` wrong in the way `variant_id` says (rank-side, after loading the weights)."""
    if variant_id is not None:
        IMPLEMENTED[variant_id](models)
