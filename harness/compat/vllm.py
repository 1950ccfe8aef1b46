"""vLLM workarounds, applied inside the vLLM engine's process (harness/rollout/vllm_server.py), each
gated on the vLLM versions it was verified on.

- `CPU_MOE_RELOAD_REPACK` (found by this harness): on CPU, a MoE layer's kernel computes with expert
  weights prepacked into its grouped-GEMM layout (`CPUUnquantizedExperts.process_weights_after_loading`
  in vllm/model_executor/layers/fused_moe/experts/cpu_moe.py: `cpu_prepack_moe_weight` of `w13_weight`
  and `w2_weight`). `UnquantizedFusedMoEMethod._setup_kernel` (fused_moe/unquantized_fused_moe_method.py)
  runs that prepack only when `self.moe_kernel is None`, i.e. on the first load: an in-place
  `reload_weights` (model_loader/reload/layerwise.py: the layer is rebuilt in checkpoint layout, loaded,
  processed, then copied into the original kernel tensors) copies the weights UNPACKED into the
  packed storage, and the kernel reads them as packed: reloading a Qwen3-MoE's own weights moved its
  logprobs 4.1 off HF (tiny-qwen3-moe-hd32, fp32; suites/moe/test_vllm.py's guard test measures it
  each run). The workaround runs the experts' prepack again on a weight update, so the layerwise
  reload copies packed weights into the packed storage.
- `CPU_TIED_LM_HEAD_REPACK` (found by this harness): on CPU a tied model's lm_head (a ParallelLMHead
  sharing the embedding's parameter) computes the logits with a oneDNN matmul handle whose weight was
  packed at the first load (`UnquantizedEmbeddingMethod.process_weights_after_loading` ->
  `dispatch_cpu_unquantized_gemm` in model_executor/layers/utils.py). An in-place `reload_weights` of
  `model.embed_tokens.weight` writes the shared parameter and reprocesses the embedding, but never the
  lm_head: nothing is loaded under its name (a tied model skips `lm_head.`), so the layerwise reload
  only puts its old tensors back (reload/layerwise.py `finalize_layerwise_processing`). The logits keep
  coming from the checkpoint's embedding while the embedding reads back updated: a reload of a 0.05
  perturbation moved the logprobs 1.69 off HF (tiny-qwen3-tied-hd32, fp32), 3.6e-6 from an HF model
  whose lm_head kept the old values (suites/rollout/test_vllm.py's guard test measures it each run).
  vLLM PR 51665's symptom (a tied lm_head left stale by a weight update) by another mechanism. The
  workaround reprocesses every lm_head tied to an embedding after each in-place reload, as the first
  load did.
- `GPT_OSS_RELOAD_DIRECT_COPIES` (found by this harness): gpt-oss's unquantized load path
  (`GptOssModel._load_weights_other` in vllm/model_executor/models/gpt_oss.py) copies each layer's fused
  experts (w13/w2 weights and biases) and its attention sinks straight into the parameters (`param.copy_`),
  not through their weight loaders. vLLM's layerwise `reload_weights` puts every parameter on the meta device
  and counts what the wrapped loaders take: those copies land on meta tensors, the layers count nothing
  loaded, and the finalize puts the old tensors back. A reload of a perturbed state left every expert and
  sink tensor at its old value and the logprobs 2.1 to 2.6 off HF (tiny-gpt-oss-hd32, fp32, two updates;
  suites/rollout/test_vllm_families.py's guard test measures it each run). The workaround hands the experts
  to vLLM's own per-expert path (`_try_load_streamed_expert`: `experts.<e>.w13_weight` etc., through the
  experts' weight loader) and the sinks to their parameter's weight loader.
- `CPU_NO_AMX` (found by this harness): on CPU, vLLM takes AMX kernels whenever torch reports AMX tiles
  (`torch.cpu._is_amx_tile_supported()`): bf16 attention (`_get_attn_isa` in
  vllm/v1/attention/backends/cpu_attn.py) and the small GEMMs' sgl kernels (`check_cpu_sgl_kernel` in
  model_executor/layers/utils.py, torch's brgemm). On an Intel Xeon VM whose flags list amx_bf16, amx_tile and
  amx_int8 (2026-12-01) the engine's first bf16 generate died: SIGILL in the AMX attention, and, with the
  harness's oneDNN pin (ONEDNN_MAX_CPU_ISA=AVX2, harness.backends.cpu_arithmetic) inherited, a c10::Error
  from the brgemm of a batch of 4; every bf16 vLLM test of the CPU tier failed. With AMX reported absent in
  the engine's process the same generates pass. So it reports none: the engine takes the kernels of the
  machines without AMX, where the CPU tier's vLLM evidence was made, as the pin does for torch.

- `MLA_NORM_EPS_LIKE_HF` (found by this harness, vLLM PR 35515 closed): vLLM's DeepSeek-V2/V3 attention
  (`DeepseekV2MLAAttention` in vllm/model_executor/models/deepseek_v2.py) builds `kv_a_layernorm` (and
  `q_a_layernorm`) with the config's `rms_norm_eps`; HF's (and DeepSeek's remote code) take the RMSNorm default
  1e-6 (harness.compat.transformers). For a checkpoint whose `rms_norm_eps` is not 1e-6 (Moonlight: 1e-5) the
  engine's logprobs were 2.1e-5 off HF's, 2.1x the weight-sync bound (tiny-moonlight-mla576 with Moonlight's
  1e-5; the twin takes 1e-4, where the guard test in suites/rollout/test_vllm_families.py measures 2.3e-4). The workaround sets the norms to HF's
  epsilons at every forward of the attention (so the guard can turn it off in a running engine). Needed only
  where the two differ; on any device. vLLM 0.26.0 (the GPU machines') builds both norms the same way, in both
  attention classes the workaround wraps (on CUDA the fp32 engine runs DeepseekV2Attention: vLLM's MLA kernels
  take no fp32, harness.rollout.vllm_engine.STRICT_FP32_CUDA_MLA_ENV); its guard runs there on CUDA.

- `CPU_ROPE_3D_QUERY` (found by this harness): on CPU, `RotaryEmbedding.forward_cpu`
  (model_executor/layers/rotary_embedding/base.py: the in-place `ops.rotary_embedding`) rotates a 3-D query
  [tokens, heads, dim] of more than one head wrongly (3.4 off `forward_native` for GPT-J pairs, 6.3 for NeoX),
  and a 2-D [tokens, heads * dim] one right. DeepSeek's MLA hands it `q_pe` 3-D; with YaRN it takes
  DeepseekScalingRotaryEmbedding, whose own forward is right, but with plain RoPE (Moonlight's `rope_type`
  default) every query was rotated wrongly: the engine's logprobs 2.1-3.9 off HF's (tiny-moonlight-mla576,
  fp32; suites/rollout/test_vllm_families.py's guard test measures it each run). The workaround hands the op
  2-D views and reshapes back.

The gate, as in harness.compat.megatron_core: `install` raises `UnverifiedVLLMError` on a vLLM
version a workaround was not verified on, before anything changes (the engine does not start; a
model that needs none of them starts on any version). Re-verify with suites/moe/test_vllm.py
(`test_the_cpu_moe_reload_workaround_is_still_needed` shows whether the bug is still there; each workaround's
`guard` names its test file), then add the version to `verified_on`.

This module runs under the vLLM environment's Python, which has no harness dependencies: it imports
only the standard library at import time, and vllm inside `install`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from harness.compat import refuse_unverified


class UnverifiedVLLMError(RuntimeError):
    """A workaround was asked for on a vLLM version it was not verified on."""


@dataclass(frozen=True)
class Workaround:
    name: str
    bug: str  # the upstream behaviour it works around, in one line
    verified_on: tuple[str, ...]  # vllm.__version__ values
    guard: str = "suites/moe/test_vllm.py"  # where re-verifying starts: the test that shows the bug


CPU_MOE_RELOAD_REPACK = Workaround(
    "cpu-moe-reload-repack", "UnquantizedFusedMoEMethod._setup_kernel prepacks the CPU MoE kernel's "
    "expert weights only on the first load: an in-place reload_weights leaves them unpacked in the "
    "packed storage", ("0.32.0",))
CPU_TIED_LM_HEAD_REPACK = Workaround(
    "cpu-tied-lm-head-repack", "a tied model's CPU lm_head computes with a oneDNN copy of the embedding "
    "packed at the first load: an in-place reload_weights of the embedding never repacks it (the logits "
    "stay on the old embedding)", ("0.32.0",))
CPU_NO_AMX = Workaround(
    "cpu-no-amx", "vLLM's CPU kernels take AMX whenever torch reports AMX tiles; on a Xeon VM with "
    "amx_bf16/amx_tile/amx_int8 its bf16 attention died with SIGILL and its brgemm under the oneDNN pin with a "
    "c10::Error: report no AMX", ("0.32.0",))
GPT_OSS_RELOAD_DIRECT_COPIES = Workaround(
    "gpt-oss-reload-direct-copies", "gpt-oss's unquantized load_weights copies the experts and sinks straight into "
    "the parameters, past the weight loaders vLLM's layerwise reload_weights tracks: a reload keeps the old "
    "experts and sinks", ("0.32.0",), guard="suites/rollout/test_vllm_families.py")
MLA_NORM_EPS_LIKE_HF = Workaround(
    "mla-norm-eps-like-hf", "DeepSeek-V2/V3's MLA latent norms built with config.rms_norm_eps where HF's take the "
    "RMSNorm default 1e-6 (vLLM PR 35515, closed)", ("0.26.0", "0.32.0"), guard="suites/rollout/test_vllm_families.py")
CPU_ROPE_3D_QUERY = Workaround(
    "cpu-rope-3d-query", "the CPU RotaryEmbedding op rotates a 3-D multi-head query wrongly (DeepSeek's MLA with "
    "plain RoPE hands it one)", ("0.32.0",), guard="suites/rollout/test_vllm_families.py")
WORKAROUNDS = (CPU_MOE_RELOAD_REPACK, CPU_TIED_LM_HEAD_REPACK, CPU_NO_AMX, GPT_OSS_RELOAD_DIRECT_COPIES,
               MLA_NORM_EPS_LIKE_HF, CPU_ROPE_3D_QUERY)

# Which installed workarounds act: the guard test turns one off to show the bug is still there.
_ENABLED: dict[str, bool] = {}
_MLA_EPS: dict[str, float] = {}  # HF's MLA latent norm epsilons of the engine's model (one model a process)


def version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def require(workaround: Workaround) -> None:
    refuse_unverified(UnverifiedVLLMError, "vLLM", version(), workaround.name, workaround.verified_on,
                      workaround.guard)


def needed(hf_config: dict[str, Any], device: str) -> list[Workaround]:
    """The workarounds a model (its config.json, as a dict) needs on `device`."""
    anywhere = [MLA_NORM_EPS_LIKE_HF] if _hf_mla_norm_eps(hf_config) else []
    if device != "cpu":
        return anywhere
    experts = (hf_config.get("num_experts") or hf_config.get("num_local_experts")  # Qwen-MoE / Mixtral, gpt-oss
               or hf_config.get("n_routed_experts") or 0)  # GLM-4.5-MoE, DeepSeek-V3
    return ([CPU_MOE_RELOAD_REPACK] if experts > 0 else []) + \
        ([CPU_TIED_LM_HEAD_REPACK] if hf_config.get("tie_word_embeddings", False) else []) + \
        ([CPU_NO_AMX] if device == "cpu" and _amx_reported() else []) + \
        ([GPT_OSS_RELOAD_DIRECT_COPIES] if hf_config.get("model_type") == "gpt_oss" else []) + anywhere + \
        ([CPU_ROPE_3D_QUERY] if hf_config.get("model_type") == "deepseek_v3" and _plain_rope(hf_config) else [])


def _plain_rope(hf_config: dict[str, Any]) -> bool:
    """RoPE without scaling (vLLM then builds its plain RotaryEmbedding)."""
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    return rope.get("rope_type", rope.get("type", "default")) == "default"


def _hf_mla_norm_eps(hf_config: dict[str, Any]) -> dict[str, float]:
    """HF's MLA latent norm epsilons where they differ from the config's rms_norm_eps (a DeepSeek-V3 config), else {}."""
    if hf_config.get("model_type") != "deepseek_v3":
        return {}
    from harness.compat.transformers import hf_mla_norm_eps

    eps = hf_mla_norm_eps(hf_config)
    return eps if any(value != hf_config.get("rms_norm_eps", 1e-6) for value in eps.values()) else {}


def _amx_reported() -> bool:
    """Whether torch reports AMX tiles here (what makes vLLM's CPU kernels pick AMX)."""
    import torch

    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def install(hf_config: dict[str, Any], device: str) -> list[str]:
    """Apply the workarounds the model needs (each once per process); returns their names."""
    chosen = needed(hf_config, device)
    for workaround in chosen:  # every gate first: nothing changes on an unverified version
        require(workaround)
    if MLA_NORM_EPS_LIKE_HF in chosen:
        _MLA_EPS.update(_hf_mla_norm_eps(hf_config))
    for workaround in chosen:
        if workaround.name not in _ENABLED:
            _PATCHES[workaround.name]()
        _ENABLED[workaround.name] = True
    return [w.name for w in chosen]


def set_enabled(name: str, enabled: bool) -> None:
    """Turn an installed workaround off (the bug shows again) or back on."""
    if name not in _ENABLED:
        raise KeyError(f"workaround {name!r} is not installed in this engine (installed: {sorted(_ENABLED)})")
    _ENABLED[name] = bool(enabled)


def _patch_cpu_moe_reload_repack() -> None:
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    original = UnquantizedFusedMoEMethod._setup_kernel

    def _setup_kernel(self, layer, w13, w2):
        weight_update = self.moe_kernel is not None  # vLLM's own test for "not the first load"
        original(self, layer, w13, w2)
        if weight_update and _ENABLED.get(CPU_MOE_RELOAD_REPACK.name):
            # what the first load did after the kernel was built: pad + prepack (CPU experts)
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    _setup_kernel.__wrapped__ = original
    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel


def _patch_cpu_tied_lm_head_repack() -> None:
    from vllm.model_executor.model_loader.reload import inplace

    original = inplace.finalize_layerwise_reload

    def finalize_layerwise_reload(model, *args, **kwargs):
        original(model, *args, **kwargs)
        if _ENABLED.get(CPU_TIED_LM_HEAD_REPACK.name):
            repack_tied_lm_heads(model)

    finalize_layerwise_reload.__wrapped__ = original
    inplace.finalize_layerwise_reload = finalize_layerwise_reload  # what reload_weights calls


def repack_tied_lm_heads(model) -> int:
    """Run each tied lm_head's post-load processing again (on CPU: pack its GEMM from the embedding's
    current values, what the first load did); returns how many were repacked."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeddings = {id(module.weight) for module in model.modules()
                  if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead)}
    count = 0
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and id(module.weight) in embeddings:
            module.quant_method.process_weights_after_loading(module)
            count += 1
    return count


def _patch_cpu_no_amx() -> None:
    import torch

    original = torch.cpu._is_amx_tile_supported

    def _is_amx_tile_supported() -> bool:
        return False if _ENABLED.get(CPU_NO_AMX.name) else original()

    _is_amx_tile_supported.__wrapped__ = original
    torch.cpu._is_amx_tile_supported = _is_amx_tile_supported  # vLLM asks at each kernel choice


# gpt-oss's fused expert tensors, as GptOssModel.load_weights gets them (after GptOssForCausalLM's mapper)
_GPT_OSS_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(w13_weight|w2_weight|w13_bias|w2_bias)$")


def _patch_gpt_oss_reload_direct_copies() -> None:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.model_executor.models.gpt_oss import GptOssModel

    original = GptOssModel._load_weights_other

    def _load_weights_other(self, ep_rank_end, ep_rank_start, heads_per_rank, head_start, weights, stacked):
        if not _ENABLED.get(GPT_OSS_RELOAD_DIRECT_COPIES.name):
            return original(self, ep_rank_end, ep_rank_start, heads_per_rank, head_start, weights, stacked)
        params, loaded, rest = dict(self.named_parameters()), set(), []
        for name, weight in weights:
            fused = _GPT_OSS_FUSED_EXPERTS.match(name)
            if name.endswith(".sinks"):  # through the parameter's loader (the original copies into it)
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(
                    param, weight.narrow(0, head_start, heads_per_rank))
                loaded.add(name)
            elif fused:  # one tensor per expert: vLLM's streamed-expert path, through the experts' loader
                rest.extend((f"{fused.group(1)}.{e}.{fused.group(2)}", weight[e]) for e in range(weight.shape[0]))
            else:
                rest.append((name, weight))
        return loaded | original(self, ep_rank_end, ep_rank_start, heads_per_rank, head_start, rest, stacked)

    _load_weights_other.__wrapped__ = original
    GptOssModel._load_weights_other = _load_weights_other


def _patch_mla_norm_eps_like_hf() -> None:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2Attention, DeepseekV2MLAAttention

    for cls in (DeepseekV2MLAAttention, DeepseekV2Attention):
        original = cls.forward

        def forward(self, *args, _original=original, **kwargs):
            on = _ENABLED.get(MLA_NORM_EPS_LIKE_HF.name)
            for key, name in (("kv", "kv_a_layernorm"), ("q", "q_a_layernorm")):
                norm = getattr(self, name, None)
                if norm is not None and key in _MLA_EPS:
                    if not hasattr(norm, "harness_config_eps"):
                        norm.harness_config_eps = norm.variance_epsilon  # what vLLM built it with
                    norm.variance_epsilon = _MLA_EPS[key] if on else norm.harness_config_eps
            return _original(self, *args, **kwargs)

        forward.__wrapped__ = original
        cls.forward = forward


def _patch_cpu_rope_3d_query() -> None:
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):
        if not _ENABLED.get(CPU_ROPE_3D_QUERY.name) or query.dim() != 3:
            return original(self, positions, query, key)
        flat_key = None if key is None else key.reshape(key.shape[0], -1)
        rotated, rotated_key = original(self, positions, query.reshape(query.shape[0], -1), flat_key)
        return rotated.view(query.shape), None if key is None else rotated_key.view(key.shape)

    forward_cpu.__wrapped__ = original
    RotaryEmbedding.forward_cpu = forward_cpu


_PATCHES = {CPU_MOE_RELOAD_REPACK.name: _patch_cpu_moe_reload_repack,
            CPU_TIED_LM_HEAD_REPACK.name: _patch_cpu_tied_lm_head_repack,
            CPU_NO_AMX.name: _patch_cpu_no_amx,
            GPT_OSS_RELOAD_DIRECT_COPIES.name: _patch_gpt_oss_reload_direct_copies,
            MLA_NORM_EPS_LIKE_HF.name: _patch_mla_norm_eps_like_hf,
            CPU_ROPE_3D_QUERY.name: _patch_cpu_rope_3d_query}
