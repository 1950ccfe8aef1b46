"""The logprob's kernel under megatron-core's batch-invariant switch (the exact tier, issue 35): at tp 1 with
the switch on, a token's logprob is `log_softmax`'s over the true vocabulary (one of the switch's fixed-order
kernels), not megatron-core's vocab-parallel cross entropy (torch max/sum reductions the switch does not
patch). With the switch off every other logprob test holds the cross entropy's path. Whether that removes the one-ulp residue of
Megatron's batch invariance at 4 rows is the GPU tier's measurement (suites/rollout/test_exact.py)."""
from __future__ import annotations

import pytest
import torch

from harness.backends import batch_invariant
from harness.logprobs import vocab_parallel


@pytest.fixture
def tp1(monkeypatch):
    """One tensor-parallel rank without a process group (megatron-core's TP group of one)."""
    monkeypatch.setattr(vocab_parallel, "_tp_size", lambda: 1)
    monkeypatch.setattr(vocab_parallel, "_tp", lambda: (None, 0))


def test_at_tp1_with_the_switch_on_a_logprob_is_log_softmax_over_the_true_vocabulary(tp1, monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 131, generator=g) * 4
    targets = torch.randint(0, 120, (3, 5), generator=g)
    monkeypatch.setattr(batch_invariant, "active", lambda: True)
    got = vocab_parallel.vocab_parallel_logprobs(logits.clone(), targets, true_vocab=120)
    masked = logits.masked_fill(torch.arange(131) >= 120, vocab_parallel._MASKED_LOGIT)
    assert torch.equal(got, torch.log_softmax(masked, -1).gather(-1, targets[..., None]).squeeze(-1))
    over_padded_vocab = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)
    assert not torch.allclose(got, over_padded_vocab)  # the padding columns are out of the partition function


def test_the_switch_is_off_outside_its_context():
    assert batch_invariant.active() is False
