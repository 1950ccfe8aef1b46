"""The HF reference logprobs: the side of every parity check that Megatron is compared against.

The key invariant: padding must not change a row's logprobs. A row gives the same values (to fp32
rounding) left-padded, right-padded, unpadded, alone or in a batch, in any micro-batch split, and
they equal a by-hand log_softmax of the unpadded sequence's logits.

Caveat: RoPE attention scores depend only on position differences, so for the zoo's RoPE models a
forward *without* the batch's position_ids is still padding-invariant in fp32 (~1e-6); only
rounding shows it (bf16). test_forward_gets_the_batch_masks_and_positions checks the inputs
directly for that reason.
"""
from __future__ import annotations

from functools import cache

import pytest
import torch
from hypothesis import given, settings

from harness.data import RLBatch, standard_parity_batch
from harness.data.strategies import rl_batches
from harness.logprobs import hf_logprobs, hf_token_outputs, hf_top1, shifted_token_outputs
from harness.models import TINY_VOCAB_SIZE, build_hf_model
from harness.parity.metrics import compare_logprobs
from harness.parity.tolerances import tolerance

FAMILIES = ("tiny-qwen2", "tiny-qwen3", "tiny-llama")
FP32_TOL = 1e-5  # padding invariance: the fp32 parity bound, which HF must meet against itself


@cache
def _model(name: str, dtype: torch.dtype = torch.float32):
    return build_hf_model(name, dtype=dtype, seed=0)


def _place(tokens: list[int], prompt: int, seq_len: int, side: str, pad_id: int = 0) -> RLBatch:
    """One row holding ``tokens`` padded on ``side`` to seq_len."""
    start = seq_len - len(tokens) if side == "left" else 0
    ids = torch.full((1, seq_len), pad_id, dtype=torch.int64)
    attn = torch.zeros((1, seq_len), dtype=torch.bool)
    ids[0, start:start + len(tokens)] = torch.tensor(tokens)
    attn[0, start:start + len(tokens)] = True
    resp = attn.clone()
    resp[0, start:start + prompt] = False
    return RLBatch(ids, attn, resp, pad_id).validate(TINY_VOCAB_SIZE)


def _cat(*rows: RLBatch) -> RLBatch:
    return RLBatch(torch.cat([r.input_ids for r in rows]),
                   torch.cat([r.attention_mask for r in rows]),
                   torch.cat([r.response_mask for r in rows]), rows[0].pad_id)


