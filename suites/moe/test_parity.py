"""Mixture-of-Experts models give HF's per-token logprobs in Megatron-Core under the expert layouts:
experts split over ranks (ep), the experts' own tensor parallelism (etp) beside the dense tp, pipeline
stages, and both token dispatchers that run without Transformer Engine. CI runs Qwen3-MoE at every
layout with the alltoall dispatcher and a slice of the rest; the nightly run all of it."""
from __future__ import annotations

import pytest

from harness.parity.runner import ParityCase, run_parity

# ep2 on 2 ranks is dp2ep2: the experts split over the data-parallel ranks. With tp, megatron-core's
# MoE layer trains only with sequence parallelism: tp2-sp (etp2, the default) and tp2ep2etp1-sp.
CPU_LAYOUTS = ["tp1", "dp2ep2", "tp2-sp", "tp2ep2etp1-sp", "pp2"]
SLICE = ["tp1", "dp2ep2"]  # what CI runs of the second family and of the allgather dispatcher
ALLGATHER_LAYOUTS = ["dp2ep2", "tp2ep2etp1-sp"]  # allgather needs fixed sequence lengths: no pp


def _parity(world, layout, model, dispatcher, hf_cache, report):
    from harness.bridge.backends import current
    from harness.bridge.preflight import bridge_converts

    if not bridge_converts(model):
        pytest.skip(f"the {current()} bridge does not convert {model} (suites/bridge/test_preflight.py: refused)")
    # The plain eager reference: the arranged one reproduces dense MLPs' rounding only; the fp32
    # bounds hold in either regime (harness.parity.tolerances).
    case = ParityCase(model, layout, "fp32", dispatcher=dispatcher, reference="plain")
    result = run_parity(world, case, hf_cache=hf_cache, test=report.test)
    report.extend(result.rows)
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


@pytest.mark.nightly
@pytest.mark.layouts(cpu=[name for name in CPU_LAYOUTS if name not in SLICE])
def test_mixtral_logprobs_match_hf_at_every_layout(world, device, layout, hf_cache, report):
    _parity(world, layout, "tiny-mixtral", "alltoall", hf_cache, report)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=ALLGATHER_LAYOUTS)
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_allgather_dispatcher_at_every_layout(world, device, layout, model, hf_cache, report):
    _parity(world, layout, model, "allgather", hf_cache, report)
