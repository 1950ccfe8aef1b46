"""Mixture-of-Experts models give HF's per-token logprobs in Megatron-Core under the expert layouts:
experts split over ranks (ep), the experts' own tensor parallelism (etp) beside the dense tp, pipeline
stages, experts split over part of a larger data-parallel group (4 ranks), and both token dispatchers
that run without Transformer Engine; in fp32 and in bf16.

The reference is HF arranged to round where Megatron does (harness.logprobs.arithmetic, MoE layers
included: the router's top-k softmax, the routing weight applied before linear_fc2, the experts'
tensor-parallel partial sums), so bf16 is in the exact regime and held to the fp32 bounds
(harness.parity.tolerances; CPU, every layout here: max |d| <= 9.5e-7). A plain HF reference is
0.26 (Qwen3-MoE) to 0.62 (Mixtral) away in bf16, past even the approximate regime's bound.
CI runs Qwen3-MoE at every 2-rank layout in fp32 and at dp2ep2 and tp2-sp in bf16, Qwen2-MoE (a shared
expert behind a sigmoid gate, an unnormalised router) at tp2-sp in both, and a slice of the rest; the
nightly run all of it. Where the reference cannot round as Megatron does (TE's spec; on CPU,
fused norms) the bf16 model is also evaluated in fp32 and held to the fp32 bounds (the approximate-moe
regime, test_bf16_where_the_arithmetic_cannot_match_is_held_in_fp32)."""
from __future__ import annotations

import pytest

from harness.parity.runner import ParityCase, run_parity

# ep2 on 2 ranks is dp2ep2: the experts split over the data-parallel ranks. With tp, megatron-core's
# MoE layer trains only with sequence parallelism: tp2-sp (etp2, the default) and tp2ep2etp1-sp.
CPU_LAYOUTS = ["tp1", "dp2ep2", "tp2-sp", "tp2ep2etp1-sp", "pp2"]
SLICE = ["tp1", "dp2ep2"]  # what CI runs of the second family and of the allgather dispatcher
ALLGATHER_LAYOUTS = ["dp2ep2", "tp2ep2etp1-sp"]  # allgather needs fixed sequence lengths: no pp
# ep with dp on 4 ranks: the experts split over half the data-parallel group (dp4ep2: two expert-
# data-parallel replicas of each expert), over all of it (dp4ep4: one expert a rank), beside tp
# (tp2ep2etp1dp2-sp: whole experts, expert-dp 2) and beside pipeline stages (pp2ep2dp2).
EP_DP_LAYOUTS = ["dp4ep2", "dp4ep4", "tp2ep2etp1dp2-sp", "pp2ep2dp2"]
# etp2 x ep2 over 4 ranks: the alltoall dispatcher all-gathers each expert's tokens over etp in
# uneven parts (torch.distributed.all_gather of a list of unequal tensors), which gloo refuses
# ("ProcessGroupGloo::allgather: invalid tensor size"): NCCL only.
EP_DP_CUDA = EP_DP_LAYOUTS + ["tp2ep2dp2-sp"]


def _parity(world, layout, model, dispatcher, hf_cache, report, dtype="fp32"):
    from harness.bridge.backends import current
    from harness.bridge.preflight import bridge_converts

    if not bridge_converts(model):
        pytest.skip(f"the {current()} bridge does not convert {model} (suites/bridge/test_preflight.py: refused)")
    result = run_parity(world, ParityCase(model, layout, dtype, dispatcher=dispatcher), hf_cache=hf_cache,
                        test=report.test)
    report.extend(result.rows)
    if dtype == "bf16" and world.spec == "local":  # layouts the arranged reference reproduces: the fp32 bounds
        assert result.regime == "exact", result.summary()
    elif dtype == "bf16":  # TE's kernels: the approximate-moe regime, the bf16 model also held in fp32
        assert result.regime == "approximate-moe" and "fp32" in result.evaluated_in, result.summary()
    assert result.passed, result.summary()


@pytest.mark.layouts(cpu=CPU_LAYOUTS, cuda=CPU_LAYOUTS)
def test_qwen3_moe_logprobs_match_hf(world, device, layout, hf_cache, report):
    _parity(world, layout, "tiny-qwen3-moe", "alltoall", hf_cache, report)


