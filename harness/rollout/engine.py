"""What a rollout engine is to the harness: generate with logprobs, take new weights, sleep/wake.

Every engine (the HF reference engine here, vLLM behind the same methods) returns a `Rollouts`:
the prompts' rows with the sampled completions appended, as an `RLBatch` whose response mask marks
the sampled tokens, and the engine's own logprob of each sampled token (0 elsewhere, the project
convention). Weight updates arrive as buckets of (HF name, tensor); a bucket may carry a fused
`gate_up_proj` (gate rows first, as vLLM packs it), which the engine splits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence

import torch

from harness.data.rl_batch import RLBatch

# A fused MLP input projection: gate rows then up rows (vLLM's MergedColumnParallelLinear order).
FUSED_GATE_UP = "gate_up_proj"


@dataclass(frozen=True)
class Sampling:
    """How to sample: `n` completions per prompt of exactly `max_tokens` tokens (no early stop:
    equal lengths keep every row's response the same size), at `temperature`, from `seed`.
    `temperature=0` is greedy decoding (the argmax; its logprob under the plain distribution)."""

    n: int = 1
    max_tokens: int = 4
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.n, int) and self.n >= 1):
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """What the logits are divided by for the reported logprobs: the temperature, 1 when greedy."""
        return 1.0 if self.greedy else float(self.temperature)


@dataclass
class Rollouts:
    """`batch`: prompt (left-padded) + completion rows, n consecutive rows per prompt;
    `logprobs`: float32 [B, S], the engine's logprob of each sampled token (0 elsewhere);
    `prompt_index`: int64 [B], which prompt each row continues; `routing`: a MoE engine's top-k
    experts per token [B, S, L, K] by global layer, when asked for (harness.rollout.routing)."""

    batch: RLBatch
    logprobs: torch.Tensor
    prompt_index: torch.Tensor
    routing: torch.Tensor | None = None

    @property
    def completions(self) -> torch.Tensor:
        """[B, max_tokens] the sampled token ids."""
        width = int(self.batch.response_mask[0].sum())
        return self.batch.input_ids[:, -width:]


class RolloutEngine(Protocol):
    """The methods the harness needs from an inference engine."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, *, routing: bool = False) -> Rollouts:
        """routing=True (a MoE model; vLLM: an engine opened with routing=True): `Rollouts.routing`
        holds the route of every token the engine fed, by global layer (harness.rollout.routing)."""

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy one bucket of (HF name, tensor) into the engine; returns the tensors taken."""

    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights by HF checkpoint name (what `update_weights` writes)."""

    def sleep(self) -> None:
        """Give the device memory back (colocation: the trainer runs meanwhile)."""

    def wake(self) -> None: ...


class EngineAsleep(RuntimeError):
    """The engine was asked to generate or take weights while asleep."""


def prompt_rows(prompts: Sequence[Sequence[int]], n: int, vocab_size: int, pad_id: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt rows, each prompt n times in a row: (ids, mask, prompt index)."""
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise ValueError("need at least one prompt, and no empty prompt")
    bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab_size})
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    width = max(len(p) for p in prompts)
    rows = [p for p in prompts for _ in range(n)]
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for r, p in enumerate(rows):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = True
    index = torch.arange(len(prompts)).repeat_interleave(n)
    return ids, mask, index


def make_rollouts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, index: torch.Tensor,
                  tokens: torch.Tensor, logprobs: torch.Tensor, pad_id: int) -> Rollouts:
    """Prompt rows + sampled tokens [B, T] and their logprobs [B, T] as `Rollouts`."""
    ones = torch.ones_like(tokens, dtype=torch.bool)
    batch = RLBatch(input_ids=torch.cat([prompt_ids, tokens], 1),
                    attention_mask=torch.cat([prompt_mask, ones], 1),
                    response_mask=torch.cat([torch.zeros_like(prompt_mask), ones], 1),
                    pad_id=pad_id)
    full = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    full[:, prompt_ids.shape[1]:] = logprobs
    return Rollouts(batch, full, index)


def unfuse(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A fused gate_up_proj split into gate_proj and up_proj (gate rows first); anything else as is."""
    if f".{FUSED_GATE_UP}." not in name:
        return [(name, tensor)]
    gate, up = tensor.chunk(2, dim=0)
    return [(name.replace(FUSED_GATE_UP, "gate_proj"), gate), (name.replace(FUSED_GATE_UP, "up_proj"), up)]


def bucket_plan(bucket: Iterable[tuple[str, torch.Tensor]], shapes: Mapping[str, Any]
                ) -> list[tuple[str, torch.Tensor]]:
    """The bucket's (HF name, tensor) pairs with a fused gate_up split, after checking every name and
    shape against the engine's (`shapes`: name -> shape): a bad bucket raises before any is taken."""
    plan = [pair for name, tensor in bucket for pair in unfuse(name, tensor)]
    for name, tensor in plan:
        if name not in shapes:
            raise KeyError(f"the engine has no weight {name!r}")
        if tuple(shapes[name]) != tuple(tensor.shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} sent, the engine holds {tuple(shapes[name])}")
    return plan


def require_awake(engine: Any, what: str) -> None:
    if engine.asleep:
        raise EngineAsleep(f"{what} while the engine sleeps: call wake() first")
