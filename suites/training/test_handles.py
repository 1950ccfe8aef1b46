"""The worker fixtures: resident policy/reference workers that keep their state between calls,
reject bad input before any rank builds anything, and are freed when closed."""
from __future__ import annotations

import pytest
import torch

from harness.logprobs import hf_logprobs
from harness.models import TINY_VOCAB_SIZE, build_hf_model
from harness.parallel.layout import LayoutError
from harness.parity.metrics import compare_logprobs
from harness.parity.tolerances import tolerance
from harness.training import make_rl_train_batch
from harness.training import handles


def _batch(seed=3):
    return make_rl_train_batch(TINY_VOCAB_SIZE, batch_size=4, seed=seed, prompt_lengths=[3, 6, 2, 8],
                               response_lengths=[9, 5, 12, 4])


def _live_keys(worker_or_layout, *_):
    return sorted(handles._WORKERS)


@pytest.mark.layouts(cpu=["tp2-sp"], cuda=["tp2-sp"])
def test_reference_fixture_gives_hf_logprobs_under_sequence_parallel(reference, device, layout, report):
    tb = _batch()
    ref = reference(layout, "tiny-qwen3")
    with torch.no_grad():
        want = hf_logprobs(build_hf_model("tiny-qwen3"), tb.batch)
    got = ref.logprobs(tb.batch, micro_batches=2)
    metrics = compare_logprobs(want, got, tb.loss_mask())
    limit = tolerance("max_abs", "fp32").limit
    report.add("max_abs", metrics["max_abs"], tolerance=limit, passed=metrics["max_abs"] <= limit, claim="bounded",
               layout=layout, model="tiny-qwen3", dtype="fp32")
    assert metrics["max_abs"] <= limit


def test_policies_in_one_world_keep_separate_state(policy, device, report):
    """Two resident policies share the rank processes, not their weights or optimizer state."""
    a = policy("tp2", lr=1e-3, micro_batches=2)
    b = policy("tp2", lr=1e-3, micro_batches=2)
    before = b.hf_state_dict()
    first = a.step(_batch())
    assert a.position() == {"steps_done": 1, "consumed_samples": 4, "lr": pytest.approx(1e-3)}
    assert b.position()["steps_done"] == 0
    after = b.hf_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before), "stepping one policy moved another"
    # The second step continues from the first's optimizer state: the same batch gives a new loss.
    second = a.step(_batch())
    assert second["loss"] != first["loss"]
    assert len(first["micro_batches"]) == 2 and sum(m["tokens"] for m in first["micro_batches"]) > 0


def test_bad_input_is_one_clear_error_before_any_work(policy, device):
    with pytest.raises(TypeError, match="unknown PolicyConfig field"):
        policy("tp2", learning_rate=1e-3)
    with pytest.raises(LayoutError, match="num_query_groups"):
        policy("tp4", "tiny-llama")  # 2 query groups: tp4 cannot split them
    with pytest.raises(LayoutError):
        policy("tp3", world_size=2)
    # megatron-core 0.16.1 would fail inside every rank (found on 2 H200s): one micro-batch under VPP
    with pytest.raises(ValueError, match="interleaved .VPP. schedule needs a multiple of pp=2"):
        policy("pp2vpp2", micro_batches=1)
    p = policy("pp2vpp2", micro_batches=2)
    p.begin_step(_batch())
    with pytest.raises(ValueError, match="micro-batches per accumulate call 1 does not suit pp2vpp2"):
        p.accumulate([0])


def test_a_closed_policy_is_freed_on_every_rank(policy, device):
    p = policy("dp2")
    assert p.key in p.apply(_live_keys)[0]
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.step(_batch())
    from harness.parallel.state import run_in_layout

    assert all(p.key not in keys for keys in run_in_layout(p.world, "dp2", _live_keys))