@pytest.mark.layouts(cpu=SLICE, cuda=CPU_LAYOUTS)
def test_mixtral_logprobs_match_hf(world, device, layout, hf_cache, report):
    _parity(world, layout, "tiny-mixtral", "alltoall", hf_cache, report)


@pytest.mark.layouts(cpu=["dp2ep2"], cuda=ALLGATHER_LAYOUTS)
def test_allgather_dispatcher_logprobs_match_hf(world, device, layout, hf_cache, report):
    _parity(world, layout, "tiny-qwen3-moe", "allgather", hf_cache, report)


@pytest.mark.layouts(cpu=["dp2ep2", "tp2-sp"], cuda=["tp1", "dp2ep2", "tp2-sp"])
def test_qwen3_moe_bf16_logprobs_match_hf_exactly(world, device, layout, hf_cache, report):
    """bf16 at the fp32 bounds: the experts split over ranks, and split in width (etp2: linear_fc2's
    partial sums), with the alltoall dispatcher."""
    if world.spec != "local":
        pytest.skip("TE's kernels round unlike the arranged reference: TE's bf16 is in the approximate-moe "
                    "regime (test_bf16_where_the_arithmetic_cannot_match_is_held_in_fp32)")
    _parity(world, layout, "tiny-qwen3-moe", "alltoall", hf_cache, report, dtype="bf16")


# Where the reference cannot round as Megatron does (TE's kernels; on CPU its local analogue, fused
# norms), a bf16 MoE forward is "approximate-moe" (harness.parity.tolerances): rounding noise moves
# tokens near a routing tie to another expert. Its logprobs are held to that regime's bounds, and the
# bf16 model (its state, and its routing as built) is evaluated in fp32 and held to the fp32 bounds:
# that is the check that sees a wrong expert order, top-k or router softmax there.
def _approximate(world, layout, model, variant, hf_cache, report):
    from harness.bridge.backends import current
    from harness.bridge.preflight import bridge_converts

    if not bridge_converts(model):
        pytest.skip(f"the {current()} bridge does not convert {model} (suites/bridge/test_preflight.py: refused)")
    case = dict(norm_precision="fused") if world.spec == "local" else {}
    result = run_parity(world, ParityCase(model, layout, "bf16", variant=variant, dispatcher="alltoall", **case),
                        hf_cache=hf_cache, test=report.test)
    report.extend(result.rows)
    assert result.regime == "approximate-moe" and "fp32" in result.evaluated_in, result.summary()
    return result


@pytest.mark.layouts(cpu=SLICE, cuda=CPU_LAYOUTS)
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_bf16_where_the_arithmetic_cannot_match_is_held_in_fp32(world, device, layout, model, hf_cache, report):
    result = _approximate(world, layout, model, None, hf_cache, report)
    assert result.passed, result.summary()


@pytest.mark.nightly
@pytest.mark.layouts(cpu=[name for name in CPU_LAYOUTS if name not in SLICE])
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_bf16_where_the_arithmetic_cannot_match_at_every_layout(world, device, layout, model, hf_cache, report):
    result = _approximate(world, layout, model, None, hf_cache, report)
    assert result.passed, result.summary()


@pytest.mark.layouts(cpu=["dp2ep2"], cuda=["tp1", "dp2ep2"])
@pytest.mark.parametrize("variant", ["swapped-experts", "topk-off-by-one", "mixtral-pre-softmax",
                                     pytest.param("shared-expert-gate-dropped", marks=pytest.mark.nightly)])
