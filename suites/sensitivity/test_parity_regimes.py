"""What the parity check can see in bf16 depends on its regime.

test_variants.py shows every parity variant failing the check by the margin in bf16: the check
compares in the exact regime there (the HF reference rounds where Megatron does,
harness.logprobs.arithmetic). In the approximate regime (a plain HF reference and fused norm
rounding: the arithmetic before issue 11, and what a user without the arranged reference gets)
the coarse variants still fail by the margin, while a 1% norm scale or a 1% RoPE-base error hides
inside bf16 rounding noise. These tests measure both, and the check that catches the fine ones
where the arithmetic cannot match (Transformer Engine's kernels, TP > 2): the bf16 model's state
evaluated in fp32 (harness.parity.runner, `fp32_eval`), which the approximate regime turns on.
"""
from __future__ import annotations

import pytest

from harness.models import load_hf_config, resolve_model
from harness.parallel.layout import parse_layout, resolve
from harness.parity.runner import ParityCase, run_parity
from harness.pytest_plugin.worlds import skip_unless_fits
from harness.tolerance import SENSITIVITY_MARGIN
from harness.variants import for_components, get

PARITY_VARIANTS = [v.id for v in for_components("bridge", "logprobs")]
# The arithmetic of the parity check before issue 11: what users of a plain HF reference get (the
# bf16 comparison alone: no fp32 evaluation of the model's state).
APPROXIMATE = dict(reference="plain", norm_precision="fused", fp32_eval=False)
FINE = ["scaled-norm", "wrong-rope-base"]  # effects of the size of bf16 rounding noise


def _run(world, layout, variant, dtype, hf_cache, report, **case):
    model = get(variant).model
    why_not = get(variant).why_not(resolve(parse_layout(layout), world.size),
                                   load_hf_config(resolve_model(model)))
    if why_not:
        pytest.skip(why_not)
    result = run_parity(world, ParityCase(model, layout, dtype, variant=variant, **case),
                        hf_cache=hf_cache, test=report.test)
    report.extend(result.rows)
    worst = max(result.checks, key=lambda c: c.margin)
    ok = result.separation >= SENSITIVITY_MARGIN
    report.add("separation", result.separation, tolerance=SENSITIVITY_MARGIN, passed=ok, claim="control",
               layout=result.layout.name, model=model, dtype=dtype, variant=variant,
               regime=result.regime, worst_metric=worst.metric, tolerance_kind="min")
    return result


# Every coarse entry of a dense model that can show in bf16. A MoE model's correct bf16 forward is
# itself past the approximate bound against a plain reference (test_moe_bf16_needs_the_arranged_
# reference): its controls are shown in the exact regime (test_variants.py), `router-in-bf16` in fp32
# only (no error in a bf16 run, see the catalog).
def _moe(model: str) -> bool:
    from harness.bridge.preflight import num_experts

    return num_experts(load_hf_config(resolve_model(model))) > 0


@pytest.mark.parametrize("variant", [v for v in PARITY_VARIANTS if v not in FINE and "bf16" in get(v).dtypes
                                     and not _moe(get(v).model)])
def test_coarse_variants_fail_even_in_the_approximate_regime(world_pool, device, spec, variant, hf_cache, report,
                                                             pytestconfig):
    if device not in get(variant).devices or spec not in get(variant).specs:  # e.g. CP: TE on CUDA only
        pytest.skip(f"{variant} shows on {'/'.join(get(variant).devices)} with the {'/'.join(get(variant).specs)} "
                    f"spec only")
    layout = get(variant).default_layout  # where the catalog says it shows (tp2, or pp2 for PP-only ones)
    skip_unless_fits(pytestconfig, parse_layout(layout).world_size, device)
    world = world_pool.get(parse_layout(layout).world_size, device)
    result = _run(world, layout, variant, "bf16", hf_cache, report, **APPROXIMATE)
    assert result.regime == "approximate"
    assert result.separation >= SENSITIVITY_MARGIN, result.summary()