def _manual(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of tokens[1:] and argmax predictions, from one unpadded, unmasked forward."""
    with torch.no_grad():
        logits = model(tokens.unsqueeze(0)).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, tokens[1:, None]).squeeze(1), logits[:-1].argmax(-1)


@pytest.mark.parametrize("name", [*FAMILIES, "tiny-qwen3-tied"])
def test_padding_does_not_change_logprobs(name):
    model = _model(name)
    tokens = torch.randint(0, TINY_VOCAB_SIZE, (14,), generator=torch.Generator().manual_seed(7))
    tokens[9] = 0  # a real token equal to pad_id must still count as real
    seq = tokens.tolist()
    alone = hf_logprobs(model, _place(seq, 5, 14, "none"))[0]
    # In one batch: the row left-padded, right-padded, and beside an unpadded longer row.
    other = torch.randint(0, TINY_VOCAB_SIZE, (20,), generator=torch.Generator().manual_seed(8))
    batch = _cat(_place(seq, 5, 20, "left"), _place(seq, 5, 20, "right"),
                 _place(other.tolist(), 3, 20, "none"))
    got = hf_logprobs(model, batch)
    left, right = got[0][batch.attention_mask[0]], got[1][batch.attention_mask[1]]
    assert (left - alone).abs().max() <= FP32_TOL
    assert (right - alone).abs().max() <= FP32_TOL
    assert alone[0] == 0 and bool((alone[1:] != 0).all())
    # Pads are exactly 0.
    assert bool((got[~batch.attention_mask] == 0).all())


@pytest.mark.parametrize("name", FAMILIES)
def test_standard_batch_matches_per_row_manual_computation(name):
    model = _model(name)
    batch = standard_parity_batch(TINY_VOCAB_SIZE, seed=1)
    logprobs, top1 = hf_token_outputs(model, batch)
    assert logprobs.dtype == torch.float32 and logprobs.shape == batch.input_ids.shape
    assert top1.dtype == torch.int64
    for row in range(batch.batch_size):
        real = batch.attention_mask[row]
        expected, argmax = _manual(model, batch.input_ids[row][real])
        assert logprobs[row][real][0] == 0 and top1[row][real][0] == -1
        assert (logprobs[row][real][1:] - expected).abs().max() <= FP32_TOL
        assert torch.equal(top1[row][real][1:], argmax)
    assert bool((logprobs[~batch.logprob_mask()] == 0).all())
    assert bool((top1[~batch.logprob_mask()] == -1).all())
    assert torch.equal(hf_top1(model, batch), top1)


def test_forward_gets_the_batch_masks_and_positions():
    model = _model("tiny-qwen2")
    batch = standard_parity_batch(TINY_VOCAB_SIZE)
    seen: list[dict] = []
    handle = model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs),
                                             with_kwargs=True)
    try:
        hf_logprobs(model, batch, micro_batch_size=4)
    finally:
        handle.remove()
    assert len(seen) == 2
    for kwargs, part in zip(seen, batch.split(2)):
        assert torch.equal(kwargs["input_ids"], part.input_ids)
        assert torch.equal(kwargs["attention_mask"], part.attention_mask.long())
        assert torch.equal(kwargs["position_ids"], part.position_ids())


@settings(max_examples=10, deadline=None)
@given(rl_batches(TINY_VOCAB_SIZE, max_batch=4, max_seq=20))
def test_right_padding_transform_preserves_logprobs(batch):
    """What the Megatron path does: compute on the right-padded batch, restore the columns."""
    model = _model("tiny-llama")
    right, index = batch.to_right_padded()
    original = hf_logprobs(model, batch)
    restored = batch.restore(hf_logprobs(model, right), index)
    assert (original - restored).abs().max() <= FP32_TOL


def test_micro_batches_do_not_change_logprobs():
    model = _model("tiny-qwen2")
    batch = standard_parity_batch(TINY_VOCAB_SIZE)
    whole = hf_logprobs(model, batch)
    for size in (1, 2, 4):
        assert (hf_logprobs(model, batch, micro_batch_size=size) - whole).abs().max() <= FP32_TOL
    with pytest.raises(ValueError, match="must divide"):
        hf_logprobs(model, batch, micro_batch_size=3)


def test_rejects_ids_outside_the_vocab():
    batch = standard_parity_batch(TINY_VOCAB_SIZE + 50, seed=3)
    if int(batch.input_ids.max()) < TINY_VOCAB_SIZE:  # guard: the seed must draw a large id
        pytest.fail("seed 3 drew no id >= the tiny vocab; pick another seed")
    with pytest.raises(ValueError, match="outside the vocab"):
        hf_logprobs(_model("tiny-qwen2"), batch)


def test_bf16_upcasts_logits_before_log_softmax():
    model = _model("tiny-qwen3", torch.bfloat16)
    batch = standard_parity_batch(TINY_VOCAB_SIZE)
    got = hf_logprobs(model, batch)
    assert got.dtype == torch.float32
    for row in (0, 1, 2):  # unpadded, left-, right-padded
        real = batch.attention_mask[row]
        expected, _ = _manual(model, batch.input_ids[row][real])
        assert (got[row][real][1:] - expected).abs().max() <= 1e-2
    # Exactness of the float32 path on identical logits, which a bf16 log_softmax would miss
    # (bf16 keeps ~3 significant digits: errors ~2e-2 on logprobs around -6).
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long(),
                       position_ids=batch.position_ids()).logits
    exact, _ = shifted_token_outputs(logits, batch.input_ids, batch.logprob_mask())
    assert torch.equal(exact, got)
    in_bf16, _ = shifted_token_outputs(torch.log_softmax(logits, -1), batch.input_ids,
                                       batch.logprob_mask())
    assert (in_bf16 - exact)[batch.logprob_mask()].abs().max() > 1e-3


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_is_close_to_fp32(name):
    """Loose: bf16 weights are the rounded fp32 ones, so this is weight + activation rounding."""
    batch = standard_parity_batch(TINY_VOCAB_SIZE)
    fp32 = hf_logprobs(_model(name), batch)
    bf16 = hf_logprobs(_model(name, torch.bfloat16), batch)
    metrics = compare_logprobs(fp32, bf16, batch.response_mask)
    # Two arithmetics (bf16 vs fp32): the approximate regime's bounds.
    assert metrics["max_abs"] <= tolerance("max_abs", "bf16", "approximate").limit
    assert metrics["mean_abs"] <= tolerance("mean_abs", "bf16", "approximate").limit
    assert metrics["max_abs"] > 1e-4  # it really ran in bf16
