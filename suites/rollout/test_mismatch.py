"""Train-inference mismatch (harness.rollout.mismatch): the rollout engine's logprobs of the tokens it
sampled against Megatron's recomputation of the same tokens, after a sync, as report rows: mean |d|,
p99 and max |d|, token_mult_prob_error, the k3 KL, the fraction past |d| > ln 2; per layout, dtype,
model, engine and decoding (greedy, and temperature 1 and 0.8 with the temperature on both sides).

The mismatch_* rows are observations (claim "observed"), each beside the bounded rows of the metrics a
bound exists for (the weight-sync table's for the tiny model, REAL_SHAPE's at qwen3-0.6b-shape). The fp32 tier is a claim with its test: on CUDA, vLLM with the harness's strict
fp32 settings (harness.rollout.vllm_engine.STRICT_FP32_CUDA) is held to the fp32 parity bound, and
vLLM as it comes, whose fp32 attention runs in TF32, is caught by it and named.
"""
from __future__ import annotations

import pytest
import torch

from harness.rollout import Sampling, sync_weights
from harness.rollout.check import DTYPES, engine_device, prompts
from harness.rollout.engines import open_engine
from harness.rollout.mismatch import METRICS, measure_mismatch
from harness.rollout.tolerances import real_shape_tolerance, sync_tolerance
from harness.tolerance import SENSITIVITY_MARGIN

MODEL = "tiny-qwen3-hd32"
DECODINGS = {"greedy": Sampling(n=2, max_tokens=12, temperature=0.0, seed=3),
             "t1": Sampling(n=2, max_tokens=12, temperature=1.0, seed=3),
             "t0.8": Sampling(n=2, max_tokens=12, temperature=0.8, seed=3)}


def _measure(policy, layout, model, engine, dtype, sampling, device, **options):
    from harness.models import load_hf_config

    p = policy(layout, model, dtype=dtype)
    e = open_engine(engine, model, dtype=DTYPES[dtype], device=engine_device(device), **options)
    sync_weights(p, e)  # the engine computes with the policy's own weights, as in RL
    return measure_mismatch(p, e, prompts(load_hf_config(model).vocab_size, count=8), sampling), e


def _rows(report, result, layout, model, dtype, engine, decoding, **extra):
    for metric in METRICS:
        report.add(f"mismatch_{metric}", result.metrics[metric], tolerance=None, passed=True, claim="observed",
                   layout=layout, model=model,
                   dtype=dtype, engine=engine, decoding=decoding, tokens=result.metrics["tokens"], **extra)


