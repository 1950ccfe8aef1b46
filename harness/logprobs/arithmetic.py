"""The HF reference, arranged to round where Megatron-Core's local spec rounds.

Two correct bf16 forwards of one model differ wherever they round at different points, and in a
random-weight model one ulp anywhere grows into ~1e-2 of logprob noise at the output: as large as
the effect of a real bug (a 1% RMSNorm scale moves bf16 logprobs by 1.5e-2 on average). So the
parity check compares Megatron with an HF forward arranged to round exactly where Megatron does,
and what is left is a bug. The arrangements, each found by comparing every layer's output (tiny
models and the Qwen3-0.6B shape, CPU and H100):

1. Attention scores: Megatron's DotProductAttention scales Q.K^T inside the score GEMM (baddbmm's
   alpha, one rounding); HF's eager attention rounds Q.K^T and rounds again after the scale
   (the same only when 1/sqrt(head_dim) is a power of two: head_dim 16 yes, 128 no).
2. Linear biases: Megatron's Column/RowParallelLinear add the bias to the GEMM's rounded output;
   torch's F.linear on CUDA adds it inside the GEMM (cuBLASLt epilogue), before rounding.
3. Row-parallel layers (o_proj, down_proj) under tensor parallelism t: each rank's GEMM over its
   1/t of the input features is rounded, then the partial outputs are summed (all-reduce or, with
   sequence parallelism, reduce-scatter) in the activation dtype. The reference sums t rounded
   partials in rank order. For t <= 2 that is Megatron's arithmetic whatever order the collective
   adds in (a + b == b + a); for t > 2 the backend's ring or tree order cannot be reproduced, and
   parity there is only approximate (see `harness.parity.tolerances.regime`).
4. Mixture-of-Experts layers (megatron-core's TopKRouter and SequentialMLP, the local spec):
   - the router's logits in the activation dtype (HF's too: no `moe_router_dtype` is set by
     either bridge for Qwen3-MoE or Mixtral), the top-k taken on the logits and the softmax over
     the k chosen ones in float32, then rounded to the activation dtype (HF: a softmax over every
     expert, the top-k of it renormalised in float32: the same weights up to an ulp);
   - each expert applies its routing weight to the activation, before linear_fc2 (MLP's
     `per_token_scale`), rounded there; HF scales the expert's output after down_proj;
   - linear_fc2 under the experts' tensor parallelism e sums e rounded partial outputs per
     expert (the alltoall dispatcher's reduce-scatter, before the experts' outputs of a token are
     summed: `MoEAlltoAllTokenDispatcher.combine_preprocess`);
   - a token's experts' outputs are summed into zeros in the activation dtype in expert order
     (`unpermute`'s scatter_add, HF's index_add_: the same);
   - a router whose top-k probabilities are not renormalised (Qwen2-MoE, `norm_topk_prob=False`;
     megatron-core's `moe_router_pre_softmax=True`, what mbridge's Qwen2MoEBridge sets): the softmax
     over every expert in float32, rounded to the activation dtype, then its top k (HF takes the top k
     of the float32 softmax and rounds after: in bf16 a tie after rounding may pick another expert);
   - a shared expert (Qwen2-MoE: megatron-core's SharedExpertMLP, computed before the router with the
     stream overlap off) is the dense MLP under the dense tensor parallelism `tp` (linear_fc2's rounded
     partial sums over the TP ranks), its output times the sigmoid of its gate's logit (a [1, hidden]
     GEMM and the sigmoid, both in the activation dtype, as HF's), added to the routed experts' sum;
   - a sigmoid router with an expert-score bias (GLM-4.5-MoE, `Glm4MoeTopkRouter`; megatron-core's
     `moe_router_score_function="sigmoid"` with `moe_router_dtype="fp32"`, what mbridge's GLM4MoEBridge
     sets): the logits in float32 (the activation and the weight upcast, as HF's), their sigmoid, the top
     k of sigmoid + e_score_correction_bias, the chosen sigmoids renormalised (+1e-20) and scaled by
     routed_scaling_factor, all in float32; each expert scales its activation by that float32 weight and
     rounds (MLP's per_token_scale). GLM's shared experts (`shared_experts`, no gate) are the dense MLP
     under `tp`, added to the routed sum (HF adds them last: a + b == b + a).
5. gpt-oss (Megatron-Bridge's GPTOSSBridge on the local spec; `MegatronRoundedGptOssMoE`):
   - the norms: gpt-oss's HF RMSNorm scales in float32 and rounds once; the harness's local-spec
     RMSNorm rounds as Llama's HF norm (normalize, round, scale: harness.bridge.norms), so here the
     reference's norms are arranged to that policy (`_HfPolicyRMSNorm`), not the other way round;
   - attention sinks: megatron-core's SoftmaxOne appends each head's sink to the float32 scores
     (`attention_softmax_in_fp32`) and rounds the probabilities once; HF's eager attention appends it
     to the scores in the activation dtype and takes the softmax there (in bf16);
   - the router's logits carry its bias (an addmm in the activation dtype, as HF's F.linear); the
     softmax over the top-k logits in float32, rounded (HF: in the activation dtype);
   - an expert's linear_fc1 adds its bias to the rounded GEMM, then the clamped SwiGLU
     (gate <= 7, -7 <= up <= 7, quick_gelu(gate) * (up + 1)), times the routing weight, rounded;
     quick_gelu is a `jit_fuser` (torch.compile) function: computed in float32, rounded once;
     linear_fc2's rounded partial sums over etp, then its bias times the routing weight added
     (MLP.forward with a per-token scale); HF scales (down + bias) after the GEMM.
   - DeepSeek-V3's router (megatron-core's sigmoid router with `moe_router_dtype` fp32, which both
     bridges set, as HF's router computes): logits in float32, the sigmoid plus `e_score_correction_bias` to
     choose, the best `topk_group` groups by the sum of their top 2 (megatron-core: top topk // group_topk,
     the same where preflight lets a model through), the top k in them, the chosen sigmoid scores
     renormalised and times `routed_scaling_factor`, all in float32; each expert's routing weight
     applied in float32 to the rounded activation, rounded after (MLP's per_token_scale); an expert's
     linear_fc2 partials over the expert-TP ranks summed in float32 (the reduce-scatter runs in the
     routing weights' dtype), rounded; a token's experts' outputs summed in float32 (unpermute's
     scatter_add_ of bf16 on CPU accumulates in float32: invisible with top-2, where 0 + a + b rounds
     once either way, seen with top-4), rounded; the shared experts (`shared_experts`, no gate) the
     dense MLP under `tp`, added after the routed sum.
6. Multi-head latent attention (DeepSeek-V3): the down and up projections are column-parallel (no
   partial sums), and so is the one q_proj of a model without q LoRA (Moonlight); o_proj is row-parallel (3.).

The norms are matched the other way round: the harness's own local-spec RMSNorm rounds as HF does
(harness.bridge.norms). In float32 the arrangements change nothing measurable (~1e-7).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION = "megatron_eager"  # the attention implementation name registered with transformers

# The projections of a Llama/Qwen2/Qwen3 decoder layer, by how Megatron partitions them.
_COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                    "mlp.gate_proj", "mlp.up_proj")
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def megatron_eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float, dropout: float = 0.0, **_: object):
    """HF's eager attention with Megatron's score rounding: scale inside the score GEMM, softmax
    in float32, probabilities back in the activation dtype."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # HF's repeat_kv: each KV head serves `groups` consecutive query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    # beta=0 ignores the (uninitialized) input, as Megatron's preallocated buffer is.
    scores = torch.baddbmm(
        torch.empty((batch * heads, q_len, k_len), dtype=query.dtype, device=query.device),
        query.reshape(batch * heads, q_len, head_dim),
        key.reshape(batch * heads, k_len, head_dim).transpose(1, 2),
        beta=0.0, alpha=scaling).view(batch, heads, q_len, k_len)
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, :k_len]
    sinks = getattr(module, "sinks", None)  # gpt-oss (module docstring, 5): megatron-core's SoftmaxOne
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(batch, -1, q_len, 1)
        probs = F.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)[..., :-1].to(query.dtype)
    else:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION, megatron_eager_attention)
    AttentionMaskInterface.register(ATTENTION, eager_mask)  # the additive mask eager attention takes


