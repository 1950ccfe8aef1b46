"""What the checkpoint suites share (not tests, not fixtures): the policy config and the batches."""
from __future__ import annotations

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
