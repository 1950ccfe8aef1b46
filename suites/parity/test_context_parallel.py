"""Context parallelism (issue 36): HF vs Megatron logprobs with every sequence split over CP ranks.

Two CP attentions. On CUDA with TE's spec (what RL frameworks train with): megatron-core's
TEDotProductAttention, bf16 only (TE's fused and flash attention are fp16/bf16, its unfused one cannot
split a sequence), on padded rows ("right": causal, no mask) and packed THD sequences (cu_seqlens, each
slot padded to 2 x cp chunks), over each exchange megatron-core offers (`cp_comm_type` p2p, a2a,
all_gather); the bf16 arithmetic is TE's (the approximate regime), and the fp32 check of the bf16
model's state runs with CP folded into DP (`harness.parity.runner.fp32_layout`: CP ranks hold whole,
identical weights). On the local spec (the CPU tier, every CI run): the harness's gathered-kv attention
(harness.parallel.cp_attention), fp32 and bf16 on right-padded rows, held to the same regimes as
the layouts without CP. What cannot run (fp32 on TE, THD on the local spec) is one clear error before
any rank starts.
"""
from __future__ import annotations

import pytest

from harness.parallel.layout import CP_FP32, LayoutError, parse_layout
from harness.parity.runner import ParityCase, fp32_layout, run_parity

CP_LAYOUTS = ["cp2", "cp2tp2", "cp4", "cp2dp2", "cp2tp2-sp"]  # those the machine's GPUs fit run


def _run(world, case, hf_cache, report):
    result = run_parity(world, case, hf_cache=hf_cache, test=report.test)
    report.extend(result.rows)
    return result


@pytest.mark.layouts(cuda=CP_LAYOUTS)
@pytest.mark.parametrize("packing", ["right", "thd"])
def test_cp_logprobs_match_hf(world, device, spec, layout, packing, hf_cache, report):
    if spec != "te":
        pytest.skip("TE's CP attention (the local spec's: test_cp_on_the_local_spec_holds_the_regimes)")
    result = _run(world, ParityCase("tiny-qwen3", layout, "bf16", packing=packing), hf_cache, report)
    assert result.passed, result.summary()
    assert "fp32" in result.evaluated_in  # the bf16 state held to the fp32 bounds too


@pytest.mark.layouts(cuda=["cp2"])
@pytest.mark.parametrize("comm", ["a2a", "all_gather"])
def test_every_cp_exchange_gives_the_same_parity(world, device, spec, layout, comm, hf_cache, report):
    """megatron-core's other `cp_comm_type`s (p2p is the default, above): KV by all-to-all over the
    heads (Ulysses-style) and by one all-gather."""
    if spec != "te":
        pytest.skip("cp_comm_type chooses TE's exchange (the local spec's attention always all-gathers)")
    for packing in ("right", "thd"):
        case = ParityCase("tiny-qwen3", layout, "bf16", packing=packing, cp_comm_type=comm)
        result = _run(world, case, hf_cache, report)
        assert result.passed, result.summary()


@pytest.mark.layouts(cuda=["cp4"])
def test_the_hierarchical_cp_exchange_gives_the_same_parity(world, device, spec, layout, hf_cache, report):
    """`a2a+p2p` (megatron-core's hierarchical CP): all-to-all over the heads inside pairs of CP ranks,
    the ring between the pairs, over the layout's two-level CP groups (Layout.hierarchical_cp_sizes)."""
    if spec != "te":
        pytest.skip("cp_comm_type chooses TE's exchange (the local spec's attention always all-gathers)")
    for packing in ("right", "thd"):
        case = ParityCase("tiny-qwen3", layout, "bf16", packing=packing, cp_comm_type="a2a+p2p")
        result = _run(world, case, hf_cache, report)
        assert result.passed, result.summary()


def _hierarchical_cp_ranks(layout) -> list[list[int]]:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    return [dist.get_process_group_ranks(g) for g in ps.get_hierarchical_context_parallel_groups()]


@pytest.mark.layouts(cpu=[pytest.param("cp4", marks=pytest.mark.nightly)], cuda=["cp4"])
def test_a_cp4_layout_makes_the_hierarchical_groups_a2a_p2p_runs_over(world, device, layout):
    from harness.parallel.state import run_in_layout

    groups = run_in_layout(world, layout, _hierarchical_cp_ranks)
    # Inner level: neighbouring CP ranks (the all-to-all); outer level: the same position of each pair.
    assert groups == [[[0, 1], [0, 2]], [[0, 1], [1, 3]], [[2, 3], [0, 2]], [[2, 3], [1, 3]]]


@pytest.mark.world_size(2)
def test_the_hierarchical_exchange_below_cp4_is_refused_before_any_rank(world, report):
    calls = world.calls
    with pytest.raises(ValueError, match="a2a\\+p2p' at cp2: the hierarchical exchange needs cp >= 4"):
        run_parity(world, ParityCase("tiny-qwen3", "cp2", "bf16", cp_comm_type="a2a+p2p"), test=report.test)
    assert world.calls == calls


def test_the_fp32_evaluation_of_a_cp_layout_folds_cp_into_dp():
    assert fp32_layout(parse_layout("cp2")).name == "dp2"
    assert fp32_layout(parse_layout("cp2tp2")).name == "tp2dp2"
    assert fp32_layout(parse_layout("tp2")) == parse_layout("tp2")


@pytest.mark.layouts(cpu=["cp2", *(pytest.param(name, marks=pytest.mark.nightly) for name in CP_LAYOUTS[1:])],
                     cuda=["cp2"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("packing", ["right", "thd"])
def test_cp_on_the_local_spec_holds_the_regimes_of_the_layouts_without_it(world, device, spec, layout, dtype,
                                                                           packing, hf_cache, report):
    """The gathered-kv attention: each CP rank's queries against every rank's keys under the causal mask
    of their global positions (THD: and of their sequences). Nothing is folded or relaxed: the regime of
    the layouts without CP (the local spec's exact tier for rows, the approximate one for THD, whose
    packed row has other GEMM shapes than the reference's) with the whole CP path (the zig-zag feed per
    sequence, RoPE's slices, the labels rolled before the split, the logprob gather)."""
    if spec != "local":
        pytest.skip("the local spec's CP attention (TE's: test_cp_logprobs_match_hf)")
    result = _run(world, ParityCase("tiny-qwen3", layout, dtype, packing=packing), hf_cache, report)
    assert result.passed, result.summary()


@pytest.mark.layouts(cuda=["cp2"])
def test_cp_is_refused_before_any_rank_starts_where_it_cannot_run(world, device, spec, layout, report):
    """TE on CUDA has no fp32 attention under CP (the local spec runs CP in every dtype)."""
    if spec != "te":
        pytest.skip("the local spec runs CP in fp32 (test_cp_on_the_local_spec_holds_the_regimes...)")
    calls = world.calls
    with pytest.raises(LayoutError) as caught:
        run_parity(world, ParityCase("tiny-qwen3", layout, "fp32"), test=report.test)
    assert CP_FP32 in str(caught.value)
    assert world.calls == calls, "a rank was called before the layout was refused"
