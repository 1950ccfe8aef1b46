"""Tiny verifiable tasks made in code: prompts, and a reward computed from the sampled tokens.

`parity`: the prompt ends in an instruction token, EVEN (1) or ODD (2); the reward of a completion
is the share of its tokens with the asked parity. A random model scores ~0.5, one that follows the
instruction 1.0. By default every prompt asks for EVEN: a dense signal GRPO turns into a rising
reward on a tiny random model within 8 steps (suites/rl states the measured figures). `mixed=True`
alternates EVEN and ODD: the model must then read the instruction, which a tiny random model did
not learn within 8 steps at lr 1e-2 (measured on CPU: rewards 0.58 -> 0.53).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


EVEN, ODD = 1, 2  # the instruction tokens


@dataclass(frozen=True)
class ParityTask:
    vocab_size: int
    prompts_per_step: int = 4
    prompt_length: int = 4
    seed: int = 0
    mixed: bool = False  # alternate EVEN and ODD instructions (harder: see the module docstring)
    name: str = "parity"

    def __post_init__(self) -> None:
        if self.vocab_size < 4 or self.prompts_per_step < 1 or self.prompt_length < 1:
            raise ValueError("parity task: vocab_size >= 4, prompts_per_step >= 1, prompt_length >= 1")

    def prompts(self, step: int) -> list[list[int]]:
        """The step's prompts: random tokens (>= 1: 0 pads), then the instruction."""
        g = torch.Generator().manual_seed(self.seed * 100_003 + step)
        rows = torch.randint(1, self.vocab_size, (self.prompts_per_step, self.prompt_length), generator=g)
        odd = (torch.arange(self.prompts_per_step) % 2 == 1) & self.mixed
        rows[:, -1] = torch.where(odd, ODD, EVEN)
        return rows.tolist()

    def rewards(self, prompts: list[list[int]], prompt_index: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
        """float32 [rows]: the share of each completion's tokens with the parity its prompt asks for."""
        asked = torch.tensor([0 if p[-1] == EVEN else 1 for p in prompts])[prompt_index].unsqueeze(1)
        return (completions % 2 == asked).float().mean(dim=1)


TASKS = {"parity": ParityTask}


def make_task(name: str, vocab_size: int, **kwargs) -> ParityTask:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    return TASKS[name](vocab_size, **kwargs)
