"""mbridge 0.15.1 bridges, fixed for this stack by a mixin subclass (stock mbridge is not modified).

`make_bridge` picks mbridge's registered bridge for the checkpoint's model_type and returns an
instance of `Harness<Bridge>(HarnessBridgeMixin, <Bridge>)`. Each override says which stock
behaviour it replaces and why:

1. Layer spec: stock `_get_transformer_layer_spec` hard-codes `use_transformer_engine=True`
   (NameError: TENorm without TE). Without TE we build Megatron's local spec instead.
2. Local-spec weight names: the local spec has `input_layernorm.weight` / `pre_mlp_layernorm.weight`
   where TE fuses them into `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight` (and, with
   MLA, `self_attention.q_layernorm` / `kv_layernorm` where TE has `linear_q_up_proj.layer_norm_weight` /
   `linear_kv_up_proj.layer_norm_weight`: HF's q_a_layernorm / kv_a_layernorm). Stock
   mbridge has no mapping for them (and routes any name containing "mlp", such as
   pre_mlp_layernorm, to its MLP table): we map them to HF's input_layernorm /
   post_attention_layernorm.
3. Tied embeddings: Qwen2Bridge ties by writing `output_layer.weight -> model.embed_tokens.weight`
   into its *class-level* `_DIRECT_MAPPING`, so once a tied model is built in a process every later
   untied Qwen2/Qwen3 model silently loads its lm_head from embed_tokens; LLaMABridge does not tie at
   all (the last PP stage then asks for a missing `lm_head.weight`, cf. mbridge PR 14). We map
   output_layer per instance from `tie_word_embeddings` and never touch the class tables.
4. RoPE: transformers 5 keeps rope_theta only in `config.rope_parameters`; stock mbridge reads
   `config.rope_theta` (AttributeError), and LLaMABridge tests `"rope_scaling" in config`
   (TypeError in transformers 5) and would run any scaling as linear position interpolation
   (`seq_len_interpolation_factor`). We read both from `harness.bridge.preflight.rope_settings`,
   which refuses every rope type but default and llama3. Llama-3 scaling: Megatron-Core 0.16.1's
   GPTModel takes only `rope_scaling` and `rope_scaling_factor`; `RotaryEmbedding._apply_scaling`
   is HF's `_compute_llama3_parameters` line for line but hard-codes low_freq_factor=1,
   high_freq_factor=4, original_max_position_embeddings=8192 (Llama 3.1's values), so any other
   checkpoint would get other frequencies (7x off for some dims with original 32). We pass
   `rope_scaling`/`factor` and then set each chunk's inv_freq to that same Megatron function
   evaluated at the checkpoint's four values, after checking it equals HF's inv_freq bit for bit
   (an error otherwise, so the two can never silently differ).
5. Config: sequence parallelism is off unless asked for (mbridge turns it on whenever TP > 1, and
   the caller's inputs must then have a sequence length divisible by TP); masked_softmax_fusion is
   on only when Megatron's fused-softmax CUDA extensions exist (mbridge turns it on
   unconditionally, and a bf16 forward then fails importing them); fp16 sets `fp16=True` (mbridge
   only sets bf16, and Float16Module refuses fp16 without it).
6. Local-spec norms: Megatron's local spec builds its norms with WrappedTorchNorm, which asserts
   sequence parallelism is off (and, when apex is installed, puts apex's FusedLayerNorm, which
   refuses RMSNorm, in the final-norm slot). Every norm slot (input_layernorm, pre_mlp_layernorm,
   q/k_layernorm, final_layernorm) gets harness.bridge.norms.LocalRMSNorm instead: torch's RMSNorm
   (same forward and weight names) whose weight carries `sequence_parallel` as TE's norms do, so
   Megatron's finalize_model_grads sums its grads over TP under sequence parallelism. With that,
   sequence parallelism works with the local spec too (the other local-spec modules already
   support it). LocalRMSNorm also rounds as HF and vLLM do (normalize in fp32, round to the
   activation dtype, then scale by the weight); torch's RMSNorm and TE round once, after the
   weight, which alone moved bf16 logprobs by up to ~0.05 against HF. `norm_precision="fused"`
   selects torch's rounding (FusedRMSNorm); the TE spec always has TE's.
7. Mixtral's router: MixtralBridge sets `moe_router_pre_softmax=True` (softmax over every expert,
   then the top k, unnormalised), but HF Mixtral renormalises the top-k probabilities, which is a
   softmax over the top-k logits (`moe_router_pre_softmax=False`). Stock, the tiny Mixtral's logits
   are 0.33 off HF's; with the fix 1.0e-6 (fp32, CPU).
8. Local-spec experts: mbridge maps expert weights by TEGroupedMLP's names
   (`mlp.experts.linear_fc1.weight<e>`) and picks the expert-tensor-parallel group by testing for
   them; the local spec builds SequentialMLP (`mlp.experts.local_experts.<e>.linear_fc1.weight`;
   its legacy GroupedMLP needs the CUDA grouped_gemm package, so `moe_grouped_gemm` is off). We
   name SequentialMLP's experts as the grouped ones (global expert ids under EP), and load each
   rank's own TP/ETP shard of every tensor from the checkpoint (no scatter: mbridge's would pick the
   dense TP group for an expert). mbridge's MoE bridges also turn on fusions the local spec has no
   kernels for (persistent layer norm, bias fusions, permute fusion): off, as megatron-core defaults
   them.
9. Experts at ep 1 with etp != tp (export): stock `export_weights` sends an expert weight at ep 1
   through its dense branch, which gathers it over the TP group and then asserts it got etp shards
   (AssertionError at tp2etp1). We gather an expert's shards over the expert-TP group there
   (etp 1: the rank's own, whole expert).
10. Experts at ep 1 with etp != tp (build): megatron-core 0.16.1 leaves them dense parameters
   (Megatron-LM #5916's uncommon case); each chunk gets the version-gated workaround
   `harness.compat.megatron_core.mark_expert_parameters` before mbridge's get_model wraps it in DDP.
11. TE's grouped experts split over etp > 1 (build): megatron-core 0.16.1 leaves their weights unmarked
   (not tensor_model_parallel), so stock `export_weights` at ep 1 sends them through its dense branch
   unmarked and exports one rank's shard (16 of 32 rows at tp2-sp, 2x H200); the version-gated
   `harness.compat.megatron_core.mark_split_expert_weights` marks them as 0.19.2 does, and the dense
   branch then gathers them over TP (= etp at ep 1).
12. Qwen2-MoE's shared-expert gate (mbridge 0.15.1, found here): Qwen2MoEBridge maps
   `shared_experts.gate_weight` to HF's `mlp.shared_expert_gate.weight` but never sets
   `moe_shared_expert_gate`, so megatron-core (0.16.1: default False) builds the shared expert without
   its gate: the HF gate tensor is never read and the shared expert's output is added unscaled, where HF
   scales it by sigmoid(shared_expert_gate(x)) (the catalog's `shared-expert-gate-dropped`: tiny-qwen2-moe
   logprobs up to 2.07 off, top-1 agreement 0.33; stock, the harness's every-tensor-used guard refuses
   the checkpoint, naming the gate tensors). The class: NVIDIA/Megatron-LM #1595 (megatron-core's MoE
   spec once built SharedExpertMLP with gate=False whatever the model). We set
   `moe_shared_expert_gate=True`, and `moe_shared_expert_overlap` off (the bridge turns it on: it needs
   CUDA streams, which the CPU tier has none of, refuses the allgather dispatcher, and reorders the
   shared expert's gradient against the router's, megatron-core's own note; its forward is the same
   arithmetic).
13. Gemma 3 text (mbridge 0.15.1, found here): mbridge registers `gemma3` only, the vision-language
   Gemma3ForConditionalGeneration (`Gemma3Bridge(VLMBridge)`, `language_model.` names, a SigLIP tower),
   built from Transformer Engine modules only; `gemma3_text` (Gemma3ForCausalLM: gemma-3-1b, or any
   Gemma 3's text tower) has no bridge (KeyError in its registry). `make_bridge` builds it with the
   harness's own `HarnessGemma3TextBridge` (harness.bridge.gemma3: this mixin on mbridge's LLMBridge, with
   Gemma's zero-centered norms, post-attention/post-feedforward norms, sliding-window layers from
   `layer_types`, local/global RoPE bases, embedding scale and query_pre_attn_scalar).
14. GLM-4.5-MoE (mbridge 0.15.1's GLM4MoEBridge with transformers 5, found here): its `_get_gptmodel_args`
   reads `hf_config.rope_theta` (AttributeError in transformers 5, as override 4), and override 4's
   replacement dropped the bridge's `rotary_percent`: GLM's partial RoPE (`partial_rotary_factor` 0.5: HF
   rotates the first half of each head and passes the rest through) would run on every dim of the head (the
   catalog's `glm-partial-rope-full-head`; stock, the preflight refused any partial_rotary_factor). We pass
   `rotary_percent` from `harness.bridge.preflight.rope_settings`. The bridge's
   `moe_shared_expert_overlap=True` is off (CUDA streams, as override 12), and its
   `moe_router_load_balancing_type="seq_aux_loss"` gives way to MOE_TRAINING_SETTINGS (none, as HF trains
   with output_router_logits off); its expert bias is loaded (`mlp.router.expert_bias`, a buffer in the
   state dict) and never updated (`moe_router_bias_update_rate` 0, the bridge's own).
15. DeepSeek-V3's RoPE (mbridge 0.15.1 with transformers 5, found here): `DeepseekV3Bridge._build_config`
   reads `hf_config.rope_theta` (AttributeError in transformers 5, as override 4) and takes the YaRN
   settings from `hf_config.rope_scaling` by the key `type`, where transformers 5 (and DeepSeek-V3's own
   config.json since its rope_scaling has `type`, but transformers normalises it) names it `rope_type`:
   its default `"type": "rope"` then stands, and megatron-core's MLA builds a plain RotaryEmbedding
   and no softmax mscale (the catalog's `yarn-mscale-missing` is the mscale half of it). We hand the
   bridge a view of the config with `rope_theta` and `rope_scaling = {"type": "yarn", ...}` from
   `harness.bridge.preflight.rope_settings`, which refuses a YaRN without every value megatron-core takes
   (mbridge would fill in its own defaults, where HF's differ). The bridge also passes YaRN's original
   window as `max_position_embeddings`, which megatron-core 0.16.1's MLATransformerConfig names
   `original_max_position_embeddings` (TypeError: the bridge builds nothing on this stack as shipped):
   renamed on its way in. Its `_get_safetensor_io` reads an fp32 checkpoint with `raise NotImplemented(...)`
   (TypeError: NotImplemented is not callable) and a bf16 one through its FP8-dequantising reader: we read
   both with mbridge's plain SafeTensorIO (preflight refuses an FP8-quantised checkpoint). Its own
   `_model_provider` drops LLMBridge's vocab padding: the model is built with the bare vocab (251 does
   not split over tp 2) and loading asserts on the unset `vocab_size`; we pad as LLMBridge does, in
   `_get_gptmodel_args`, which its provider calls.
16. DeepSeek-V3's group-limited routing (mbridge 0.15.1, found here): `DeepseekV3Bridge` never sets
   `moe_router_num_groups`/`moe_router_group_topk`, so megatron-core routes to the top k of all experts
   where HF picks the best `topk_group` of `n_group` groups first (the catalog's
   `group-limited-routing-ignored`). We set both from the config. Its `moe_router_bias_update_rate`
   (1e-3: megatron-core's aux-loss-free balancing moves `e_score_correction_bias` after every step) is
   set to 0: HF keeps the bias fixed, and the harness trains what HF computes, without balancing
   (MOE_TRAINING_SETTINGS); its fused MLA RoPE and the stream overlap of the shared experts are off
   (CUDA kernels and streams: the CPU tier has neither; the forward is the same arithmetic). The
   bridge sets `mtp_num_layers` to the config's `num_nextn_predict_layers` even when that is 0, and
   GPTModel then takes the MTP path for any value but None (AttributeError on the labels of a forward
   without them): None (preflight refuses a checkpoint with MTP layers). Its
   `attention_backend=AttnBackend.fused` (TE's) becomes `auto`, what every other model of the harness
   and Megatron-Bridge's DeepSeek-V3 build with: megatron-core's GPTModel writes the NVTE_* variables of
   its backend into the process environment and asserts those a model built before wrote (found when a
   world built DeepSeek-V3 after another model: "NVTE_FLASH_ATTN set to 1, but expected 0 for attention
   backend type fused"; on the TE spec too, 1x H200 2026-12-03, moonlight-shape after qwen2-moe-shape),
   and TE's fused attention has no fp32 kernel: fused, an fp32 model has no backend at all ("No dot
   product attention backend is available", moonlight-shape's fp32 training on TE, same run).
17. MLA on the local spec (megatron-core 0.16.1, found here): every MLASelfAttention of the local block
   spec gets the version-gated `harness.compat.megatron_core.mla_dot_product_attention()` as its core
   attention (`MLA_LOCAL_CORE_ATTENTION`: the local DotProductAttention takes no k/v head widths and
   MLASelfAttention tests isinstance against TE's placeholder), so DeepSeek-V3 builds without TE; and,
   under TP, each chunk's kv down projection gathered with the rope key's gradient summed over TP
   (`MLA_ROPE_KEY_GRAD`: stock, tp2-sp trained with a 3.4% grad-norm error). Moonlight (q_lora_rank None,
   issue 37) needs nothing more here: mbridge maps `linear_q_proj` to HF's `q_proj` itself (split over TP by
   heads), override 15's view leaves plain RoPE as the bridge's default "rope" (RotaryEmbedding, softmax scale
   1/sqrt(q head)), and megatron-core 0.16.1 builds the spec's plain linear_q_proj without a query norm
   (`use_mla_plain_query` is megatron-core 0.19.2's workaround, a no-op on 0.16.1).
18. The export walk (mbridge 0.15.1, speed): stock `export_weights` exchanges each tensor's name and spec
   over the pipeline group with two `all_gather_object` and one `broadcast_object_list` per tensor, even
   at pp 1: 0.22-0.24 s of a 0.33 s weight update of qwen3-0.6b-shape into vLLM on an H100
   (reports/gpu/2026-11-27-h100x4-sync-speed). We exchange every stage's (name, spec) list once per export
   and then broadcast only the tensors (none at pp 1); each tensor then goes through stock's own EP/TP
   gathers and `_weight_to_hf_format`, in stock's order. `stock_export_weights` keeps stock's walk, and
   suites/bridge/test_export_walk.py holds the two equal, item for item and bit for bit.
"""
from __future__ import annotations

