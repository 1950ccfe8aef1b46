"""Logprob parity metrics between a reference (HF) and a candidate (Megatron) backend.

All metrics run in float64 over the tokens selected by a bool mask (normally the response mask),
so the metric itself adds no rounding at the 1e-7 scale fp32 parity lives at.
"""
from __future__ import annotations

import torch


def _masked_delta(reference: torch.Tensor, candidate: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """candidate - reference at the masked tokens, float64 1-D."""
    if reference.shape != candidate.shape or reference.shape != mask.shape:
        raise ValueError(f"shape mismatch: reference {tuple(reference.shape)}, candidate "
                         f"{tuple(candidate.shape)}, mask {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    if not bool(mask.any()):
        raise ValueError("mask selects no tokens: nothing to compare")
    mask = mask.to(reference.device)
    return candidate.to(reference.device, torch.float64)[mask] - reference.double()[mask]


def compare_logprobs(reference: torch.Tensor, candidate: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, float]:
    """Per-token logprob agreement over ``mask``.

    Returns
      max_abs: max |candidate - reference|.
      mean_abs: mean |candidate - reference|.
      token_mult_prob_error: mean exp(|candidate - reference|), NeMo-RL's name and formula;
        1.0 is perfect, 1.01 means token probabilities differ by ~1% on average.
      kl_k3: mean of the k3 estimator exp(r) - 1 - r with r = candidate - reference. With tokens
        sampled from the reference policy this is an unbiased, non-negative estimate of
        KL(reference || candidate) restricted to the given tokens; for other tokens (e.g. random
        ones) it is still a non-negative divergence score, ~mean(r**2)/2 for small r.
      tokens: number of compared tokens.
    A NaN anywhere in the masked values propagates into every metric, so it fails any limit.
    """
    delta = _masked_delta(reference, candidate, mask)
    abs_delta = delta.abs()
    return {
        "max_abs": float(abs_delta.max()),
        "mean_abs": float(abs_delta.mean()),
        "token_mult_prob_error": float(abs_delta.exp().mean()),
        # expm1 keeps k3 exact-ish for r ~ 1e-6, where exp(r) - 1 would cancel to noise.
        "kl_k3": float((torch.expm1(delta) - delta).mean()),
        "tokens": int(delta.numel()),
    }


def top1_agreement(ref_ids: torch.Tensor, cand_ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Fraction of masked tokens where both backends predict the same argmax token."""
    if ref_ids.shape != cand_ids.shape or ref_ids.shape != mask.shape:
        raise ValueError(f"shape mismatch: ref_ids {tuple(ref_ids.shape)}, cand_ids "
                         f"{tuple(cand_ids.shape)}, mask {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    if not bool(mask.any()):
        raise ValueError("mask selects no tokens: nothing to compare")
    mask = mask.to(ref_ids.device)
    same = ref_ids[mask] == cand_ids.to(ref_ids.device)[mask]
    return float(same.double().mean())
