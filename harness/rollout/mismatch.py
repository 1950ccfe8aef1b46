"""Train-inference mismatch: the rollout engine's logprobs of the tokens it sampled against the
trainer's recomputation of the same tokens (Megatron, any layout), as RL frameworks measure it.

    result = measure_mismatch(policy, engine, prompts, Sampling(n=4, max_tokens=16, temperature=1.0))
    result.metrics  # mean_abs, max_abs, p99_abs, token_mult_prob_error, kl_k3, frac_over_ln2, tokens

With r = trainer - engine per sampled token (tokens drawn by the engine):
- `mean_abs`, `max_abs`, `p99_abs`: |r| over the sampled tokens (slime gates mean |r| <= 0.1);
- `token_mult_prob_error`: mean exp(|r|), NeMo-RL's CI gate (< 1.05; measured 1.01-1.03 for vLLM vs
  Megatron, ../shared/notes/mismatch-anchors.md);
- `kl_k3`: mean of exp(r) - 1 - r, the k3 estimate of KL(engine || trainer) from the engine's samples
  (the figure the R3 paper and verl's rollout-correction metrics report);
- `frac_over_ln2`: the fraction of tokens whose probability differs by more than a factor of 2
  (|r| > ln 2): IcePop's and MIS's masking threshold region.
The temperature is applied on both sides (the engine reports processed logprobs, the trainer divides
its logits by the same temperature); greedy decoding compares the plain distributions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from harness.rollout.engine import Rollouts, Sampling

METRICS = ("mean_abs", "max_abs", "p99_abs", "token_mult_prob_error", "kl_k3", "frac_over_ln2")
LN2 = math.log(2.0)


def mismatch_metrics(engine: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The metrics above over the masked (sampled) tokens; a NaN anywhere propagates to every one.
    The parity suite's compare_logprobs with the engine as reference, plus p99 and frac_over_ln2."""
    from harness.parity.metrics import _masked_delta, compare_logprobs

    mask = mask.bool()
    metrics = compare_logprobs(engine, trainer, mask)
    a = _masked_delta(engine, trainer, mask).abs()
    metrics["p99_abs"] = float(torch.quantile(a, 0.99)) if a.numel() > 1 else float(a.max())
    metrics["frac_over_ln2"] = float((a > LN2).double().mean())
    return metrics


@dataclass
class Mismatch:
    """One measurement: the metrics, and what produced them (for the report row's dimensions)."""

    metrics: dict[str, float]
    sampling: Sampling
    rollouts: Rollouts
    trainer: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def decoding(self) -> str:
        return "greedy" if self.sampling.greedy else f"t{self.sampling.temperature:g}"


def measure_mismatch(policy, engine, prompts: Sequence[Sequence[int]], sampling: Sampling,
                     *, trainer_temperature: float | None = None) -> Mismatch:
    """The engine samples; the policy recomputes the sampled tokens' logprobs at the same temperature
    (`trainer_temperature` overrides it: the catalog's logprobs-before-temperature control)."""
    rollouts = engine.generate(prompts, sampling)
    temperature = sampling.logprob_temperature if trainer_temperature is None else trainer_temperature
    trainer = policy.logprobs(rollouts.batch, temperature=temperature)
    metrics = mismatch_metrics(rollouts.logprobs, trainer, rollouts.batch.response_mask)
    return Mismatch(metrics, sampling, rollouts, trainer)