import copy
import functools
import math
import inspect
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

import torch
from transformers import AutoConfig, PretrainedConfig

from harness.bridge.norms import local_block_spec, resolve_norm_precision  # noqa: F401  (re-exported)
from harness.bridge.specs import resolve as resolve_spec  # noqa: F401  (re-exported)
from harness.bridge.preflight import (  # noqa: F401  (re-exported: the rank-side second guard)
    SUPPORTED_MODEL_TYPES,
    RopeSettings,
    UnsupportedModelError,
    MOE_TRAINING_SETTINGS,
    check_hf_config,
    num_experts,
    rope_settings,
)
from harness.bridge.versions import (
    check_supported_versions,
    fused_softmax_kernels_available,
    te_available,
)

SpecChoice = Literal["te", "local"]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Local-spec layer norms -> HF names (the TE spec fuses these into the following linear layer).
_LOCAL_NORM = re.compile(r"decoder\.layers\.(\d+)\.(input_layernorm|pre_mlp_layernorm)\.weight")
_LOCAL_NORM_TO_HF = {"input_layernorm": "input_layernorm",
                     "pre_mlp_layernorm": "post_attention_layernorm"}
# MLA's local-spec norms (DeepSeek-V3; TE fuses them into linear_q_up_proj / linear_kv_up_proj as
# layer_norm_weight, which mbridge maps) -> HF names (override 2).
_LOCAL_MLA_NORM = re.compile(r"decoder\.layers\.(\d+)\.self_attention\.(q_layernorm|kv_layernorm)\.weight")
_LOCAL_MLA_NORM_TO_HF = {"q_layernorm": "q_a_layernorm", "kv_layernorm": "kv_a_layernorm"}
# mbridge's MoE bridges turn on fusions whose kernels the local spec lacks (TE/Apex): off, as
# megatron-core defaults them and as the dense bridges leave them.
_MOE_LOCAL_FUSIONS_OFF = {name: False for name in (
    "persist_layer_norm", "bias_activation_fusion", "bias_dropout_fusion", "moe_permute_fusion",
    "gradient_accumulation_fusion")}