class MegatronRoundedLinear(nn.Module):
    """An HF linear layer computed as Megatron computes it: bias added after the GEMM is rounded;
    with `partitions` > 1 (a row-parallel layer), the GEMM split over contiguous input-feature
    shards, each shard's output rounded, the partial outputs summed in shard (rank) order."""

    def __init__(self, linear: nn.Linear, partitions: int = 1) -> None:
        super().__init__()
        if linear.in_features % partitions:
            raise ValueError(f"{linear.in_features} input features do not split into {partitions} shards")
        self.weight = linear.weight  # the same parameters: nothing is copied for the unsplit case
        self.bias = linear.bias
        self.partitions = partitions
        width = linear.in_features // partitions
        # Contiguous copies of the shards, as each rank holds them (a strided view could take
        # another GEMM path); buffers, so that .to(device) moves them with the model.
        for r in range(partitions if partitions > 1 else 0):
            self.register_buffer(f"shard{r}", linear.weight.detach()[:, r * width:(r + 1) * width]
                                 .contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.partitions == 1:
            out = F.linear(x, self.weight)
        else:
            width = x.shape[-1] // self.partitions
            out = None
            for r in range(self.partitions):
                part = F.linear(x[..., r * width:(r + 1) * width].contiguous(), getattr(self, f"shard{r}"))
                out = part if out is None else out + part
        return out if self.bias is None else out + self.bias


class MegatronRoundedMoE(nn.Module):
    """An HF sparse MoE block (Qwen3-MoE's, Qwen2-MoE's or Mixtral's: `gate.weight`,
    `experts.gate_up_proj` [experts, 2 x width, hidden], `experts.down_proj` [experts, hidden, width];
    Qwen2-MoE's also `shared_expert` and `shared_expert_gate`) computed as megatron-core's router,
    SequentialMLP and SharedExpertMLP compute it (module docstring, 4), the experts' linear_fc2 split
    over `partitions` (the experts' tensor parallelism), the shared expert's over `tp`."""

    def __init__(self, block: nn.Module, partitions: int = 1, tp: int = 1) -> None:
        super().__init__()
        experts = block.experts
        width = experts.down_proj.shape[-1]
        if width % partitions:
            raise ValueError(f"expert width {width} does not split into {partitions} shards")
        self.gate, self.experts, self.top_k = block.gate, experts, block.gate.top_k
        self.partitions = partitions
        # HF's Qwen2-MoE router with norm_topk_prob False: the top k of the softmax, not renormalised
        # (megatron-core's pre-softmax router); Qwen3-MoE's and Mixtral's renormalise them.
        self.pre_softmax = not getattr(block.gate, "norm_topk_prob", True)
        # GLM-4.5-MoE's router: a sigmoid plus e_score_correction_bias (module docstring, 4).
        self.sigmoid_router = hasattr(block.gate, "e_score_correction_bias")
        if self.sigmoid_router and getattr(block.gate, "num_group", 1) != 1:
            raise ValueError(f"{type(block).__name__}: group-limited routing (n_group "
                             f"{block.gate.num_group}) is not arranged")
        shared = getattr(block, "shared_expert", None)
        self.shared_expert, self.shared_expert_gate = shared, getattr(block, "shared_expert_gate", None)
        if shared is None and getattr(block, "shared_experts", None) is not None:  # GLM's, ungated
            shared = self.shared_expert = block.shared_experts
        elif shared is not None:
            if not isinstance(self.shared_expert_gate, nn.Linear):
                raise TypeError(f"{type(block).__name__}: a shared expert without its nn.Linear shared_expert_gate")
        if shared is not None:
            for name, partitions_ in (("gate_proj", 1), ("up_proj", 1), ("down_proj", tp)):
                setattr(shared, name, MegatronRoundedLinear(getattr(shared, name), partitions_))

    def _expert(self, e: int, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(tokens, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
        hidden = (self.experts.act_fn(gate) * up * weights.unsqueeze(-1)).to(tokens.dtype)
        down, width = self.experts.down_proj[e], hidden.shape[-1] // self.partitions
        out = None
        for r in range(self.partitions):  # rank order; a + b == b + a for two
            part = F.linear(hidden[:, r * width:(r + 1) * width].contiguous(),
                            down[:, r * width:(r + 1) * width].contiguous())
            out = part if out is None else out + part
        return out

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        # Megatron computes the shared expert first (before the router, stream overlap off).
        shared = None if self.shared_expert is None else self._shared(tokens)
        if self.sigmoid_router:
            weights, chosen = self._sigmoid_route(tokens)
        else:
            weights, chosen = self._softmax_route(tokens)
        out = torch.zeros_like(tokens)
        for e in range(self.experts.gate_up_proj.shape[0]):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out.index_add_(0, rows, self._expert(e, tokens[rows], weights[rows, slot]))
        if shared is not None:  # MoELayer.postprocess: routed + shared
            out = out + shared
        return out.reshape(shape)

    def _sigmoid_route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron-core's sigmoid top-k with expert bias, router in float32 (module docstring, 4)."""
        gate = self.gate
        logits = F.linear(tokens.float(), gate.weight.float())
        scores = torch.sigmoid(logits)
        _, chosen = torch.topk(scores + gate.e_score_correction_bias.float(), k=self.top_k, dim=1)
        weights = torch.gather(scores, 1, chosen)
        if gate.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * gate.routed_scaling_factor, chosen

    def _softmax_route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(tokens, self.gate.weight)
        if self.pre_softmax:  # topk_routing_with_score_function, use_pre_softmax
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            weights, chosen = torch.topk(scores, k=self.top_k, dim=1)
        else:
            top, chosen = torch.topk(logits, k=self.top_k, dim=1)
            weights = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
        return weights, chosen

    def _shared(self, tokens: torch.Tensor) -> torch.Tensor:
        """SharedExpertMLP.forward: the MLP (its linears arranged in __init__), times sigmoid(gate)."""
        mlp = self.shared_expert
        hidden = mlp.act_fn(mlp.gate_proj(tokens)) * mlp.up_proj(tokens)
        if self.shared_expert_gate is None:  # GLM's shared experts: no gate
            return mlp.down_proj(hidden)
        gate = torch.sigmoid(F.linear(tokens, self.shared_expert_gate.weight))
        return mlp.down_proj(hidden) * gate


class _HfPolicyRMSNorm(nn.Module):
    """An HF RMSNorm (weight, variance_epsilon) computed as harness.bridge.norms.LocalRMSNorm does:
    normalize in float32, round to the activation dtype, scale by the weight in that dtype."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normalized = x.float()
        normalized = normalized * torch.rsqrt(normalized.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normalized.to(x.dtype)


def _quick_gelu(gate: torch.Tensor, alpha: float) -> torch.Tensor:
    """megatron-core's quick_gelu as it runs: a `jit_fuser` function, torch.compile on torch >= 2.2,
    whose fused kernel computes y * sigmoid(1.702 y) in float32 and rounds once."""
    wide = gate.float()
    return (wide * torch.sigmoid(alpha * wide)).to(gate.dtype)


class MegatronRoundedGptOssMoE(nn.Module):
    """HF's GptOssMLP (`router` with a bias; `experts.gate_up_proj` [experts, hidden, 2 x width] with
    gate and up interleaved, `experts.down_proj` [experts, width, hidden], both with biases; the clamped
    SwiGLU) computed as megatron-core's TopKRouter and SequentialMLP compute it under Megatron-Bridge's
    GPTOSSBridge (module docstring, 5), linear_fc2 split over `partitions` (etp). Returns HF's
    (hidden_states, router scores) pair, the scores unused (None)."""

    def __init__(self, block: nn.Module, partitions: int = 1) -> None:
        super().__init__()
        experts = block.experts
        width = experts.down_proj.shape[1]
        if width % partitions:
            raise ValueError(f"expert width {width} does not split into {partitions} shards")
        self.router, self.experts, self.top_k = block.router, experts, block.router.top_k
        self.partitions = partitions
        self.limit, self.alpha = float(experts.limit), float(experts.alpha)

    def _expert(self, e: int, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ex = self.experts
        # Megatron's linear_fc1 holds the gate rows, then the up rows (the bridge de-interleaves HF's).
        fc1 = torch.cat([ex.gate_up_proj[e][:, ::2], ex.gate_up_proj[e][:, 1::2]], dim=1).t().contiguous()
        bias1 = torch.cat([ex.gate_up_proj_bias[e][::2], ex.gate_up_proj_bias[e][1::2]])
        gate, up = (F.linear(tokens, fc1) + bias1).chunk(2, dim=-1)
        gate, up = gate.clamp(min=None, max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        scale = weights.unsqueeze(-1)
        hidden = (_quick_gelu(gate, self.alpha) * (up + 1.0) * scale).to(tokens.dtype)
        down, width = ex.down_proj[e].t().contiguous(), hidden.shape[-1] // self.partitions
        out = None
        for r in range(self.partitions):  # rank order; a + b == b + a for two
            part = F.linear(hidden[:, r * width:(r + 1) * width].contiguous(),
                            down[:, r * width:(r + 1) * width].contiguous())
            out = part if out is None else out + part
        return out + ex.down_proj_bias[e] * scale

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        logits = F.linear(tokens, self.router.weight, self.router.bias)
        top, chosen = torch.topk(logits, k=self.top_k, dim=1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32).type_as(logits)
        out = torch.zeros_like(tokens)
        for e in range(self.experts.gate_up_proj.shape[0]):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out.index_add_(0, rows, self._expert(e, tokens[rows], weights[rows, slot]))
        return out.reshape(shape), None


def _is_gpt_oss_block(mlp: nn.Module) -> bool:
    experts = getattr(mlp, "experts", None)
    return hasattr(getattr(mlp, "router", None), "top_k") and hasattr(experts, "gate_up_proj_bias")


class MegatronRoundedDeepseekMoE(MegatronRoundedMoE):
    """HF's DeepseekV3MoE (a sigmoid router with `e_score_correction_bias`, group-limited top-k,
    renormalised and scaled; `shared_experts` without a gate) as megatron-core computes it (module
    docstring, 4)."""

    def __init__(self, block: nn.Module, partitions: int = 1, tp: int = 1) -> None:
        nn.Module.__init__(self)
        experts = block.experts
        width = experts.down_proj.shape[-1]
        if width % partitions:
            raise ValueError(f"expert width {width} does not split into {partitions} shards")
        # The router's settings: on the gate (transformers >= 5.23's DeepseekV3TopkRouter), or on the MoE block
        # (5.12's, which routes in `route_tokens_to_experts`; stack B's transformers).
        router = block.gate if hasattr(block.gate, "top_k") else block
        self.gate, self.experts, self.top_k, self.partitions = block.gate, experts, router.top_k, partitions
        self.groups = getattr(router, "num_group", None) or router.n_group
        self.topk_group, self.routed_scaling_factor = router.topk_group, router.routed_scaling_factor
        self.shared_experts = block.shared_experts
        for name, partitions_ in (("gate_proj", 1), ("up_proj", 1), ("down_proj", tp)):
            setattr(self.shared_experts, name, MegatronRoundedLinear(getattr(self.shared_experts, name), partitions_))

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron-core's topk_routing_with_score_function (sigmoid, expert bias, group_limited_topk) in
        float32: the routing weights [tokens, k] (float32) and the chosen experts."""
        gate = self.gate
        logits = F.linear(tokens.float(), gate.weight.float())
        scores = torch.sigmoid(logits)
        choice = scores + gate.e_score_correction_bias
        experts, groups = choice.shape[-1], self.groups
        if self.topk_group and groups > 1:
            group_scores = choice.view(-1, groups, experts // groups).topk(self.top_k // self.topk_group, dim=-1)[0].sum(-1)
            chosen_groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores).scatter_(1, chosen_groups, 1)
            mask = mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
            choice = choice.masked_fill(~mask.bool(), float("-inf"))
        chosen = torch.topk(choice, k=self.top_k, dim=-1)[1]
        weights = torch.gather(scores, 1, chosen)
        if self.top_k > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, chosen

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])
        mlp = self.shared_experts  # SharedExpertMLP, computed before the router (no stream overlap)
        shared = mlp.down_proj(mlp.act_fn(mlp.gate_proj(tokens)) * mlp.up_proj(tokens))
        weights, chosen = self.route(tokens)
        # A token's experts' outputs scattered into its row in expert order (unpermute's scatter_add_:
        # on CPU it accumulates bf16 in float32, which top-4 shows and top-2 cannot), rounded.
        out = torch.zeros_like(tokens, dtype=torch.float32)
        for e in range(self.experts.gate_up_proj.shape[0]):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out.index_add_(0, rows, self._expert(e, tokens[rows], weights[rows, slot]).float())
        return (out.to(tokens.dtype) + shared).reshape(shape)

    def _expert(self, e: int, tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Expert `e`'s output: its linear_fc2 partials over the expert-TP ranks, each rounded, summed in
        float32, the routing weights' dtype (the alltoall dispatcher's reduce-scatter, before unpermute),
        rounded."""
        gate, up = F.linear(tokens, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
        hidden = (self.experts.act_fn(gate) * up * weights.unsqueeze(-1)).to(tokens.dtype)
        down, width = self.experts.down_proj[e], hidden.shape[-1] // self.partitions
        if self.partitions == 1:
            return F.linear(hidden, down)
        out = None
        for r in range(self.partitions):
            part = F.linear(hidden[:, r * width:(r + 1) * width].contiguous(),
                            down[:, r * width:(r + 1) * width].contiguous()).float()
            out = part if out is None else out + part
        return out.to(tokens.dtype)


# Multi-head latent attention's projections (DeepSeek-V3), by how Megatron partitions them; a model without
# q LoRA (q_lora_rank None: Moonlight) has one q_proj for the first two (megatron-core's linear_q_proj, also
# column-parallel).
_MLA_COLUMN_PARALLEL = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                        "self_attn.kv_b_proj")
_MLA_PLAIN_QUERY_COLUMN_PARALLEL = ("self_attn.q_proj",) + _MLA_COLUMN_PARALLEL[2:]


def _mla_column_parallel(attention: nn.Module) -> tuple[str, ...]:
    return _MLA_PLAIN_QUERY_COLUMN_PARALLEL if attention.q_lora_rank is None else _MLA_COLUMN_PARALLEL


def _is_sparse_block(mlp: nn.Module) -> bool:
    experts = getattr(mlp, "experts", None)
    deepseek_5_12 = type(mlp).__name__ == "DeepseekV3MoE" and hasattr(mlp, "top_k")  # its router's settings on the block
    return ((hasattr(getattr(mlp, "gate", None), "top_k") or deepseek_5_12) and hasattr(experts, "gate_up_proj")) \
        or _is_gpt_oss_block(mlp)


def arrange_like_megatron(model: nn.Module, *, tp: int = 1, expert_tp: int | None = None) -> nn.Module:
    """Arrange an HF Llama/Qwen2/Qwen3 (or Qwen3-MoE/Qwen2-MoE/Mixtral) causal LM (in place) to round where
    Megatron's local spec does under tensor parallelism `tp` and the experts' tensor parallelism
    `expert_tp` (default `tp`) (see the module docstring). Returns the model."""
    expert_tp = tp if expert_tp is None else expert_tp
    if tp < 1 or expert_tp < 1:
        raise ValueError(f"tp and expert_tp must be >= 1, got {tp} and {expert_tp}")
    _register_attention()
    model.set_attn_implementation(ATTENTION)
    layers = model.model.layers
    if getattr(model.config, "model_type", None) == "gpt_oss":  # module docstring, 5: the norms
        model.model.norm = _HfPolicyRMSNorm(model.model.norm)
        for layer in layers:
            layer.input_layernorm = _HfPolicyRMSNorm(layer.input_layernorm)
            layer.post_attention_layernorm = _HfPolicyRMSNorm(layer.post_attention_layernorm)
    for layer in layers:
        sparse = getattr(layer, "mlp", None)
        sparse = sparse if sparse is not None and _is_sparse_block(sparse) else None
        if sparse is not None:
            deepseek = type(sparse).__name__.startswith("DeepseekV3")  # GLM-4.5-MoE: MegatronRoundedMoE
            layer.mlp = (MegatronRoundedGptOssMoE(sparse, expert_tp) if _is_gpt_oss_block(sparse)
                         else MegatronRoundedDeepseekMoE(sparse, expert_tp, tp) if deepseek
                         else MegatronRoundedMoE(sparse, expert_tp, tp))
        mla = hasattr(layer.self_attn, "kv_a_proj_with_mqa")
        column = (_mla_column_parallel(layer.self_attn) + _COLUMN_PARALLEL[3:]) if mla else _COLUMN_PARALLEL
        for path, partitions in [(p, 1) for p in column] + [(p, tp) for p in _ROW_PARALLEL]:
            if sparse is not None and path.startswith("mlp."):
                continue
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            linear = getattr(parent, name, None)
            if not isinstance(linear, nn.Linear):
                raise TypeError(f"{type(model).__name__}: expected an nn.Linear at layers.N.{path}, "
                                f"found {type(linear).__name__}")
            setattr(parent, name, MegatronRoundedLinear(linear, partitions))
    model.harness_arranged_tp = tp
    return model
