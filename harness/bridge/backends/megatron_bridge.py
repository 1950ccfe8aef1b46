"""NVIDIA Megatron-Bridge (0.6, on megatron-core 0.19) behind the interface mbridge's bridges give
`harness.bridge.load`: `get_model`, `load_weights`, `export_weights`, `unused_hf_tensors` and the
model's facts. Rank-side, after Megatron's parallel state is initialized.

What is set on Megatron-Bridge's model provider, and why (so that both bridges build the same model):
- the parallel sizes from parallel_state (the provider would otherwise build a TP1/PP1 model);
- the vocab padded to 128 x TP, as mbridge and Megatron-LM do (Megatron-Bridge pads only when told,
  and the zoo's 251-token vocab cannot be split over TP unpadded);
- the local spec with the harness's RMSNorm in every slot (harness.bridge.norms.local_block_spec) and
  Megatron's local attention when the spec is local; TE's spec as the provider builds it otherwise;
- the fusions Megatron-Bridge turns on by default off, on both specs, as megatron-core (and so
  mbridge) defaults them (gradient accumulation fusion, bias-activation / bias-dropout fusion,
  persistent layer norm, RoPE fusion: on the local spec each needs TE or Apex kernels and LocalRMSNorm
  refuses persist_layer_norm; on TE gradient accumulation fusion needs Apex); masked softmax fusion
  only where its kernels exist (harness fix 5 of mbridge_compat);
- `attention_softmax_in_fp32` True and `deallocate_pipeline_outputs` False: what megatron-core (and
  so mbridge) defaults to, where Megatron-Bridge's provider defaults differ;
- mbridge's pipeline settings (variable sequence lengths, no batched p2p, and under VPP the
  interleaved schedule's overlapped p2p, `overlap_p2p_comm`, which Megatron-Bridge's own training
  setup sets too): without the overlap, the schedule's steady state sends a gradient's shape back
  while the previous stage is still sending forward (megatron-core 0.19.2 schedules.py:1908,
  p2p_communication.py:257-259), which only a send that completes before its receive is posted
  survives; a gloo send waits for the receive, so every pp2vpp2 training step on CPU hung, dense or
  MoE (0.16.1 too with the overlap off);
- gpt-oss (GPTOSSBridge): the attention sinks marked as split over TP, and the expert biases' two
  training bugs worked around, before DDP wraps the model (harness.compat.megatron_core:
  SOFTMAX_OFFSET_UNMARKED, EXPERT_BIAS_SUMMED_OVER_TP, EXPERT_BIAS_INPLACE_ON_VIEW); the rest of what
  GPTOSSBridge sets for GPUs (grouped GEMM, permute and bias-activation fusions) is turned off below as
  for every MoE model;
- MoE: the expert parallel sizes from parallel_state too; on the local spec SequentialMLP experts
  (`moe_grouped_gemm` off: the legacy GroupedMLP needs the CUDA grouped_gemm package) and no router
  fusion (TE kernels); no load-balancing loss (preflight.MOE_TRAINING_SETTINGS: the provider's
  Qwen3-MoE aux loss of 0.001 moved the trained weights 1.8e-3 off HF's).
- GLM-4.5-MoE (issue 37; `GLM45_SETTINGS`): the GLM45Bridge's shared-expert stream overlap off (CUDA
  streams; the CPU tier has none), no MTP layers (`mtp_num_layers` None: HF's causal LM computes none, and
  the preflight ignores their tensors explicitly), and `rotary_percent` from the preflight's RoPE settings
  (the provider maps partial_rotary_factor itself, to the same 0.5: set here so both bridges take it from
  one place).
- DeepSeek-V3 (issue 37): what mbridge_compat's override 16 sets (`deepseek_v3_settings`: group-limited routing
  from n_group/topk_group, which DeepSeekV3Bridge also maps; the expert bias never updated, as HF keeps it; no
  stream overlap, fused RoPE or MTP); on the local spec MLA's core attention and, under TP, its rope key's
  gradient (harness.compat.megatron_core: MLA_LOCAL_CORE_ATTENTION, MLA_ROPE_KEY_GRAD, seen on 0.19.2 as on
  0.16.1). The bridge's YaRN (rotary_scaling_factor, mscale, mscale_all_dim, ...) and its mapping of
  e_score_correction_bias to the router's expert_bias are its own, unchanged. Moonlight (q_lora_rank None: one
  q_proj, which the bridge maps to linear_q_proj itself): plain RoPE built as RotaryEmbedding (`rope_type` in
  `deepseek_v3_settings`: the provider keeps MLATransformerConfig's "yarn" at factor 1), and megatron-core
  0.19.2's query-norm resolver worked around on both specs (harness.compat.megatron_core.MLA_PLAIN_QUERY: stock,
  the local spec does not build, TE's adds a query RMSNorm HF does not have; TE not run here).
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from transformers import AutoConfig

from harness.bridge.norms import local_block_spec, resolve_norm_precision
from harness.bridge.preflight import MOE_TRAINING_SETTINGS, NOT_WEIGHTS, check_hf_config, num_experts, rope_settings
from harness.bridge.specs import resolve as resolve_spec
from harness.bridge.versions import fused_softmax_kernels_available

_FUSIONS_OFF = ("gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                      "persist_layer_norm", "apply_rope_fusion", "moe_permute_fusion")
_PADDED = ("model.embed_tokens.weight", "lm_head.weight")
# GLM-4.5-MoE on the CPU tier, as mbridge_compat's override 14 builds it (module docstring).
GLM45_SETTINGS = {"moe_shared_expert_overlap": False, "mtp_num_layers": None, "moe_router_bias_update_rate": 0.0}


class MegatronBridgeHandle:
    """One checkpoint's Megatron-Bridge `AutoBridge` and model provider, configured for this rank."""

    def __init__(self, path: str | Path, *, dtype: torch.dtype, make_vocab_size_divisible_by: int = 128,
                 spec: str | None = None, sequence_parallel: bool = False, norm_precision: str = "auto",
                 config_overrides: Mapping[str, Any] | None = None) -> None:
        from harness.compat.megatron_bridge import import_bridge

        import_bridge()
        from megatron.bridge import AutoBridge
        from megatron.bridge.models.conversion.param_mapping import AutoMapping

        # The local spec's core attention is the harness's DotProductAttention subclass
        # (harness.parallel.cp_attention): its one parameter, gpt-oss's sinks, splits as the stock class's.
        AutoMapping.register_module_type("GatheredKVAttention", "column")
        from megatron.core import parallel_state as ps

        self.hf_config = AutoConfig.from_pretrained(path)
        check_hf_config(self.hf_config)
        self.harness_spec = resolve_spec(spec)
        self.harness_norm_precision = resolve_norm_precision(norm_precision, self.harness_spec)
        self.harness_tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
        self.dtype = dtype
        if self.hf_config.model_type == "glm4_moe" and self.harness_spec == "local":
            from harness.compat.megatron_bridge import add_glm45_local_expert_mappings

            add_glm45_local_expert_mappings()  # the routed experts' SequentialMLP names (a workaround)
        self.auto = AutoBridge.from_hf_pretrained(str(path), torch_dtype=dtype)
        provider = self.auto.to_megatron_provider(load_weights=False)
        provider.tensor_model_parallel_size = ps.get_tensor_model_parallel_world_size()
        provider.pipeline_model_parallel_size = ps.get_pipeline_model_parallel_world_size()
        provider.virtual_pipeline_model_parallel_size = ps.get_virtual_pipeline_model_parallel_world_size()
        provider.context_parallel_size = ps.get_context_parallel_world_size()
        provider.expert_model_parallel_size = ps.get_expert_model_parallel_world_size()
        provider.expert_tensor_parallel_size = ps.get_expert_tensor_parallel_world_size()
        provider.sequence_parallel = sequence_parallel
        provider.should_pad_vocab = True
        provider.make_vocab_size_divisible_by = make_vocab_size_divisible_by
        overrides: dict[str, Any] = {
            "attention_softmax_in_fp32": True, "deallocate_pipeline_outputs": False,
            "variable_seq_lengths": True, "batch_p2p_comm": False,
            # under VPP the interleaved schedule's overlapped p2p, as mbridge (and Megatron-Bridge's own
            # CommOverlapConfig) set it: without it a training step at pp2vpp2 deadlocks on gloo
            "overlap_p2p_comm": provider.virtual_pipeline_model_parallel_size is not None
            and provider.pipeline_model_parallel_size > 1,
            # 0.19 refuses variable sequence lengths with any other dispatcher, even in a dense model
            "moe_token_dispatcher_type": "alltoall",
            "masked_softmax_fusion": self.harness_spec == "te" or fused_softmax_kernels_available(),
        }
        if self.harness_spec == "local":
            from megatron.core.transformer.enums import AttnBackend

            provider.transformer_layer_spec = self._local_spec
            provider.attention_backend = AttnBackend.local
            if num_experts(self.hf_config):
                overrides.update(moe_grouped_gemm=False, moe_router_fusion=False)
        elif getattr(self.hf_config, "q_lora_rank", 1) is None:  # Moonlight on TE's spec (not run here: no TE)
            provider.transformer_layer_spec = self._te_spec_with_plain_query(provider.transformer_layer_spec)
        if num_experts(self.hf_config):  # the provider's aux loss off, as on the other bridge
            overrides.update(MOE_TRAINING_SETTINGS)
        # On both specs: megatron-core's defaults (what mbridge builds, what the harness's TE figures were
        # measured on). On TE, gradient accumulation fusion needs Apex's fused_weight_gradient_mlp_cuda
        # (every TE parity case failed without it on an H100, 2026-11-25).
        overrides.update({name: False for name in _FUSIONS_OFF if hasattr(provider, name)})
        self.rope = rope_settings(self.hf_config)  # refuses every rope type but default and llama3
        provider.rotary_base = self.rope.theta
        if self.hf_config.model_type == "glm4_moe":  # partial RoPE, no stream overlap, no MTP (GLM45_SETTINGS)
            provider.rotary_percent = self.rope.rotary_percent
            overrides.update(GLM45_SETTINGS)
        if self.hf_config.model_type == "deepseek_v3":  # as mbridge_compat's override 16 builds it
            from harness.bridge.mbridge_compat import deepseek_v3_settings

            overrides.update(deepseek_v3_settings(self.hf_config))
        if self.rope.llama3:  # mbridge_compat override 4: the flag and factor here, the frequencies below
            provider.rope_scaling, provider.rope_scaling_factor = True, float(self.rope.llama3["factor"])
        provider.perform_initialization = False  # every parameter is loaded (unused_hf_tensors checks it)
        if getattr(provider, "softmax_type", "vanilla") == "learnable":  # gpt-oss's sinks: TP-split, unmarked
            from harness.compat.megatron_core import mark_softmax_offsets

            provider.register_pre_wrap_hook(mark_softmax_offsets)
        if num_experts(self.hf_config) and provider.add_bias_linear:  # gpt-oss's expert biases
            from harness.compat.megatron_core import fix_expert_biases

            provider.register_pre_wrap_hook(fix_expert_biases)
        if self.hf_config.model_type == "deepseek_v3" and self.harness_spec == "local":  # MLA's rope key grad
            provider.register_pre_wrap_hook(self._sum_mla_rope_key_grad)
        provider.apply_overrides_and_finalize(dtype=dtype, overrides={**overrides, **(config_overrides or {})})
        self.provider = provider
        self.config = provider
        tp = provider.tensor_model_parallel_size
        self.vocab_size = self.hf_config.vocab_size
        multiple = make_vocab_size_divisible_by * tp
        self.padded_vocab_size = -(-self.vocab_size // multiple) * multiple

    def _sum_mla_rope_key_grad(self, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """harness.compat.megatron_core.MLA_ROPE_KEY_GRAD under TP, as mbridge_compat's override 17 (a pre-wrap
        hook: before DDP wraps the chunks)."""
        from harness.compat.megatron_core import sum_mla_rope_key_grad

        for chunk in chunks:
            sum_mla_rope_key_grad(chunk, self.provider)
        return chunks

    def _local_spec(self, config, vp_stage: int | None = None):
        spec = local_block_spec(config, vp_stage=vp_stage, norm_precision=self.harness_norm_precision)
        if getattr(config, "multi_latent_attention", False):  # DeepSeek-V3: MLA's local core attention
            from harness.compat.megatron_core import use_mla_local_core_attention, use_mla_plain_query

            spec = use_mla_plain_query(use_mla_local_core_attention(spec), config)  # Moonlight: its q_proj
        return spec

    def _te_spec_with_plain_query(self, stock):
        """TE's spec, as the provider builds it, with MLA_PLAIN_QUERY (q_lora_rank None) as on the local spec."""
        from harness.compat.megatron_core import use_mla_plain_query

        def spec(config, vp_stage: int | None = None):
            return use_mla_plain_query(stock(config, vp_stage=vp_stage), config)

        return spec

    # ----------------------------------------------------------------- what harness.bridge.load calls
    def get_model(self, *, weight_path=None, fp16: bool = False, bf16: bool = False, wrap_with_ddp: bool = False,
                  ddp_config: Mapping[str, Any] | None = None) -> list[torch.nn.Module]:
        from megatron.core.distributed import DistributedDataParallelConfig

        ddp = None
        if wrap_with_ddp:  # mbridge's defaults, then the caller's
            ddp = DistributedDataParallelConfig(**{"grad_reduce_in_fp32": True, "use_distributed_optimizer": True,
                                                   **(ddp_config or {})})
        on_cpu = not torch.cuda.is_available() or torch.distributed.get_backend() == "gloo"
        kwargs = dict(ddp_config=ddp, wrap_with_ddp=wrap_with_ddp, fp16=fp16, bf16=bf16,
                      use_cpu_initialization=on_cpu, data_parallel_random_init=False)
        accepted = inspect.signature(self.provider.provide_distributed_model).parameters
        models = self.provider.provide_distributed_model(**{k: v for k, v in kwargs.items() if k in accepted})
        if self.rope.llama3:  # Megatron hard-codes Llama 3.1's limits: the checkpoint's own, checked against HF's
            from megatron.core.utils import unwrap_model

            from harness.bridge.mbridge_compat import llama3_inv_freq

            for chunk in unwrap_model(list(models)):
                chunk.rotary_pos_emb.inv_freq = llama3_inv_freq(chunk.rotary_pos_emb, self.rope, self.hf_config)
        return models

    def load_weights(self, chunks: list[torch.nn.Module], path: str) -> None:
        self.auto.load_hf_weights(chunks)

    def export_weights(self, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
        """HF names and full tensors, the vocab padding sliced off; a tied model's `lm_head.weight`
        (yielded only when the checkpoint stores the duplicate) dropped, as mbridge's export has it.
        A tied model under PP then yields its last stage's embedding copy too, as mbridge's export
        does: Megatron-Bridge reads only the first stage's, so a diverged copy (the
        unsynced-tied-embedding variant) would otherwise go unnoticed by the callers' check."""
        for name, tensor in self.auto.export_hf_weights(chunks, cpu=False, show_progress=False):
            if name == "lm_head.weight" and self.harness_tied:
                continue
            if name in _PADDED:
                tensor = tensor[: self.vocab_size]
            yield name, tensor
        if self.harness_tied and torch.distributed.get_world_size(_pp_group()) > 1:
            yield "model.embed_tokens.weight", self._last_stage_embedding(chunks)

    def _last_stage_embedding(self, chunks: list[torch.nn.Module]) -> torch.Tensor:
        """The last pipeline stage's copy of a tied embedding (its output layer), gathered over TP
        and broadcast over PP: collective over the model-parallel group."""
        from megatron.core import parallel_state as ps
        from megatron.core.utils import unwrap_model

        dist = torch.distributed
        tp_group, pp_group = ps.get_tensor_model_parallel_group(), _pp_group()
        last = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)
        shard = next((c.output_layer.weight for c in unwrap_model(list(chunks))
                      if getattr(c, "post_process", False)), None)
        if shard is not None:
            parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(tp_group))]
            dist.all_gather(parts, shard.detach().contiguous(), group=tp_group)
            full = torch.cat(parts)[: self.vocab_size].contiguous()
        else:
            full = torch.empty((self.vocab_size, self.hf_config.hidden_size), dtype=self.dtype, device=_device())
        dist.broadcast(full, src=last, group=pp_group)
        return full

    def unused_hf_tensors(self, chunks: list[torch.nn.Module], on_disk: set[str]) -> list[str]:
        """Checkpoint tensors no conversion task reads (Megatron-Bridge only warns about them and
        leaves the parameter as built: uninitialized, with perform_initialization off)."""
        used: set[str] = set()
        for task in self.auto.get_conversion_tasks(chunks):
            if task is None:
                continue
            hf = task.mapping.hf_param
            used.update(hf.values() if isinstance(hf, Mapping) else [hf])
        # Every rank of the world: pipeline stages hold other layers, expert-parallel ranks other experts.
        per_rank: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(per_rank, sorted(used))
        used = set().union(*per_rank)
        if self.harness_tied:
            used.add("lm_head.weight")
        return sorted(n for n in on_disk - used if not n.endswith(NOT_WEIGHTS))


def _pp_group():
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_group()


def _device() -> torch.device:
    """Where this rank's collectives run: CUDA under NCCL, else CPU."""
    on_cuda = torch.cuda.is_available() and torch.distributed.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
