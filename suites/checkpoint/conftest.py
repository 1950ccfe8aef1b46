"""Shared pieces of the checkpoint suites: the policy config, the batches and the source checkpoints."""
from __future__ import annotations

import pytest

from harness.models import TINY_VOCAB_SIZE
from harness.training import make_rl_train_batch

MODEL = "tiny-qwen3-kv4"  # 4 KV heads: every layout of 4 GPUs (TP4 included) is valid
CONFIG = dict(lr=1e-3, weight_decay=0.01, clip_grad=1.0, eps=1e-6, micro_batches=2,
              loss_kwargs=dict(kl_coef=0.05, clip_eps_high=0.28))
K_STEPS = 2


def train_batch(step: int):
    """The global batch of a step: the same whatever the layout (8 rows: 2 micro-batches at dp4)."""
    return make_rl_train_batch(TINY_VOCAB_SIZE, batch_size=8, seed=100 + step,
                               prompt_lengths=[5, 3, 7, 1, 10, 2, 12, 4],
                               response_lengths=[19, 9, 10, 23, 4, 13, 1, 16])


class SourceCheckpoint:
    """A saved source and what it did next without stopping: the step and the weights after it."""

    def __init__(self, directory, next_step, next_state, manifest):
        self.directory, self.next_step, self.next_state, self.manifest = directory, next_step, next_state, manifest


@pytest.fixture(scope="session")
def _sources():
    return {}


@pytest.fixture
def source_checkpoint(policy, device, tmp_path_factory, _sources):
    """`source_checkpoint(layout)`: K steps at `layout`, saved; plus the step after it and the
    weights after that step, without any save/load. Made once per (device, layout) per session."""

    def make(layout: str) -> SourceCheckpoint:
        if (device, layout) not in _sources:
            directory = tmp_path_factory.mktemp(f"src-{device}-{layout}") / "ckpt"
            source = policy(layout, MODEL, **CONFIG)
            source.steps([train_batch(i) for i in range(K_STEPS)])
            manifest = source.save(directory)
            next_step = source.step(train_batch(K_STEPS))
            next_state = source.hf_state_dict()
            source.close()
            _sources[(device, layout)] = SourceCheckpoint(directory, next_step, next_state, manifest)
        return _sources[(device, layout)]

    return make
