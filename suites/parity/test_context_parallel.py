"""Context parallelism (issue 36): HF vs Megatron logprobs with every sequence split over CP ranks.

Megatron-core runs CP through Transformer Engine's attention only, and TE has no fp32 attention
under CP (its fused and flash attention are fp16/bf16, its unfused one cannot split a sequence). So
these run on CUDA with TE's spec in bf16: padded rows ("right": causal, no mask) and packed THD
sequences (cu_seqlens, each slot padded to 2 x cp chunks), over each exchange megatron-core offers
(`cp_comm_type` p2p, a2a, all_gather). The bf16 arithmetic is TE's (the approximate regime); the fp32
check of the bf16 model's state runs with CP folded into DP (`harness.parity.runner.fp32_layout`:
CP ranks hold whole, identical weights). Elsewhere (the CPU tier, the local spec, fp32) a CP layout
is one clear error before any rank starts.
"""
from __future__ import annotations

import pytest

from harness.parallel.layout import CP_BACKEND, CP_FP32, LayoutError, parse_layout
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
        pytest.skip(CP_BACKEND)
    result = _run(world, ParityCase("tiny-qwen3", layout, "bf16", packing=packing), hf_cache, report)
    assert result.passed, result.summary()
    assert "fp32" in result.evaluated_in  # the bf16 state held to the fp32 bounds too


@pytest.mark.layouts(cuda=["cp2"])
@pytest.mark.parametrize("comm", ["a2a", "all_gather"])
def test_every_cp_exchange_gives_the_same_parity(world, device, spec, layout, comm, hf_cache, report):
    """megatron-core's other `cp_comm_type`s (p2p is the default, above): KV by all-to-all over the
    heads (Ulysses-style) and by one all-gather."""
    if spec != "te":
        pytest.skip(CP_BACKEND)
    for packing in ("right", "thd"):
        case = ParityCase("tiny-qwen3", layout, "bf16", packing=packing, cp_comm_type=comm)
        result = _run(world, case, hf_cache, report)
        assert result.passed, result.summary()


def test_the_fp32_evaluation_of_a_cp_layout_folds_cp_into_dp():
    assert fp32_layout(parse_layout("cp2")).name == "dp2"
    assert fp32_layout(parse_layout("cp2tp2")).name == "tp2dp2"
    assert fp32_layout(parse_layout("tp2")) == parse_layout("tp2")


@pytest.mark.layouts(cpu=["cp2"], cuda=["cp2"])
def test_cp_is_refused_before_any_rank_starts_where_it_cannot_run(world, device, spec, layout, report):
    """The CPU tier and the local spec have no CP attention; TE on CUDA has none in fp32."""
    calls = world.calls
    expected = CP_FP32 if (device, spec) == ("cuda", "te") else CP_BACKEND
    with pytest.raises(LayoutError) as caught:
        run_parity(world, ParityCase("tiny-qwen3", layout, "fp32"), test=report.test)
    assert expected in str(caught.value)
    assert world.calls == calls, "a rank was called before the layout was refused"
