"""Hypothesis strategies for RL batches: the only module of harness.data importing hypothesis."""
from __future__ import annotations

from hypothesis import strategies as st

from harness.data.rl_batch import RLBatch, make_rl_batch


@st.composite
def rl_batches(draw: st.DrawFn, vocab_size: int, max_batch: int = 8, max_seq: int = 32,
               batch_multiple: int = 1) -> RLBatch:
    """Valid RLBatches: variable prompt (>= 1) and response (>= 1) lengths, any padding side per
    row, batch size a multiple of batch_multiple, any pad_id in the vocab.

    Structure (lengths, sides, pad_id) is drawn by hypothesis so it shrinks; token values come from
    a drawn seed, which keeps large batches cheap to generate.
    """
    if max_batch < batch_multiple or max_seq < 2:
        raise ValueError(f"need max_batch >= batch_multiple ({batch_multiple}) and max_seq >= 2")
    batch_size = batch_multiple * draw(st.integers(1, max_batch // batch_multiple))
    seq_len = draw(st.integers(2, max_seq))
    lengths = draw(st.lists(st.integers(2, seq_len), min_size=batch_size, max_size=batch_size))
    # Guarantee at least one unpadded row half of the time: full-length rows are the "none" case.
    if draw(st.booleans()):
        lengths[draw(st.integers(0, batch_size - 1))] = seq_len
    prompts = [draw(st.integers(1, length - 1)) for length in lengths]
    sides = [draw(st.sampled_from(["left", "right"])) if length < seq_len else "none"
             for length in lengths]
    return make_rl_batch(
        vocab_size, batch_size=batch_size, prompt_lengths=prompts,
        response_lengths=[length - prompt for length, prompt in zip(lengths, prompts)],
        padding=sides, seq_len=seq_len, seed=draw(st.integers(0, 2**31 - 1)),
        pad_id=draw(st.integers(0, vocab_size - 1)))