# Qwen2-MoE's shared expert as HF computes it (override 12): its sigmoid gate on, no stream overlap.
QWEN2_MOE_SHARED_EXPERT = {"moe_shared_expert_gate": True, "moe_shared_expert_overlap": False}
# GLM-4.5-MoE's shared expert without stream overlap (override 14): CUDA streams, which the CPU tier lacks.
GLM4_MOE_SETTINGS = {"moe_shared_expert_overlap": False, "moe_router_bias_update_rate": 0.0}
# DeepSeek-V3's router and shared experts as HF computes them (override 16), and MLA's RoPE module by the
# checkpoint's rope type: YaRN, or (Moonlight) plain RoPE. Megatron-Bridge 0.6.2 leaves a plain-RoPE model
# MLATransformerConfig's default rope_type "yarn" (at factor 1 and mscale 1: YaRN's ramp blends two equal
# inv_freq tables, measured bit-equal to HF's at the tiny 8 and Moonlight's 64 rope dims); "rope" builds
# megatron-core's RotaryEmbedding, HF's default table by the same formula, the module mbridge's bridge builds.
def deepseek_v3_settings(hf_config: PretrainedConfig) -> dict[str, Any]:
    return {"moe_router_num_groups": getattr(hf_config, "n_group", None) or None,
            "moe_router_group_topk": getattr(hf_config, "topk_group", None) or None,
            "moe_router_bias_update_rate": 0.0, "moe_shared_expert_overlap": False, "apply_rope_fusion": False,
            "mtp_num_layers": None, "rope_type": "yarn" if rope_settings(hf_config).yarn else "rope"}


