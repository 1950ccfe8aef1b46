"""RLBatch, its generators and THD packing: the layouts every parity check feeds to the backends.

Pure tensor tests in the pytest parent process. The property tests run the transforms on
hypothesis-drawn batches (any lengths, any padding side per row, any pad_id).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.data import RLBatch, make_rl_batch, pack, standard_parity_batch, unpack
from harness.data.strategies import rl_batches

VOCAB = 251
PROPERTY = settings(max_examples=40, deadline=None)


def _batch(padding, prompts=(3, 1, 4, 2), responses=(2, 5, 1, 6), seq_len=None, seed=0):
    return make_rl_batch(VOCAB, batch_size=len(prompts), prompt_lengths=list(prompts),
                         response_lengths=list(responses), padding=padding, seq_len=seq_len,
                         seed=seed)


def _equal(a: RLBatch, b: RLBatch) -> bool:
    return (a.pad_id == b.pad_id and torch.equal(a.input_ids, b.input_ids)
            and torch.equal(a.attention_mask, b.attention_mask)
            and torch.equal(a.response_mask, b.response_mask))


# ---- generators ------------------------------------------------------------------------------
def test_generator_is_deterministic_by_seed():
    assert _equal(_batch("mixed", seed=3), _batch("mixed", seed=3))
    assert not torch.equal(_batch("mixed", seed=3).input_ids, _batch("mixed", seed=4).input_ids)
    assert _equal(standard_parity_batch(VOCAB, seed=1), standard_parity_batch(VOCAB, seed=1))


@pytest.mark.parametrize("padding", ["left", "right"])
def test_one_sided_padding(padding):
    # Lengths 5, 6, 5, 8: the full-length row is unpadded, the others padded on the asked side.
    batch = _batch(padding)
    assert batch.padding_sides() == [padding, padding, padding, "none"]
    assert batch.lengths.tolist() == [5, 6, 5, 8] and batch.seq_len == 8


def test_no_padding_needs_equal_lengths():
    batch = _batch("none", prompts=(3, 1), responses=(2, 4))
    assert batch.padding_sides() == ["none", "none"] and bool(batch.attention_mask.all())
    with pytest.raises(ValueError, match="padding='none'"):
        _batch("none")


def test_mixed_padding_has_both_sides_for_every_seed():
    # Five short rows alternate left/right (3 + 2) in a seed-dependent order; the full row is
    # unpadded.
    orders = set()
    for seed in range(10):
        sides = _batch("mixed", prompts=(2,) * 6, responses=(1, 2, 3, 4, 5, 9), seed=seed) \
            .padding_sides()
        assert (sides.count("left"), sides.count("right"), sides[-1]) == (3, 2, "none")
        orders.add(tuple(sides))
    assert len(orders) > 1


def test_explicit_sides_and_seq_len():
    batch = _batch(["right", "left", "left", "none"], seq_len=8)
    assert batch.padding_sides() == ["right", "left", "left", "none"]
    with pytest.raises(ValueError, match="cannot be unpadded"):
        _batch(["none", "left", "left", "none"])
    with pytest.raises(ValueError, match="shorter than the longest"):
        _batch("left", seq_len=7)


def test_response_follows_prompt():
    batch = _batch("mixed", seq_len=10, seed=2)
    for row, (prompt, response) in enumerate(zip((3, 1, 4, 2), (2, 5, 1, 6))):
        real = batch.attention_mask[row].nonzero().flatten()
        marked = batch.response_mask[row].nonzero().flatten()
        assert marked.tolist() == real[prompt:prompt + response].tolist()


def test_standard_parity_batch_shape_and_traps():
    batch = standard_parity_batch(VOCAB)
    assert (batch.batch_size, batch.seq_len) == (8, 24)
    sides = batch.padding_sides()
    assert {"left", "right", "none"} <= set(sides)
    for part in batch.split(4):  # every micro-batch of 2 rows mixes two sides
        assert len(set(part.padding_sides())) == 2
    # Planted pad_id tokens at real positions (EOS == pad), in a response and a prompt.
    planted = (batch.input_ids == batch.pad_id) & batch.attention_mask
    assert bool(planted[2].any() and (planted[2] & batch.response_mask[2]).any())
    assert bool((planted[4] & ~batch.response_mask[4]).any())
    assert int(batch.response_mask.sum()) == 95


# ---- derived tensors and transforms --------------------------------------------------------
def test_position_ids_follow_hf_convention():
    batch = _batch(["left", "right", "left", "none"], prompts=(1, 1, 1, 1),
                   responses=(2, 2, 6, 7))
    assert batch.position_ids().tolist() == [
        [0, 0, 0, 0, 0, 0, 1, 2],
        [0, 1, 2, 2, 2, 2, 2, 2],
        [0, 0, 1, 2, 3, 4, 5, 6],
        [0, 1, 2, 3, 4, 5, 6, 7],
    ]


def test_logprob_mask_excludes_first_real_token():
    batch = _batch(["left", "right", "left", "none"])
    mask, first = batch.logprob_mask(), batch.attention_mask.long().argmax(dim=1)
    assert torch.equal(mask.sum(dim=1), batch.lengths - 1)
    assert not bool(mask[torch.arange(4), first].any())


@PROPERTY
@given(rl_batches(VOCAB))
def test_right_padding_round_trip(batch):
    right, index = batch.to_right_padded()
    right.validate(VOCAB)
    assert set(right.padding_sides()) <= {"right", "none"}
    assert torch.equal(right.lengths, batch.lengths)
    # Real tokens keep their order, and right-padded positions are plain 0..len-1.
    for row in range(batch.batch_size):
        assert right.input_ids[row][right.attention_mask[row]].tolist() == \
            batch.input_ids[row][batch.attention_mask[row]].tolist()
    assert torch.equal(right.position_ids()[right.attention_mask],
                       batch.position_ids()[batch.attention_mask])
    # restore() maps any per-token tensor back; pads come back as 0.
    values = torch.randn(right.input_ids.shape) * right.attention_mask
    restored = batch.restore(values, index)
    assert not bool(restored[~batch.attention_mask].any())
    assert torch.equal(batch.restore(right.input_ids, index),
                       torch.where(batch.attention_mask, batch.input_ids, 0))
    assert torch.equal(batch.restore(right.response_mask, index), batch.response_mask)
    # Idempotent on an already right-padded batch.
    again, _ = right.to_right_padded()
    assert _equal(again, right)


def test_restore_rejects_wrong_shapes():
    batch = _batch("left")
    _, index = batch.to_right_padded()
    with pytest.raises(ValueError, match="restore"):
        batch.restore(torch.zeros(4, 7), index)


@PROPERTY
@given(rl_batches(VOCAB, batch_multiple=4), st.sampled_from([1, 2, 4]))
def test_split_is_ordered_and_equal(batch, parts):
    pieces = batch.split(parts)
    assert [p.batch_size for p in pieces] == [batch.batch_size // parts] * parts
    assert torch.equal(torch.cat([p.input_ids for p in pieces]), batch.input_ids)
    assert torch.equal(torch.cat([p.response_mask for p in pieces]), batch.response_mask)
    assert all(p.pad_id == batch.pad_id for p in pieces)


def test_split_rejects_uneven_parts():
    with pytest.raises(ValueError, match="into 3 equal parts"):
        standard_parity_batch(VOCAB).split(3)


def test_to_moves_every_tensor():
    moved = _batch("left").to("meta")
    assert {t.device.type for t in (moved.input_ids, moved.attention_mask, moved.response_mask)} \
        == {"meta"}


# ---- validate ------------------------------------------------------------------------------
def _broken(**changes):
    return replace(_batch(["left", "right", "left", "none"]), **changes)


@pytest.mark.parametrize("mutate, message", [
    (lambda b: dict(attention_mask=b.attention_mask[:, 1:]), "equal"),
    (lambda b: dict(input_ids=b.input_ids.int()), "int64"),
    (lambda b: dict(response_mask=b.response_mask.long()), "bool"),
    (lambda b: dict(response_mask=b.response_mask | ~b.attention_mask), "subset"),
    (lambda b: dict(response_mask=b.attention_mask), "no real token before"),
    (lambda b: dict(input_ids=torch.where(b.attention_mask, b.input_ids, 7)), "pad_id"),
    (lambda b: dict(input_ids=b.input_ids + VOCAB), "outside the vocab"),
    (lambda b: dict(pad_id=VOCAB), "pad_id"),
    (lambda b: dict(attention_mask=b.attention_mask & False, response_mask=b.response_mask & False),
     "no real tokens"),
])
def test_validate_names_the_broken_rule(mutate, message):
    good = _batch(["left", "right", "left", "none"])
    with pytest.raises(ValueError, match=message):
        replace(good, **mutate(good)).validate(VOCAB)


def test_validate_rejects_holes_and_two_sided_padding():
    good = _batch(["left", "right", "left", "none"])
    holed = good.attention_mask.clone()
    holed[3, 4] = False
    two_sided = good.attention_mask.clone()
    two_sided[1, 0] = False
    for mask in (holed, two_sided):
        ids = torch.where(mask, good.input_ids, good.pad_id)
        with pytest.raises(ValueError, match="contiguous"):
            replace(good, input_ids=ids, attention_mask=mask,
                    response_mask=good.response_mask & mask).validate()


@PROPERTY
@given(rl_batches(VOCAB, max_batch=6, max_seq=12, batch_multiple=3))
def test_strategy_batches_are_valid(batch):
    batch.validate(VOCAB)
    assert batch.batch_size % 3 == 0 and batch.seq_len <= 12
    assert bool((batch.response_mask.sum(dim=1) >= 1).all())


# ---- packing -------------------------------------------------------------------------------
@PROPERTY
@given(rl_batches(VOCAB), st.sampled_from([1, 2, 3, 8]))
def test_pack_unpack_round_trip(batch, multiple):
    packed = pack(batch, pad_multiple=multiple)
    slots = packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]
    real = packed.cu_seqlens_unpadded[1:] - packed.cu_seqlens_unpadded[:-1]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.shape == (batch.batch_size + 1,)
    assert torch.equal(real.long(), batch.lengths)
    assert bool((slots % multiple == 0).all() and (slots - real >= 0).all())
    assert bool((slots - real < multiple).all())
    assert packed.max_seqlen == int(slots.max())
    assert packed.total_tokens == int(packed.cu_seqlens[-1])
    # Positions restart at every slot; slot padding holds pad_id and no response.
    for b in range(batch.batch_size):
        start, end = int(packed.cu_seqlens[b]), int(packed.cu_seqlens[b + 1])
        assert packed.position_ids[0, start:end].tolist() == list(range(end - start))
    assert bool((packed.input_ids[~packed.real_mask] == batch.pad_id).all())
    assert not bool((packed.response_mask & ~packed.real_mask).any())
    # The inverse: unpack restores ids and response mask at real positions, zeros elsewhere.
    expected = torch.where(batch.attention_mask, batch.input_ids, 0)
    assert torch.equal(unpack(packed.input_ids, packed, batch), expected)
    assert torch.equal(unpack(packed.input_ids[0], packed, batch), expected)
    assert torch.equal(unpack(packed.response_mask, packed, batch), batch.response_mask)


def test_pack_layout_on_a_known_batch():
    batch = _batch(["left", "right"], prompts=(1, 2), responses=(2, 3), seq_len=6)
    packed = pack(batch, pad_multiple=4)
    assert packed.cu_seqlens.tolist() == [0, 4, 12]
    assert packed.cu_seqlens_unpadded.tolist() == [0, 3, 8]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert packed.input_ids[0, :3].tolist() == batch.input_ids[0, 3:].tolist()
    assert packed.input_ids[0, 4:9].tolist() == batch.input_ids[1, :5].tolist()
    assert packed.response_mask.int().tolist() == [[0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0]]


def test_unpack_rejects_mismatches():
    batch = standard_parity_batch(VOCAB)
    packed = pack(batch)
    with pytest.raises(ValueError, match="packed length"):
        unpack(torch.zeros(packed.total_tokens + 1), packed, batch)
    with pytest.raises(ValueError, match="packed from"):
        unpack(packed.input_ids, packed, batch.split(2)[0])
    with pytest.raises(ValueError, match="pad_multiple"):
        pack(batch, pad_multiple=0)
