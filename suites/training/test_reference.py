"""The frozen reference worker gives the HF logprobs (fp32) under every layout, with no gradient
state, so old/ref logprobs in RL steps are the ones the parity suite vouches for."""
from __future__ import annotations

import pytest
import torch

from harness.logprobs import hf_logprobs
from harness.logprobs.megatron import assemble
from harness.models import TINY_VOCAB_SIZE, build_hf_model, resolve_model
from harness.parallel.state import run_in_layout
from harness.parity.metrics import compare_logprobs
from harness.parity.tolerances import tolerance
from harness.training import make_rl_train_batch
from harness.training.reference import ReferenceWorker, reference_logprobs


def _frozen(layout, path) -> bool:
    worker = ReferenceWorker(path)
    return not any(p.requires_grad for m in worker.models for p in m.parameters())


@pytest.mark.world_size(2)
@pytest.mark.layouts(cpu=["tp2", "pp2"], cuda=["tp2", "pp2"])
def test_reference_logprobs_equal_hf(world, device, layout, report):
    tb = make_rl_train_batch(TINY_VOCAB_SIZE, batch_size=4, seed=5, prompt_lengths=[3, 6, 2, 8],
                             response_lengths=[9, 5, 12, 4])
    path = resolve_model("tiny-qwen3")
    megatron, _ = assemble(run_in_layout(world, layout, reference_logprobs, path, tb.batch, 2))
    with torch.no_grad():
        reference = hf_logprobs(build_hf_model(path), tb.batch)
    metrics = compare_logprobs(reference, megatron, tb.loss_mask())
    limit = tolerance("max_abs", "fp32").limit
    report.add("max_abs", metrics["max_abs"], tolerance=limit, passed=metrics["max_abs"] <= limit, claim="bounded",
               layout=layout, model="tiny-qwen3", dtype="fp32")
    assert metrics["max_abs"] <= limit
    assert run_in_layout(world, layout, _frozen, path) == [True, True]
