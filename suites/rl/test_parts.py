"""The loop's small parts on their own: the task's prompts and rewards, GRPO's advantages, the
loop's refusals of bad settings."""
from __future__ import annotations

import pytest
import torch

from harness.rl import LoopConfig, ParityTask, group_advantages, make_task
from harness.rl.task import EVEN, ODD


def test_the_parity_task_rewards_the_share_of_tokens_with_the_asked_parity():
    task = ParityTask(251, prompts_per_step=2, mixed=True)
    prompts = task.prompts(0)
    assert [p[-1] for p in prompts] == [EVEN, ODD] and all(0 < t < 251 for p in prompts for t in p)
    assert task.prompts(0) == prompts and task.prompts(1) != prompts  # seeded per step
    completions = torch.tensor([[2, 4, 5, 7], [1, 3, 4, 6]])
    rewards = task.rewards(prompts, torch.tensor([0, 1]), completions)
    assert rewards.tolist() == [0.5, 0.5]
    assert task.rewards(prompts, torch.tensor([1, 0]), completions).tolist() == [0.5, 0.5]
    assert task.rewards(prompts, torch.tensor([0, 0]), torch.tensor([[2, 4, 6, 8], [1, 3, 5, 7]])).tolist() == [1.0, 0.0]
    assert all(p[-1] == EVEN for p in ParityTask(251, prompts_per_step=4).prompts(3))


def test_group_advantages_are_normalized_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.25, 0.75])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = group_advantages(rewards, groups)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, -1.0, 1.0]), atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(iterations=0), "iterations must be a positive integer"),
    (dict(group_size=1), "group_size must be >= 2"),
    (dict(dtype="fp16"), "dtype must be fp32 or bf16"),
    (dict(lr=0.0), "lr must be > 0"),
    (dict(temperature=0.8), "temperature must be 1.0"),  # the step's logprobs are at temperature 1
])
def test_bad_loop_settings_are_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoopConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown task"):
        make_task("chess", 251)
