"""Context-parallel attention for the local layer spec: what lets a CP layout run on the CPU tier.

Megatron-Core's only attention for CP is TEDotProductAttention (its local DotProductAttention
asserts `context_parallel_size == 1`), and Transformer Engine has no CPU kernels. Everything else
of CP is plain Megatron and harness code that runs on gloo: the zig-zag split of every sequence
(chunks r and 2cp-1-r), RoPE's matching slices of its position table, the logprob gather, the loss
and the gradient reduction over DP x CP, MoE token dispatch across CP ranks, checkpoints. So on the
local spec each CP rank's core attention is `GatheredKVAttention`: it all-gathers K and V over the
CP group (Transformer Engine's `cp_comm_type="all_gather"` does the same), builds the causal mask
from the global positions of its queries and of every gathered key, and runs Megatron's own
DotProductAttention arithmetic on them. Its backward sums each key's and value's gradient over the
CP ranks whose queries used it, and keeps this rank's share.

Its values equal single-rank attention up to the summation order of the softmax (the same keys,
the same mask): in fp32 a CP layout is then held to the fp32 tolerances, which TE's CP (fp16/bf16
kernels only) cannot reach. What it does not exercise is TE's ring exchange (p2p, a2a): that is the
CUDA tier's (`--mrh-spec te`). The same class takes packed THD sequences (`packed_seq_params`, with or
without CP: a block-diagonal causal mask from `cu_seqlens`), which the local DotProductAttention refuses;
without CP or THD it is megatron-core's DotProductAttention, untouched. Sliding windows under CP or THD
are refused (its mask is causal only).
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch

ATTENTION = "gathered-kv"  # the report's name for this CP attention (the CPU tier's)


class _GatherKV(torch.autograd.Function):
    """All-gather along dim 0 (the sequence) over `group`, in rank order; backward: the gathered
    gradient summed over the group (every rank's queries saw every key), this rank's part kept."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.rank, ctx.size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)  # gloo has no reduce_scatter
        return grad.chunk(ctx.size, dim=0)[ctx.rank].contiguous(), None


def causal_mask(local_length: int, cp: int, rank: int, device: torch.device,
                cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """[1, 1, sq, sk] bool, True = masked (Megatron's convention): query i of this rank (global
    position p_i) sees gathered key j (global position k_j) iff k_j <= p_i and, in a packed THD row
    (`cu_seqlens`: the whole row's boundaries), both lie in the same sequence."""
    from harness.logprobs.context_parallel import rank_positions

    length = local_length * cp
    cu = None if cu_seqlens is None else cu_seqlens.cpu()
    queries = rank_positions(length, cu, cp, rank)
    keys = torch.cat([rank_positions(length, cu, cp, r) for r in range(cp)])
    masked = keys.unsqueeze(0) > queries.unsqueeze(1)
    if cu is not None:
        segment = lambda positions: torch.searchsorted(cu[1:].long(), positions, right=True)  # noqa: E731
        masked |= segment(keys).unsqueeze(0) != segment(queries).unsqueeze(1)
    return masked.to(device).view(1, 1, local_length, length)


def attention_class() -> type:
    """`GatheredKVAttention`, defined against this process's megatron-core (imported on demand)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _define()
    return _CLASS


_CLASS: Optional[type] = None


def _define() -> type:
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class GatheredKVAttention(DotProductAttention):
        """DotProductAttention over this CP rank's queries and every CP rank's keys and values."""

        def __init__(self, config, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("cp_comm_type", None)  # one way to exchange: the all-gather
            single = copy.copy(config)  # the base class refuses a CP config: it is given one without
            single.context_parallel_size = 1
            super().__init__(single, *args, **kwargs)
            self.config = config

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            group = parallel_state.get_context_parallel_group()
            cp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
            if cp == 1 and packed_seq_params is None:  # megatron-core's own attention, untouched
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
            if attention_mask is not None:
                raise NotImplementedError("a mask beside context parallelism or packed sequences: the local spec's "
                                          "attention builds the causal (and THD) mask itself")
            if self.scale_mask_softmax.window_size is not None:
                raise NotImplementedError("sliding-window attention under context parallelism or packed sequences "
                                          "on the local spec: its mask is causal (and THD) only (run it on TE)")
            cu = None
            if packed_seq_params is not None:  # THD: [t, heads, dim], the row's boundaries
                if packed_seq_params.qkv_format != "thd":
                    raise NotImplementedError(f"qkv_format {packed_seq_params.qkv_format!r} on the local spec")
                cu = packed_seq_params.cu_seqlens_q_padded
                cu = packed_seq_params.cu_seqlens_q if cu is None else cu
                query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            mask = causal_mask(query.size(0), cp, rank, query.device, cu)
            if cp > 1:
                key, value = _GatherKV.apply(key, group), _GatherKV.apply(value, group)
            return super().forward(query, key, value, mask, attn_mask_type, attention_bias, None)

    return GatheredKVAttention


def use_gathered_kv_attention(block_spec: Any, cp: int = 1) -> Any:
    """A copy of a local-spec GPT decoder block spec whose layers' core attention (Megatron's
    DotProductAttention) is `GatheredKVAttention` (megatron-core's own arithmetic without CP and
    packed sequences); the input spec is not modified. A layer with another core attention keeps it,
    unless `cp > 1` (TypeError: only DotProductAttention has been checked against this module)."""
    import dataclasses

    from megatron.core.transformer.dot_product_attention import DotProductAttention

    replaced: dict[int, Any] = {}

    def swap(index: int, layer_spec: Any) -> Any:
        attention = getattr(layer_spec.submodules, "self_attention", None)
        core = getattr(getattr(attention, "submodules", None), "core_attention", None)
        # Plain self-attention only: MLA (DeepSeek-V3) builds its core attention with other head widths
        # (harness.compat.megatron_core's MLA core attention)
        plain = getattr(getattr(attention, "module", None), "__name__", None) == "SelfAttention"
        if core is not DotProductAttention or not plain:
            if cp > 1:
                raise TypeError(f"layer_specs[{index}]: core attention {getattr(core, '__name__', core)!r} under "
                                "context parallelism on the local spec (only DotProductAttention is replaced)")
            return layer_spec
        submodules = dataclasses.replace(attention.submodules, core_attention=attention_class())
        attention = dataclasses.replace(attention, submodules=submodules)
        return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules,
                                                                                  self_attention=attention))

    layer_specs = []
    for index, layer_spec in enumerate(block_spec.layer_specs):
        if id(layer_spec) not in replaced:
            replaced[id(layer_spec)] = swap(index, layer_spec)
        layer_specs.append(replaced[id(layer_spec)])
    return dataclasses.replace(block_spec, layer_specs=layer_specs)
