"""The HF reference engine on its own (no world): seeded sampling, its logprobs against a full HF
forward of the same rows, weight updates that refuse bad input whole, sleep and wake."""
from __future__ import annotations

import pytest
import torch

from harness.logprobs import hf_logprobs
from harness.models import build_hf_model
from harness.parity.metrics import compare_logprobs
from harness.rollout import EngineAsleep, HFEngine, Sampling
from harness.rollout.check import prompts
from harness.rollout.tolerances import sync_tolerance

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def engine():
    return HFEngine(MODEL)


def test_the_same_seed_samples_the_same_rollouts_and_another_seed_does_not(engine):
    asked = prompts(engine.vocab_size)
    a = engine.generate(asked, Sampling(n=3, max_tokens=5, seed=1))
    b = engine.generate(asked, Sampling(n=3, max_tokens=5, seed=1))
    c = engine.generate(asked, Sampling(n=3, max_tokens=5, seed=2))
    assert torch.equal(a.batch.input_ids, b.batch.input_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completions, c.completions)
    assert a.batch.batch_size == 3 * len(asked) and a.completions.shape == (12, 5)
    assert a.prompt_index.tolist() == [i for i in range(len(asked)) for _ in range(3)]
    assert int(a.batch.response_mask.sum()) == 12 * 5 and bool((a.logprobs[a.batch.response_mask] < 0).all())


def test_cached_decoding_gives_the_full_forward_logprobs(engine, report):
    """Token-by-token decoding with a KV cache is the same model as one forward over the rows."""
    rollouts = engine.generate(prompts(engine.vocab_size), Sampling(n=2, max_tokens=6, seed=3))
    full = hf_logprobs(build_hf_model(MODEL), rollouts.batch)
    metrics = compare_logprobs(full, rollouts.logprobs, rollouts.batch.response_mask)
    bound = sync_tolerance("max_abs", "fp32")
    report.add("max_abs", metrics["max_abs"], tolerance=bound.limit, passed=bound.passes(metrics["max_abs"]),
               claim=bound.claim, model=MODEL, dtype="fp32", device="cpu", comparison="cached decode vs full forward")
    assert bound.passes(metrics["max_abs"]), metrics


def test_a_bad_bucket_is_refused_whole(engine):
    before = engine.weights()
    name = "model.layers.0.self_attn.q_proj.weight"
    good = (name, before[name] + 1)
    with pytest.raises(KeyError, match="no weight 'model.nope'"):
        engine.update_weights([good, ("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([good, ("model.norm.weight", torch.zeros(3))])
    assert all(torch.equal(before[k], v) for k, v in engine.weights().items()), "a refused bucket changed weights"


def test_a_fused_gate_up_is_split_gate_rows_first(engine):
    prefix = "model.layers.1.mlp."
    before = engine.weights()
    gate, up = before[prefix + "gate_proj.weight"] * 2, before[prefix + "up_proj.weight"] * 3
    assert engine.update_weights([(prefix + "gate_up_proj.weight", torch.cat([gate, up]))]) == 2
    after = engine.weights()
    assert torch.equal(after[prefix + "gate_proj.weight"], gate) and torch.equal(after[prefix + "up_proj.weight"], up)
    engine.update_weights(before.items())


def test_a_sleeping_engine_refuses_work_until_woken(engine):
    engine.sleep()
    with pytest.raises(EngineAsleep, match="generate while the engine sleeps"):
        engine.generate([[1, 2]], Sampling())
    with pytest.raises(EngineAsleep):
        engine.update_weights([])
    engine.wake()
    assert engine.generate([[1, 2]], Sampling(max_tokens=2)).completions.shape == (1, 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be"), (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_bad_sampling_is_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


def test_greedy_decoding_takes_the_argmax_and_reports_its_plain_logprob(engine):
    greedy = Sampling(n=2, max_tokens=3, temperature=0.0, seed=1)
    rollouts = engine.generate([[1, 2, 3]], greedy)
    assert greedy.greedy and greedy.logprob_temperature == 1.0
    assert torch.equal(rollouts.completions[0], rollouts.completions[1])  # no sampling: both rows alike
    with torch.no_grad():
        logits = engine.model(input_ids=rollouts.batch.input_ids[:1]).logits[0, 2:-1].float()
    logprobs = torch.log_softmax(logits, -1)
    assert torch.equal(rollouts.completions[0], logprobs.argmax(-1))
    torch.testing.assert_close(rollouts.logprobs[0, 3:], logprobs.max(-1).values, rtol=0, atol=1e-5)


def test_bad_prompts_are_one_clear_error(engine):
    with pytest.raises(ValueError, match="no empty prompt"):
        engine.generate([[1], []], Sampling())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, engine.vocab_size]], Sampling())