@pytest.mark.layouts(cpu=["dp2"], cuda="all")
@pytest.mark.parametrize("engine", ["vllm", "hf"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("decoding", list(DECODINGS))
def test_mismatch_is_measured_and_within_the_sync_bounds(policy, device, layout, engine, dtype, decoding, report,
                                                        request):
    from harness.pytest_plugin.collection import names_nightly

    nightly = request.config.getoption("--mrh-nightly") or names_nightly(request.config.getoption("markexpr") or "")
    if device == "cpu" and (engine, decoding) != ("vllm", "t1") and not nightly:
        pytest.skip("the CPU tier measures vLLM at temperature 1; the rest is nightly (--mrh-nightly)")
    result, e = _measure(policy, layout, MODEL, engine, dtype, DECODINGS[decoding], device)
    _rows(report, result, layout, MODEL, dtype, engine, decoding,
          **({"attention_backend": e.attention_backend} if engine == "vllm" else {}))
    m = result.metrics
    assert m["tokens"] == 8 * 2 * 12 and m["token_mult_prob_error"] >= 1.0 and 0.0 <= m["frac_over_ln2"] <= 1.0
    assert m["kl_k3"] >= -1e-12 and m["p99_abs"] <= m["max_abs"]
    for metric in ("max_abs", "mean_abs", "token_mult_prob_error"):
        bound = sync_tolerance(metric, dtype)
        report.add(metric, m[metric], tolerance=bound.limit, passed=bound.passes(m[metric]), claim=bound.claim,
                   layout=layout, model=MODEL, dtype=dtype, engine=engine, decoding=decoding)
        assert bound.passes(m[metric]), f"{engine} {dtype} {decoding}: {metric}={m[metric]:g} past {bound.limit:g}"


@pytest.mark.gpu
@pytest.mark.layouts(cuda=["tp1"])
def test_vllm_as_it_comes_computes_fp32_attention_in_tf32(policy, device, layout, report):
    """The fp32 tier's control: vLLM's default fp32 (TRITON_ATTN with Triton's TF32 dots on Hopper)
    fails the fp32 bound by >= SENSITIVITY_MARGIN; the strict settings (TRITON_F32_DEFAULT=ieee) pass it."""
    if device != "cuda":
        pytest.skip("TF32 exists on CUDA only")
    bound = sync_tolerance("max_abs", "fp32")
    default, engine = _measure(policy, layout, MODEL, "vllm", "fp32", DECODINGS["t1"], device, precision="default")
    backend = engine.attention_backend
    engine.close()
    strict, _ = _measure(policy, layout, MODEL, "vllm", "fp32", DECODINGS["t1"], device)
    margin = bound.margin(default.metrics["max_abs"])
    report.add("max_abs", default.metrics["max_abs"], tolerance=bound.limit, passed=False, claim="observed",
               layout=layout, model=MODEL, dtype="fp32", engine="vllm", precision="default", attention_backend=backend)
    report.add("separation", margin, tolerance=SENSITIVITY_MARGIN, passed=margin >= SENSITIVITY_MARGIN,
               claim="control", layout=layout, model=MODEL, dtype="fp32", engine="vllm",
               variant="vllm-tf32-attention", tolerance_kind="min", attention_backend=backend)
    report.add("max_abs", strict.metrics["max_abs"], tolerance=bound.limit, passed=bound.passes(strict.metrics["max_abs"]),
               claim=bound.claim, layout=layout, model=MODEL, dtype="fp32", engine="vllm", precision="strict")
    assert backend == "TritonAttentionImpl", f"vLLM picked {backend} for fp32: re-measure the fp32 tier"
    assert margin >= SENSITIVITY_MARGIN, f"vLLM's default fp32 is {default.metrics['max_abs']:g} off: not caught"
    assert bound.passes(strict.metrics["max_abs"]), f"strict fp32: {strict.metrics['max_abs']:g} past {bound.limit:g}"


@pytest.mark.gpu
@pytest.mark.layouts(cuda="all")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mismatch_at_a_real_shape(policy, device, layout, dtype, report):
    """qwen3-0.6b-shape (random weights of the real architecture): the rows the anchors compare with,
    held to bounds from the committed H100 run (harness.rollout.tolerances.REAL_SHAPE: NeMo-RL's
    token_mult_prob_error <= 1.05, k3 KL <= 1e-3 in bf16; 3e-5 max |d| in strict fp32)."""
    if device != "cuda":
        pytest.skip("a real shape on the GPU tier")
    failures = []
    for decoding in ("greedy", "t1"):
        result, e = _measure(policy, layout, "qwen3-0.6b-shape", "vllm", dtype, DECODINGS[decoding], device)
        _rows(report, result, layout, "qwen3-0.6b-shape", dtype, "vllm", decoding, attention_backend=e.attention_backend)
        assert torch.isfinite(torch.tensor(list(result.metrics.values()), dtype=torch.float64)).all()
        for metric in METRICS:
            bound = real_shape_tolerance(metric, dtype)
            if bound is None:
                continue
            value = result.metrics[metric]
            report.add(metric, value, tolerance=bound.limit, passed=bound.passes(value), claim=bound.claim,
                       layout=layout, model="qwen3-0.6b-shape", dtype=dtype, engine="vllm", decoding=decoding)
            if not bound.passes(value):
                failures.append(f"{decoding} {metric}={value:g} past {bound.limit:g}")
    assert not failures, "; ".join(failures)
