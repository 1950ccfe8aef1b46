"""Context parallelism's feeding and gathering (harness.logprobs.context_parallel) against
megatron-core's own split, and the gather's values and gradients, on the CPU tier.

The model under CP runs with Transformer Engine's attention on CUDA, or with the local spec's
gathered-kv attention (harness.parallel.cp_attention, checked here against megatron-core's attention
on the whole sequence); what the harness adds around it is pure tensor code plus one all-gather over
Megatron's CP group, which gloo runs: which positions each CP rank is fed (the
zig-zag chunks megatron-core's `get_batch_on_this_cp_rank` and its RoPE take, per THD slot as its
`_get_thd_freqs_on_this_cp_rank`), labels rolled before the split, values gathered back in
sequence order, and a backward that gives each rank the gradient at its own positions once.
"""
from __future__ import annotations

import pytest
import torch

from harness.logprobs.context_parallel import (
    chunk_positions,
    contiguous_positions,
    labels_for,
    length_multiple,
    rank_positions,
    slot_multiple,
    thd_positions,
)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_ranks_chunks_cover_every_position_once(cp):
    length = 8 * cp
    held = torch.cat([chunk_positions(length, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(length))
    if cp > 1:  # the zig-zag: rank 0 holds the first and the last chunk
        chunk = length // (2 * cp)
        assert chunk_positions(length, cp, 0).tolist() == list(range(chunk)) + list(range(length - chunk, length))


def test_a_length_that_does_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="2 x cp = 4 chunks"):
        chunk_positions(10, 2, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_thd_slots_split_like_megatrons_rope(cp):
    """Each packed sequence split as megatron-core's RoPE splits its frequencies under CP and THD."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    slots = [4 * cp, 2 * cp, 6 * cp]
    cu = torch.tensor([0] + torch.tensor(slots).cumsum(0).tolist(), dtype=torch.int32)
    for rank in range(cp):
        mine = thd_positions(cu, cp, rank)
        expected = []
        for start, size in zip(cu[:-1].tolist(), slots):
            local = torch.zeros(size // cp, 1)
            freqs = torch.arange(size, dtype=torch.float32).view(-1, 1, 1, 1)
            expected += [start + int(p) for p in _get_thd_freqs_on_this_cp_rank(rank, cp, local, freqs).flatten()]
        assert mine.tolist() == expected
    assert sorted(torch.cat([thd_positions(cu, cp, r) for r in range(cp)]).tolist()) == list(range(int(cu[-1])))


def test_lengths_the_layout_needs():
    assert length_multiple(1, 2, False) == 1 and length_multiple(1, 2, True) == 2  # as before CP
    assert length_multiple(2, 1, False) == 4  # 2 x cp chunks
    assert length_multiple(2, 4, True) == 8  # each CP rank's half (length/2) over 4 TP ranks
    assert length_multiple(4, 2, True) == 8
    assert slot_multiple(1) == 1 and slot_multiple(2) == 4


def test_labels_are_rolled_on_the_whole_sequence():
    tokens = torch.arange(10, 18).view(1, 8)
    labels = labels_for(tokens, fill=0)
    assert labels.tolist() == [[11, 12, 13, 14, 15, 16, 17, 0]]
    mine = chunk_positions(8, 2, 0)  # positions 0, 1, 6, 7
    # Rolled after the split (the variant): position 1 would predict token 6, not token 2.
    assert labels[:, mine].tolist() == [[11, 12, 17, 0]]
    assert labels_for(tokens[:, mine], fill=0).tolist() == [[11, 16, 17, 0]]


# ----------------------------------------------------------------------------- rank-side
def _gather_on_cp2(variant):
    """Under cp2 (gloo): each rank's values at its positions gathered; the gradient each rank gets."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from harness.logprobs.context_parallel import gather_positions
    from harness.parallel.state import model_parallel

    with model_parallel("cp2"):
        length = 12
        rank = ps.get_context_parallel_rank()
        fed = get_batch_on_this_cp_rank({"tokens": torch.arange(length).view(1, length)})["tokens"]
        mine = rank_positions(length, None, 2, rank)
        local = (mine.double() * 10).view(1, -1).requires_grad_(True)
        full = gather_positions(local, length, None, variant)
        weights = torch.arange(length, dtype=torch.float64).view(1, -1) + 1
        (full * weights).sum().backward()
        return fed.tolist(), mine.tolist(), full.detach().tolist(), local.grad.tolist(), \
            weights[:, mine].tolist()


@pytest.mark.world_size(2)
def test_the_gather_puts_every_value_back_in_sequence_order_and_its_gradient_once(world):
    results = world.run(_gather_on_cp2, None)
    for fed, mine, full, grad, own_weights in results:
        assert fed == [mine]  # what megatron-core's get_batch_on_this_cp_rank gives this rank
        assert full == [[10.0 * p for p in range(12)]]
        assert grad == own_weights  # d(sum w * full) / d(local) = w at its positions, not summed over CP


@pytest.mark.world_size(2)
def test_the_cp_variants_break_the_gather(world):
    contiguous = world.run(_gather_on_cp2, "cp-chunks-contiguous")
    assert contiguous[0][2] != [[10.0 * p for p in range(12)]]  # values in the wrong places
    assert contiguous_positions(12, 2, 0).tolist() == list(range(6))
    summed = world.run(_gather_on_cp2, "cp-grads-summed-over-cp")
    for _, _, full, grad, own_weights in summed:
        assert full == [[10.0 * p for p in range(12)]]
        assert grad == [[2 * w for w in own_weights[0]]]  # cp x the gradient


def _attention_on_cp2():
    """Under cp2 (gloo), float64: the local spec's gathered-kv attention on this rank's chunks, and
    megatron-core's DotProductAttention on the whole sequence; outputs and q/k/v gradients."""
    import copy

    from megatron.core import parallel_state as ps
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from harness.parallel.cp_attention import attention_class
    from harness.parallel.state import model_parallel

    with model_parallel("cp2"):
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                                   context_parallel_size=2, attention_dropout=0.0, masked_softmax_fusion=False)
        single = copy.copy(config)
        single.context_parallel_size = 1
        length, rank = 12, ps.get_context_parallel_rank()
        mine = rank_positions(length, None, 2, rank)
        generator = torch.Generator().manual_seed(0)  # the same whole sequence on both ranks
        q, k, v, weight = (torch.randn(length, 1, heads, 4, generator=generator, dtype=torch.float64)
                           for heads in (4, 2, 2, 4))
        weight = weight.view(length, 1, 16)

        def run(module, q, k, v, weight):
            q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = module(q, k, v, None)
            (out * weight).sum().backward()
            return out.detach(), q.grad, k.grad, v.grad

        ours = run(attention_class()(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                     attention_type="self"), q[mine], k[mine], v[mine], weight[mine])
        whole = run(DotProductAttention(single, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                        attention_type="self"), q, k, v, weight)
        return [max((a - b[mine]).abs().max().item() for a, b in zip(ours, whole)),
                min(b[mine].abs().max().item() for b in whole)]


@pytest.mark.world_size(2)
def test_the_gathered_kv_attention_is_megatrons_attention_on_the_whole_sequence(world):
    """The local spec's CP attention (harness.parallel.cp_attention): this rank's outputs, and the
    gradients of its queries, keys and values (summed over the CP ranks whose queries used them),
    equal DotProductAttention's on the whole sequence at the same positions (float64)."""
    for worst, smallest in world.run(_attention_on_cp2):
        assert smallest > 1e-3  # every compared tensor is nonzero at this rank's positions
        assert worst < 1e-12, worst


def test_the_gathered_kv_mask_is_causal_in_global_positions():
    from harness.parallel.cp_attention import causal_mask

    # cp2, 8 positions: rank 0 holds 0,1,6,7; keys gathered rank-major: 0,1,6,7 | 2,3,4,5
    mask = causal_mask(4, 2, 0, torch.device("cpu"))[0, 0]
    keys = [0, 1, 6, 7, 2, 3, 4, 5]
    for i, query in enumerate([0, 1, 6, 7]):
        assert [not m for m in mask[i].tolist()] == [key <= query for key in keys]