@pytest.mark.layouts(cpu=["tp2"], cuda=["tp2"])
@pytest.mark.parametrize("variant", FINE)
def test_fine_variants_hide_in_bf16_noise_unless_the_arithmetic_matches(world, device, layout, variant,
                                                                         hf_cache, report):
    """Why the exact regime exists: with a plain HF reference a 1% error passes the bf16 check."""
    approximate = _run(world, layout, variant, "bf16", hf_cache, report, **APPROXIMATE)
    exact = _run(world, layout, variant, "bf16", hf_cache, report)
    assert approximate.passed and approximate.separation < 1, approximate.summary()
    assert exact.separation >= SENSITIVITY_MARGIN, exact.summary()


@pytest.mark.layouts(cpu=["tp2"], cuda=["tp1", "tp2"])
@pytest.mark.parametrize("variant", [None] + FINE)
def test_where_the_arithmetic_cannot_match_the_fp32_evaluation_catches_fine_variants(world, device, layout,
                                                                                     variant, hf_cache, report):
    """The approximate regime (here a plain reference and fused norms on CPU: TE's case on CUDA)
    with its fp32 evaluation of the bf16 model's state: the correct model passes, a 1% norm scale
    and a 1% RoPE base fail by the margin (CPU, tiny-qwen3, tp2: by 2.9e5 and 1e4)."""
    case = dict(reference="plain", norm_precision="fused") if world.spec == "local" else {}
    result = run_parity(world, ParityCase(get(variant or "scaled-norm").model, layout, "bf16", variant=variant, **case),
                        hf_cache=hf_cache, test=report.test)
    report.extend(result.rows)
    assert result.regime == "approximate" and "fp32" in result.evaluated_in, result.summary()
    if variant is None:
        assert result.passed, result.summary()
        # each engine's bf16 distance to the fp32 logprobs of the same weights, for the record
        noise = [row for row in result.rows if row.extra.get("evaluated_in") == "bf16-vs-fp32"]
        assert {row.metric for row in noise} >= {"noise_hf_mean_abs", "noise_megatron_mean_abs", "noise_ratio"}
        assert all(row.claim == "observed" and row.value > 0 for row in noise if "top1" not in row.metric)
    else:
        report.add("separation", result.separation, tolerance=SENSITIVITY_MARGIN,
                   passed=result.separation >= SENSITIVITY_MARGIN, claim="control", layout=layout,
                   model=result.case.model, dtype="bf16", variant=variant, regime=result.regime, tolerance_kind="min")
        assert result.separation >= SENSITIVITY_MARGIN, result.summary()


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["dp2ep2"])
def test_moe_bf16_needs_the_arranged_reference(world, device, layout, hf_cache, report):
    """A correct MoE model in bf16 against a plain HF reference: a token near a routing tie goes to
    another expert on one side, and the logprobs move by far more than the dense models' bf16
    noise (CPU, tiny-qwen3-moe: max |d| 0.27, past the dense approximate bound 0.2; tiny-mixtral tp2-sp
    0.62: the approximate-moe regime). Arranged (the router's top-k softmax, the routing weight before linear_fc2, the experts'
    partial sums reproduced) it is exact: <= 9.5e-7."""
    approximate, exact = (run_parity(world, ParityCase("tiny-qwen3-moe", layout, "bf16", **case), hf_cache=hf_cache,
                                     test=report.test) for case in (APPROXIMATE, {}))
    report.extend(approximate.rows + exact.rows)
    assert exact.regime == "exact" and exact.passed, exact.summary()
    ratio = approximate.metrics["max_abs"] / max(exact.metrics["max_abs"], 1e-12)
    report.add("plain_over_arranged_max_abs", ratio, tolerance=SENSITIVITY_MARGIN, passed=ratio >= SENSITIVITY_MARGIN,
               claim="control", layout=exact.layout.name, model="tiny-qwen3-moe", dtype="bf16", tolerance_kind="min")
    assert ratio >= SENSITIVITY_MARGIN, (approximate.summary(), exact.summary())