def test_moe_controls_fail_the_fp32_evaluation_where_the_arithmetic_cannot_match(world, device, layout, variant,
                                                                               hf_cache, report):
    """The catalog's bf16 MoE controls in the approximate-moe regime: the fp32 evaluation of the bf16
    model fails each by the margin (the bf16 comparison alone may not: a correct MoE model's bf16
    noise reaches a good part of what the weakest control moves). shared-expert-gate-dropped is a flag
    on the modules, not state: the fp32 model gets it as a routing variant does (nightly on CPU; the
    exact-regime catch runs in CI in suites/sensitivity)."""
    from harness.tolerance import SENSITIVITY_MARGIN, separation
    from harness.variants import get

    result = _approximate(world, layout, get(variant).model, variant, hf_cache, report)
    in_fp32 = separation(c for c, e in zip(result.checks, result.evaluated_in, strict=True) if e == "fp32")
    report.add("fp32_eval_separation", in_fp32, tolerance=SENSITIVITY_MARGIN, passed=in_fp32 >= SENSITIVITY_MARGIN,
               claim="control", layout=result.layout.name, model=result.case.model, dtype="bf16", variant=variant,
               regime=result.regime, tolerance_kind="min")
    assert in_fp32 >= SENSITIVITY_MARGIN, result.summary()


@pytest.mark.nightly
@pytest.mark.layouts(cpu=[name for name in CPU_LAYOUTS if name not in SLICE])
def test_mixtral_logprobs_match_hf_at_every_layout(world, device, layout, hf_cache, report):
    _parity(world, layout, "tiny-mixtral", "alltoall", hf_cache, report)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=ALLGATHER_LAYOUTS)
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_allgather_dispatcher_at_every_layout(world, device, layout, model, hf_cache, report):
    _parity(world, layout, model, "allgather", hf_cache, report)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=CPU_LAYOUTS)
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_bf16_logprobs_match_hf_exactly_at_every_layout(world, device, layout, model, hf_cache, report):
    _parity(world, layout, model, "alltoall", hf_cache, report, dtype="bf16")


@pytest.mark.nightly
@pytest.mark.layouts(cpu=ALLGATHER_LAYOUTS)
def test_allgather_dispatcher_bf16_at_every_layout(world, device, layout, hf_cache, report):
    _parity(world, layout, "tiny-qwen3-moe", "allgather", hf_cache, report, dtype="bf16")


@pytest.mark.nightly
@pytest.mark.layouts(cpu=EP_DP_LAYOUTS, cuda=EP_DP_CUDA)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_experts_over_part_of_the_data_parallel_group(world, device, layout, dtype, hf_cache, report):
    _parity(world, layout, "tiny-qwen3-moe", "alltoall", hf_cache, report, dtype=dtype)


# Qwen2-MoE (issue 37; stack A only: Megatron-Bridge 0.6.2 has no Qwen2-MoE bridge, these skip there): a
# router without renormalisation (megatron-core's pre-softmax router) and a shared expert scaled by a
# sigmoid gate, which the arranged reference computes as SharedExpertMLP does (its linear_fc2's partial
# sums over the dense TP ranks). CI: tp2-sp in fp32 and bf16 (the shared expert split over TP, the routed
# experts over etp 2); the catalog's shared-expert-gate-dropped runs the fixed path at dp2 in both dtypes
# (suites/sensitivity). Nightly: every other CPU layout, the allgather dispatcher, 4 ranks.
QWEN2_MOE = "tiny-qwen2-moe"


