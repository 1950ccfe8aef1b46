"""The weight-sync check's bounds (harness.rollout.check), by dtype, each with its origin.

Weights and the re-sync invariants are exact: a sync copies bits, so one differing tensor is a bug.
The engine's logprobs of its own samples against the trainer's are two arithmetics of the same
weights: the HF engine decodes token by token with a KV cache in eager HF, the trainer runs
Megatron's full forward. fp32: the parity suite's fp32 bounds (the same math, only summation order
differs). bf16: the engine rounds like plain HF, not like Megatron (the parity suite's approximate
regime), so the bounds are measured ones.
"""
from __future__ import annotations

from harness.tolerance import Tolerance, ToleranceTable

EXACT = {
    "unequal_tensors": "after a sync every engine tensor equals the policy's export bit for bit",
    "engine_max_abs_diff": "the largest |difference| between the engine's and the policy's weights",
    "resync_changed_tensors": "a sync with no step in between changes no engine weight",
    "resync_changed_rollouts": "... and no sampled token or engine logprob",
}

_TABLE: tuple[Tolerance, ...] = tuple(
    Tolerance(metric, dtype, 0.0, rationale=f"exact: {why}") for dtype in ("fp32", "bf16")
    for metric, why in EXACT.items()) + (
    Tolerance("max_abs", "fp32", 1e-5, rationale="the parity suite's fp32 bound (the same math)"),
    Tolerance("mean_abs", "fp32", 2e-6, rationale="the parity suite's fp32 bound"),
    Tolerance("token_mult_prob_error", "fp32", 1 + 1e-5, ideal=1.0, rationale="the parity suite's fp32 bound"),
    Tolerance("max_abs", "bf16", 0.2, rationale="PROVISIONAL"),
    Tolerance("mean_abs", "bf16", 0.04, rationale="PROVISIONAL"),
    Tolerance("token_mult_prob_error", "bf16", 1.05, ideal=1.0, rationale="PROVISIONAL"),
)

TABLE = ToleranceTable("weight-sync", _TABLE)


def sync_tolerance(metric: str, dtype: str) -> Tolerance:
    return TABLE.get(metric, dtype)