class _RopeConfigView:
    """An HF config as mbridge's DeepseekV3Bridge reads it (override 15): `rope_theta` and a
    `rope_scaling` with the key `type`; every other attribute the config's own."""

    def __init__(self, config: PretrainedConfig, rope: RopeSettings) -> None:
        self._config = config
        self._extra = {"rope_theta": rope.theta,
                       "rope_scaling": {"type": "yarn", **rope.yarn} if rope.yarn else None}

    def __getattr__(self, name: str) -> Any:
        extra = self.__dict__["_extra"]
        return extra[name] if name in extra else getattr(self.__dict__["_config"], name)

    def __contains__(self, name: str) -> bool:
        return name in self._extra or hasattr(self._config, name)


# SequentialMLP's experts (the local spec) -> TEGroupedMLP's names, which mbridge maps (override 8).
_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight")


class HarnessBridgeMixin:
    """Overrides for an mbridge LLM bridge; see the module docstring for why each exists."""

    def __init__(self, hf_config: PretrainedConfig, *, spec: Literal["te", "local"],
                 sequence_parallel: bool, norm_precision: str = "hf", **kwargs: Any) -> None:
        self.harness_spec = spec
        self.harness_norm_precision = norm_precision
        self.harness_tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        dtype = kwargs.get("dtype", torch.bfloat16)
        # Read by _build_base_config, which mbridge's __init__ calls.
        self._harness_config_args = {
            "sequence_parallel": sequence_parallel,
            "fp16": dtype is torch.float16,
            "masked_softmax_fusion": spec == "te" or fused_softmax_kernels_available(),
        }
        self.harness_sequential_experts = spec == "local" and num_experts(hf_config) > 0
        super().__init__(hf_config, **kwargs)
        if num_experts(hf_config):  # as on the other bridge (preflight.MOE_TRAINING_SETTINGS)
            self.set_extra_args(**MOE_TRAINING_SETTINGS)
        if self.harness_sequential_experts:  # override 8 (set_extra_args: after mbridge's own)
            self.set_extra_args(moe_grouped_gemm=False, **_MOE_LOCAL_FUSIONS_OFF)
        if hf_config.model_type == "mixtral":  # override 7
            self.set_extra_args(moe_router_pre_softmax=False)
        if hf_config.model_type == "qwen2_moe":  # override 12
            self.set_extra_args(**QWEN2_MOE_SHARED_EXPERT)
        if hf_config.model_type == "glm4_moe":  # override 14
            self.set_extra_args(**GLM4_MOE_SETTINGS)
        if hf_config.model_type == "deepseek_v3":  # override 16
            self.set_extra_args(**deepseek_v3_settings(hf_config))
            # mbridge's AttnBackend.fused: megatron-core asserts the NVTE_* variables its other models' `auto`
            # set in the same process (a world builds many models), and on TE fp32 has no fused backend
            from megatron.core.transformer.enums import AttnBackend

            self.set_extra_args(attention_backend=AttnBackend.auto)

    def _get_safetensor_io(self, weights_path: str):
        if self.hf_config.model_type != "deepseek_v3":
            return super()._get_safetensor_io(weights_path)
        from mbridge.core.safetensor_io import SafeTensorIO  # override 15: the unquantised checkpoint

        return SafeTensorIO(self._get_actual_hf_path(weights_path))

    def _build_config(self):
        if self.hf_config.model_type != "deepseek_v3":
            return super()._build_config()
        real = self.hf_config  # override 15: mbridge reads the view, everything else the config
        self.hf_config = _RopeConfigView(real, rope_settings(real))
        try:
            return super()._build_config()
        finally:
            self.hf_config = real

    def _build_base_config(self, text_config_key: Optional[str] = None, **kwargs: Any):
        if self.hf_config.model_type == "deepseek_v3" and "max_position_embeddings" in kwargs:  # override 15
            kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
        # Ours go in as keyword overrides, so mbridge's set_extra_args (applied last) still wins.
        return super()._build_base_config(text_config_key, **{**kwargs, **self._harness_config_args})

    def _adjust_mapping_for_shared_weights(self) -> None:
        # Tying is handled per instance in _weight_name_mapping_mcore_to_hf (override 3).
        return None

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        if mcore_weights_name == "output_layer.weight":
            return ["model.embed_tokens.weight" if self.harness_tied else "lm_head.weight"]
        match = _LOCAL_NORM.fullmatch(mcore_weights_name)
        if match:
            layer, norm = match.groups()
            return [f"model.layers.{layer}.{_LOCAL_NORM_TO_HF[norm]}.weight"]
        match = _LOCAL_MLA_NORM.fullmatch(mcore_weights_name) if self.hf_config.model_type == "deepseek_v3" else None
        if match:  # MLA's (Qwen3's q/k_layernorm are its QK-norm, which mbridge maps itself)
            layer, norm = match.groups()
            return [f"model.layers.{layer}.self_attn.{_LOCAL_MLA_NORM_TO_HF[norm]}.weight"]
        return super()._weight_name_mapping_mcore_to_hf(mcore_weights_name)

    def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True) -> dict[str, str]:
        if not self.harness_sequential_experts:
            return super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=consider_ep)
        names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)
        per_rank = self.config.num_moe_experts // self.mpu.ep_size
        offset = per_rank * self.mpu.ep_rank if consider_ep else 0
        for local, name in names.items():  # override 8
            match = _LOCAL_EXPERT.fullmatch(name)
            if match:
                prefix, expert, linear = match.groups()
                names[local] = f"{prefix}.{linear}.weight{int(expert) + offset}"
        return names

    def load_weights(self, models: list[torch.nn.Module], weights_path: str, memory_efficient: bool = False) -> None:
        if not self.harness_sequential_experts:
            return super().load_weights(models, weights_path, memory_efficient)
        io = self._get_safetensor_io(weights_path)  # override 8: each rank reads and keeps its shard
        for model in models:
            state = model.state_dict()
            for local, name in self._weight_name_mapping_mcore_local_to_global(model).items():
                if "_extra_state" in local:
                    continue
                full = self._weight_to_mcore_format(
                    name, [io.load_one_hf_weight(hf) for hf in self._weight_name_mapping_mcore_to_hf(name)])
                param = state[local]
                size, rank = ((self.mpu.etp_size, self.mpu.etp_rank) if ".mlp.experts.linear_fc" in name
                              else (self.mpu.tp_size, self.mpu.tp_rank))
                shard = list(self._weight_split_across_tp(name, full, param, size))[rank]
                if shard.shape != param.shape:
                    raise RuntimeError(f"{name}: the checkpoint's shard {tuple(shard.shape)} does not fit "
                                       f"{local} {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(shard.to(param.dtype))
        return None

    def _weight_merge_across_tp(self, mcore_weights_name: str, mcore_weights: list[torch.Tensor],
                                param: torch.Tensor) -> torch.Tensor:
        # Override 9: at ep 1 stock export_weights gathers an expert's shards over the dense TP group
        # (its TP branch), then asserts it got etp of them; we gather them over the expert-TP group.
        if not ("mlp.experts.linear_fc" in mcore_weights_name and self.mpu.ep_size == 1
                and self.mpu.etp_size != self.mpu.tp_size):
            return super()._weight_merge_across_tp(mcore_weights_name, mcore_weights, param)
        shards = [torch.empty_like(param) for _ in range(self.mpu.etp_size)]
        torch.distributed.all_gather(shards, param.contiguous(), group=self.mpu.etp_group)
        if len(shards) == 1:  # etp 1: the rank's expert is whole (a replica over its TP group)
            return shards[0]
        if self.mpu.tp_size == 1:  # stock's merge returns a lone shard as the whole at tp 1
            raise NotImplementedError(f"{mcore_weights_name}: exporting experts split over etp="
                                      f"{self.mpu.etp_size} at tp 1 and ep 1 is not supported with mbridge")
        return super()._weight_merge_across_tp(mcore_weights_name, shards, param)

    def export_weights(self, models: list[torch.nn.Module]):
        """Override 18: stock's walk, with the pipeline stages' names exchanged once per export."""
        from mbridge.core.util import unwrap_model

        models = [unwrap_model(model) for model in models]
        local = _local_weights(models)  # (chunk, local name, tensor), stock's order
        maps = [self._weight_name_mapping_mcore_local_to_global(model, consider_ep=False) for model in models]
        mine = [(self.mpu.pp_rank, maps[chunk][name], _tensor_spec(tensor)) for chunk, name, tensor in local]
        entries = mine
        if self.mpu.pp_size > 1:
            per_stage: list[Any] = [None] * self.mpu.pp_size
            torch.distributed.all_gather_object(per_stage, mine, group=self.mpu.pp_group)
            entries = [entry for stage in per_stage for entry in stage]
        own = iter(local)
        for stage, name, spec in entries:
            tensor = next(own)[2] if stage == self.mpu.pp_rank else _empty_from_spec(spec)
            if self.mpu.pp_size > 1:
                source = torch.distributed.get_global_rank(self.mpu.pp_group, stage)
                torch.distributed.broadcast(tensor, src=source, group=self.mpu.pp_group)
            yield from self._harness_export_one(name, tensor)

    def stock_export_weights(self, models: list[torch.nn.Module]):
        """mbridge's own walk (override 18 keeps it for the equality test)."""
        return super().export_weights(models)

    def _harness_export_one(self, name: str, param: torch.Tensor):
        """Stock export_weights' body for one tensor whole on this stage (mbridge 0.15.1, unchanged):
        experts gathered over EP (and ETP), TP shards merged, then converted to HF's names."""
        if ".mlp.experts.linear_fc" in name and self.mpu.ep_size > 1:
            num_experts_per_rank = self.config.num_moe_experts // self.mpu.ep_size
            gathered = [torch.empty_like(param) for _ in range(self.mpu.ep_size)]
            torch.distributed.all_gather(gathered, param, group=self.mpu.ep_group)
            prefix, local_expert = name.split(".weight")
            for ep_rank, expert_param in enumerate(gathered):
                expert_name = f"{prefix}.weight{num_experts_per_rank * ep_rank + int(local_expert)}"
                if self.mpu.etp_size > 1:
                    shards = [torch.empty_like(expert_param) for _ in range(self.mpu.etp_size)]
                    torch.distributed.all_gather(shards, expert_param, group=self.mpu.etp_group)
                else:
                    shards = [expert_param]
                merged = self._weight_merge_across_tp(expert_name, shards, param)
                yield from zip(*self._weight_to_hf_format(expert_name, merged))
            return
        if getattr(param, "tensor_model_parallel", False):
            if self.mpu.tp_size <= 1:
                shards = [param]
            else:
                shards = [torch.empty_like(param) for _ in range(self.mpu.tp_size)]
                torch.distributed.all_gather(shards, param, group=self.mpu.tp_group)
            param = self._weight_merge_across_tp(name, shards, param)
        yield from zip(*self._weight_to_hf_format(name, param))

    def _get_gptmodel_args(self) -> dict:
        rope = rope_settings(self.hf_config)  # override 4
        args = dict(
            vocab_size=self.hf_config.vocab_size,
            max_sequence_length=self.hf_config.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=rope.theta,
        )
        if rope.llama3:
            args.update(rope_scaling=True, rope_scaling_factor=float(rope.llama3["factor"]))
        if rope.rotary_percent != 1.0:  # override 14: GLM-4.5-MoE's partial RoPE
            args.update(rotary_percent=rope.rotary_percent)
        if self.hf_config.model_type == "deepseek_v3":  # override 15: LLMBridge's padding, which its provider drops
            self.vocab_size = args["vocab_size"]
            self.padded_vocab_size = self.vocab_size
            if self.make_vocab_size_divisible_by is not None:
                self.padded_vocab_size = int(math.ceil(self.vocab_size / self.make_vocab_size_divisible_by)
                                             * self.make_vocab_size_divisible_by)
            args["vocab_size"] = self.padded_vocab_size
        return args

    def _model_provider(self, post_model_creation_callbacks, *args: Any, **kwargs: Any):
        # Override 4: every chunk mbridge builds gets the checkpoint's Llama-3 frequencies.
        # Override 10: megatron-core 0.16.1's experts at ep 1 with etp != tp marked expert-parallel
        # (harness.compat.megatron_core.EXPERTS_AT_EP1_ETP_NE_TP), before get_model wraps them in DDP;
        # override 11: TE's grouped experts split over etp marked tensor-parallel (TE_GROUPED_EXPERTS_UNMARKED).
        callbacks = [*post_model_creation_callbacks, self._harness_set_rope_frequencies,
                     self._harness_mark_expert_parameters]
        return super()._model_provider(callbacks, *args, **kwargs)

    def _harness_mark_expert_parameters(self, model: torch.nn.Module, **unused: Any) -> None:
        from harness.compat.megatron_core import mark_expert_parameters, mark_split_expert_weights

        mark_expert_parameters(model, self.config)
        mark_split_expert_weights(model, self.config)  # override 11
        if getattr(self.config, "multi_latent_attention", False):  # override 17: MLA's rope key gradient under TP
            from harness.compat.megatron_core import sum_mla_rope_key_grad

            sum_mla_rope_key_grad(model, self.config)

    def _harness_set_rope_frequencies(self, model: torch.nn.Module, **unused: Any) -> None:
        rope = rope_settings(self.hf_config)
        if rope.llama3:
            model.rotary_pos_emb.inv_freq = llama3_inv_freq(model.rotary_pos_emb, rope, self.hf_config)

    def _get_transformer_layer_spec(self, vp_stage: Optional[int] = None):
        if self.harness_spec == "te":
            return super()._get_transformer_layer_spec(vp_stage)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        # mbridge's model provider reads has_vp_stage after calling this method.
        self.has_vp_stage = "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters
        # Override 6: LocalRMSNorm in every norm slot.
        spec = local_block_spec(self.config, vp_stage=vp_stage, norm_precision=self.harness_norm_precision)
        if getattr(self.config, "multi_latent_attention", False):  # override 17
            from harness.compat.megatron_core import use_mla_local_core_attention, use_mla_plain_query

            spec = use_mla_plain_query(use_mla_local_core_attention(spec), self.config)  # 0.16.1: as it is
        return spec


def _local_weights(models: list[torch.nn.Module]) -> list[tuple[int, str, torch.Tensor]]:
    """(chunk, local name, tensor) in stock export_weights' order: each chunk's parameters, then its
    `expert_bias` buffers (a state-dict entry, not a parameter), moved to the current device as stock does."""
    weights = []
    for chunk, model in enumerate(models):
        names = set()
        for name, param in model.named_parameters():
            names.add(name)
            weights.append((chunk, name, param))
        state = model.state_dict()
        for name in state:
            if "_extra_state" not in name and "expert_bias" in name and name not in names:
                weights.append((chunk, name, state[name].to(torch.cuda.current_device())))
    return weights


def _tensor_spec(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tensor.dtype, getattr(tensor, "tensor_model_parallel", None),
            getattr(tensor, "partition_dim", None))


def _empty_from_spec(spec: tuple) -> torch.Tensor:
    """A receive buffer carrying the owner's tensor-parallel attributes, as stock's broadcast makes it."""
    shape, dtype, tensor_parallel, partition_dim = spec
    tensor = torch.empty(shape, dtype=dtype, device=torch.cuda.current_device())
    if tensor_parallel is not None:
        tensor.tensor_model_parallel = tensor_parallel
    if partition_dim is not None:
        tensor.partition_dim = partition_dim
    return tensor


def llama3_inv_freq(rotary: torch.nn.Module, rope: RopeSettings,
                    hf_config: PretrainedConfig) -> torch.Tensor:
    """Megatron's Llama-3 inv_freq at the checkpoint's four values (override 4), on the device of
    `rotary.inv_freq`; raises unless it equals HF's bit for bit."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if not isinstance(rotary, RotaryEmbedding):
        raise UnsupportedModelError(f"llama3 RoPE needs Megatron's RotaryEmbedding, the model has {type(rotary)}")
    # Megatron's own unscaled frequencies (same kv_channels and base as the model's), then its own
    # scaling function with the values GPTModel cannot pass through.
    unscaled = RotaryEmbedding(kv_channels=rotary.inv_freq.numel() * 2, rotary_percent=1.0,
                               rotary_base=rope.theta, use_cpu_initialization=True).inv_freq
    megatron = rotary._apply_scaling(unscaled, **rope.llama3)
    hf, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](copy.deepcopy(hf_config), "cpu")
    if attention_factor != 1.0 or megatron.shape != hf.shape or not torch.equal(megatron, hf):
        raise UnsupportedModelError(
            f"llama3 RoPE: Megatron's inv_freq differs from HF's (attention factor {attention_factor}, "
            f"Megatron {megatron.tolist()}, HF {hf.tolist()}); this Megatron-Core/transformers pair "
            "cannot reproduce the checkpoint")
    return megatron.to(rotary.inv_freq.device)


@functools.cache
def _harness_class(base: type) -> type:
    return type(f"Harness{base.__name__}", (HarnessBridgeMixin, base), {})


def make_bridge(path: str | Path, *, dtype: torch.dtype = torch.float32,
                make_vocab_size_divisible_by: int = 128, spec: SpecChoice | None = None,
                sequence_parallel: bool = False, norm_precision: str = "auto",
                config_overrides: Mapping[str, Any] | None = None):
    """An mbridge bridge (with the harness fixes) for the HF checkpoint dir `path`.

    Rank-side: Megatron's parallel state must be initialized (the bridge reads TP/PP/VPP from it).
    The vocab is padded to a multiple of `make_vocab_size_divisible_by * TP`, as Megatron-LM does.
    `config_overrides` are TransformerConfig fields applied last (e.g. recompute settings).
    `sequence_parallel` works with either spec (it needs TP > 1, which Megatron checks, and inputs
    whose sequence length is divisible by TP). `spec` None: the world's (harness.bridge.specs).
    """
    check_supported_versions()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    resolved = resolve_spec(spec)
    import mbridge  # noqa: F401  (importing registers the model bridges)
    from mbridge.core.bridge import _MODEL_REGISTRY
    from megatron.core import parallel_state

    hf_config = AutoConfig.from_pretrained(path)
    check_hf_config(hf_config)
    if num_experts(hf_config):
        from harness.compat.megatron_core import define_te_general_gemm

        define_te_general_gemm()
    if hf_config.model_type == "gemma3_text":  # override 13: mbridge registers only the VLM gemma3
        from harness.bridge.gemma3 import gemma3_bridge_class

        cls = gemma3_bridge_class()
    else:
        cls = _harness_class(_MODEL_REGISTRY[hf_config.model_type])
    tp = parallel_state.get_tensor_model_parallel_world_size()
    bridge = cls(hf_config, spec=resolved, sequence_parallel=sequence_parallel, dtype=dtype,
                 norm_precision=resolve_norm_precision(norm_precision, resolved),
                 make_vocab_size_divisible_by=make_vocab_size_divisible_by * tp)
    if config_overrides:
        bridge.set_extra_args(**config_overrides)
    return bridge
