"""The weight-sync check's bounds (harness.rollout.check), by dtype, each with its origin.

Weights and the re-sync invariants are exact: a sync copies bits, so one differing tensor is a bug.
The engine's logprobs of its own samples against the trainer's are two arithmetics of the same
weights: the HF engine decodes token by token with a KV cache in eager HF, the trainer runs
Megatron's full forward; vLLM (CPU tier) runs its own kernels (oneDNN GEMMs, paged attention). fp32: the parity suite's fp32 bounds (the same math, only summation order
differs). bf16: the engine rounds like plain HF, not like Megatron (the parity suite's approximate
regime), so the bounds are measured ones.
"""
from __future__ import annotations

from harness.evidence import CPU_ROLLOUT, CPU_VLLM, H200X2_RL, cite
from harness.tolerance import Tolerance, ToleranceTable


def _evidence(metric: str, dtype: str, hf: float, vllm: float, gpu: float, digits: int = 2):
    """The rollout suite's rows of the fixed path (no variant): the HF engine's CPU run, the vLLM
    engine's CPU run, the HF engine's 2x H200 run."""
    return cite((("suite", "rollout"), ("metric", metric), ("dtype", dtype), ("extra.variant", None)),
                {CPU_ROLLOUT: hf, CPU_VLLM: vllm, H200X2_RL: gpu}, digits=digits)


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
              "the worst measured", evidence=_evidence("max_abs", "fp32", 2.9e-6, 2.4e-6, 1.9e-6)),
    Tolerance("mean_abs", "fp32", 2e-6, rationale="the parity suite's fp32 bound; 3.7x the worst measured",
              evidence=_evidence("mean_abs", "fp32", 5.1e-7, 5.4e-7, 5.4e-7)),
    Tolerance("token_mult_prob_error", "fp32", 1 + 1e-5, ideal=1.0, rationale="the parity suite's fp32 "
              "bound, derived from max_abs", derived_from=("max_abs",)),
    Tolerance("max_abs", "bf16", 0.2, rationale="the parity suite's approximate-regime bound (plain HF "
              "against Megatron in bf16: tp2's partial sums round differently); 5x the worst measured "
              "(vLLM's bf16 kernels)", evidence=_evidence("max_abs", "bf16", 0.033, 0.040, 0.032)),
    Tolerance("mean_abs", "bf16", 0.04, rationale="the parity suite's approximate-regime bound; 3.6x the "
              "worst measured (vLLM)", evidence=_evidence("mean_abs", "bf16", 0.0096, 0.011, 0.0073)),
    Tolerance("token_mult_prob_error", "bf16", 1.05, ideal=1.0, rationale="NeMo-RL's bound between "
              "generation and training logprobs, the parity suite's approximate one; 4.4x the worst "
              "measured distance from 1 (vLLM)",
              evidence=_evidence("token_mult_prob_error", "bf16", 1.0097, 1.0113, 1.0073, 5)),
)

TABLE = ToleranceTable("weight-sync", _TABLE)


def sync_tolerance(metric: str, dtype: str) -> Tolerance:
    return TABLE.get(metric, dtype)