@pytest.mark.layouts(cpu=["tp2-sp"], cuda=CPU_LAYOUTS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_qwen2_moe_logprobs_match_hf(world, device, layout, dtype, hf_cache, report):
    if dtype == "bf16" and world.spec != "local":
        pytest.skip("TE's kernels round unlike the arranged reference: TE's bf16 is in the approximate-moe "
                    "regime (test_qwen2_moe_bf16_where_the_arithmetic_cannot_match_is_held_in_fp32)")
    _parity(world, layout, QWEN2_MOE, "alltoall", hf_cache, report, dtype=dtype)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=[name for name in CPU_LAYOUTS if name != "tp2-sp"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_qwen2_moe_logprobs_match_hf_at_every_layout(world, device, layout, dtype, hf_cache, report):
    _parity(world, layout, QWEN2_MOE, "alltoall", hf_cache, report, dtype=dtype)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=ALLGATHER_LAYOUTS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_qwen2_moe_allgather_dispatcher(world, device, layout, dtype, hf_cache, report):
    _parity(world, layout, QWEN2_MOE, "allgather", hf_cache, report, dtype=dtype)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=EP_DP_LAYOUTS, cuda=EP_DP_CUDA)
def test_qwen2_moe_experts_over_part_of_the_data_parallel_group(world, device, layout, hf_cache, report):
    _parity(world, layout, QWEN2_MOE, "alltoall", hf_cache, report, dtype="bf16")


@pytest.mark.nightly
@pytest.mark.layouts(cpu=CPU_LAYOUTS, cuda=CPU_LAYOUTS)
def test_qwen2_moe_bf16_where_the_arithmetic_cannot_match_is_held_in_fp32(world, device, layout, hf_cache, report):
    result = _approximate(world, layout, QWEN2_MOE, None, hf_cache, report)
    assert result.passed, result.summary()


# DeepSeek-V3 (issue 37; stack A only: refused by name on Megatron-Bridge, these skip there): MLA (q/kv
# LoRA, YaRN with mscale, megatron-core's local MLA core attention: harness.compat.megatron_core), a dense
# first layer, then a sigmoid router with e_score_correction_bias, group-limited top-4, renormalised and
# scaled by 2.5, and shared experts; the arranged reference computes the router and the experts' float32
# combine as megatron-core does (harness.logprobs.arithmetic), so bf16 is in the exact regime. CI: tp2-sp in
# bf16, the exact regime (MLA's column-parallel down projections and the shared experts split over TP, the
# routed experts over etp 2); the catalog's five DeepSeek-V3 variants run the fixed path at dp2 in both
# dtypes (suites/sensitivity). Nightly (the CI budget): tp2-sp in fp32, every other CPU layout in both
# dtypes, the allgather dispatcher, 4 ranks, the approximate regime.
DEEPSEEK_V3 = "tiny-deepseek-v3"


@pytest.mark.layouts(cpu=["tp2-sp"], cuda=CPU_LAYOUTS)
@pytest.mark.parametrize("dtype", [pytest.param("fp32", marks=pytest.mark.nightly), "bf16"])
def test_deepseek_v3_logprobs_match_hf(world, device, layout, dtype, hf_cache, report):
    if dtype == "bf16" and world.spec != "local":
        pytest.skip("TE's kernels round unlike the arranged reference: TE's bf16 is in the approximate-moe "
                    "regime (test_deepseek_v3_bf16_where_the_arithmetic_cannot_match_is_held_in_fp32)")
    _parity(world, layout, DEEPSEEK_V3, "alltoall", hf_cache, report, dtype=dtype)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=[name for name in CPU_LAYOUTS if name != "tp2-sp"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_deepseek_v3_logprobs_match_hf_at_every_layout(world, device, layout, dtype, hf_cache, report):
    _parity(world, layout, DEEPSEEK_V3, "alltoall", hf_cache, report, dtype=dtype)


# fp32 only: in bf16 the allgather dispatcher combines a token's four experts otherwise than the arranged
# reference (the alltoall one's float32 combine): dp2ep2 max |d| 0.28, open (docs/moe.md).
@pytest.mark.nightly
@pytest.mark.layouts(cpu=ALLGATHER_LAYOUTS)
def test_deepseek_v3_allgather_dispatcher(world, device, layout, hf_cache, report):
    _parity(world, layout, DEEPSEEK_V3, "allgather", hf_cache, report, dtype="fp32")


@pytest.mark.nightly
@pytest.mark.layouts(cpu=EP_DP_LAYOUTS, cuda=EP_DP_CUDA)
def test_deepseek_v3_experts_over_part_of_the_data_parallel_group(world, device, layout, hf_cache, report):
    _parity(world, layout, DEEPSEEK_V3, "alltoall", hf_cache, report, dtype="bf16")


# tp1 only on CPU: at tp2-sp the bf16 run's kl_k3 is 0.0122 against the approximate-moe bound 0.01 (top-4 of
# 16 experts flips more tokens near a tie than the top-2 models the bound was set on; its fp32 evaluation
# passes at 4.8e-6): open (docs/moe.md).
@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1"], cuda=CPU_LAYOUTS)
def test_deepseek_v3_bf16_where_the_arithmetic_cannot_match_is_held_in_fp32(world, device, layout, hf_cache, report):
    result = _approximate(world, layout, DEEPSEEK_V3, None, hf_cache, report)
    assert result.passed, result.summary()
