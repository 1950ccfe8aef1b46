"""Parity metrics on hand-computed inputs, and the tolerance table they are judged by."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.parity.metrics import compare_logprobs, top1_agreement
from harness.parity.tolerances import (
    WIDE_HIDDEN,
    Tolerance,
    all_tolerances,
    check,
    dtype_key,
    fp32_regime,
    table_markdown,
    tolerance,
)

# Deltas 0.1, -0.2, 0.0 on the masked tokens; the unmasked one (5.0) must not count.
REF = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
CAND = torch.tensor([[-0.9, -2.2, -3.0, 1.0]])
MASK = torch.tensor([[True, True, True, False]])


def test_metrics_on_known_values():
    got = compare_logprobs(REF, CAND, MASK)
    # Deltas are float32 values converted to float64, hence the 1e-7 slack.
    assert got["tokens"] == 3
    assert got["max_abs"] == pytest.approx(0.2, abs=1e-7)
    assert got["mean_abs"] == pytest.approx(0.1, abs=1e-7)
    assert got["token_mult_prob_error"] == pytest.approx(
        (math.exp(0.1) + math.exp(0.2) + 1.0) / 3, abs=1e-7)
    k3 = lambda r: math.exp(r) - 1 - r  # noqa: E731
    assert got["kl_k3"] == pytest.approx((k3(0.1) + k3(-0.2) + 0.0) / 3, abs=1e-7)


def test_identical_inputs_are_perfect():
    got = compare_logprobs(REF, REF.clone(), MASK)
    assert (got["max_abs"], got["mean_abs"], got["token_mult_prob_error"], got["kl_k3"]) == \
        (0.0, 0.0, 1.0, 0.0)


def test_metrics_run_in_float64():
    # A 1e-9 difference on top of -1 is invisible in float32 but must be measured.
    ref = torch.tensor([-1.0], dtype=torch.float64)
    cand = ref + 1e-9
    got = compare_logprobs(ref, cand, torch.tensor([True]))
    assert got["max_abs"] == pytest.approx(1e-9, rel=1e-6)
    # k3 ~ r^2/2 = 5e-19: expm1 keeps it; exp(r) - 1 would round it to garbage.
    assert got["kl_k3"] == pytest.approx(5e-19, rel=1e-3)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=1, max_size=20))
def test_k3_is_nonnegative_and_tmpe_at_least_one(deltas):
    cand = torch.tensor(deltas, dtype=torch.float64)
    got = compare_logprobs(torch.zeros_like(cand), cand, torch.ones_like(cand, dtype=torch.bool))
    assert got["kl_k3"] >= 0 and got["token_mult_prob_error"] >= 1
    assert got["mean_abs"] <= got["max_abs"]


def test_nan_propagates():
    cand = CAND.clone()
    cand[0, 1] = float("nan")
    assert math.isnan(compare_logprobs(REF, cand, MASK)["max_abs"])
    # ...but a NaN at an unmasked position is ignored.
    cand = CAND.clone()
    cand[0, 3] = float("nan")
    assert not math.isnan(compare_logprobs(REF, cand, MASK)["max_abs"])


def test_top1_agreement():
    ref = torch.tensor([[5, 6, 7, -1], [1, 2, 3, -1]])
    cand = torch.tensor([[5, 0, 7, 9], [1, 2, 3, -1]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    assert top1_agreement(ref, cand, mask) == pytest.approx(5 / 6)
    assert top1_agreement(ref, ref, mask) == 1.0


@pytest.mark.parametrize("args, message", [
    ((REF, CAND[:, :3], MASK), "shape mismatch"),
    ((REF, CAND, MASK[:, :3]), "shape mismatch"),
    ((REF, CAND, MASK.long()), "bool"),
    ((REF, CAND, MASK & False), "no tokens"),
])
def test_compare_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        compare_logprobs(*args)


def test_top1_rejects_bad_input():
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="shape mismatch"):
        top1_agreement(ids, ids[:, :2], torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no tokens"):
        top1_agreement(ids, ids, torch.zeros(2, 3, dtype=torch.bool))


# ---- tolerance table -------------------------------------------------------------------------
METRICS = ("max_abs", "mean_abs", "token_mult_prob_error", "kl_k3", "top1_agreement")


KEYS = [("fp32", "any"), ("fp32", "wide"), ("bf16", "exact"), ("bf16", "approximate"), ("bf16", "approximate-moe")]


def test_table_is_complete_and_every_entry_has_an_origin():
    entries = all_tolerances()
    expected = {(m, d, r) for m in METRICS for d, r in KEYS}
    assert {(t.metric, t.dtype, t.regime) for t in entries} == expected
    assert len(entries) == len(expected)
    for t in entries:
        assert len(t.origin) > 30, f"{t.metric}/{t.dtype}/{t.regime} needs an origin"
        assert t.kind == ("min" if t.metric == "top1_agreement" else "max")


def test_exact_bf16_is_as_tight_as_fp32_and_approximate_is_looser():
    for metric in METRICS:
        fp32, exact = tolerance(metric, "fp32"), tolerance(metric, "bf16", "exact")
        approximate = tolerance(metric, "bf16", "approximate")
        assert exact.limit == fp32.limit
        assert (fp32.limit < approximate.limit) if fp32.kind == "max" else (fp32.limit > approximate.limit)
        assert tolerance(metric, "fp32", "approximate") is fp32  # fp32 bounds hold in both regimes


def test_fp32_at_real_widths_is_looser_than_fp32_and_tighter_than_bf16():
    """The "wide" regime (hidden >= WIDE_HIDDEN: the -shape models from Qwen3-30B-A3B's 2048 up) widens
    fp32's bounds for longer sums only: still far inside bf16's; the Qwen3-0.6B shape (1024) stays at fp32's."""
    assert fp32_regime(1024) == "any" and fp32_regime(WIDE_HIDDEN) == fp32_regime(4096) == "wide"
    for metric in METRICS:
        fp32, wide = tolerance(metric, "fp32"), tolerance(metric, "fp32", "wide")
        approximate = tolerance(metric, "bf16", "approximate")
        if fp32.kind == "max":
            assert fp32.limit <= wide.limit < approximate.limit
        else:
            assert fp32.limit == wide.limit


def test_derived_fp32_limits_are_consistent():
    max_abs = tolerance("max_abs", "fp32").limit
    # k3 ~ r^2/2 at the max_abs limit must pass the kl_k3 limit; tmpe at mean_abs must pass too.
    assert math.expm1(max_abs) - max_abs <= tolerance("kl_k3", "fp32").limit
    assert math.exp(tolerance("mean_abs", "fp32").limit) <= \
        tolerance("token_mult_prob_error", "fp32").limit


def test_dtype_keys():
    assert dtype_key(torch.float32) == dtype_key("float32") == "fp32"
    assert dtype_key(torch.bfloat16) == dtype_key("bf16") == "bf16"
    assert tolerance("max_abs", torch.bfloat16) is tolerance("max_abs", "bf16")
    with pytest.raises(ValueError, match="fp32 and bf16"):
        dtype_key(torch.float16)
    with pytest.raises(KeyError, match="tokens"):
        tolerance("tokens", "fp32")


@pytest.mark.parametrize("dtype, regime", KEYS)
def test_check_passes_at_the_boundary_and_fails_past_it(dtype, regime):
    at_limit = {m: tolerance(m, dtype, regime).limit for m in METRICS}
    results = check({**at_limit, "tokens": 95}, dtype, regime)
    assert [r.metric for r in results] == list(METRICS)  # "tokens" has no bound: skipped
    assert all(r.passed for r in results)
    for metric, limit in at_limit.items():
        kind = tolerance(metric, dtype, regime).kind
        worse = math.nextafter(limit, math.inf if kind == "max" else -math.inf)
        (result,) = check({metric: worse}, dtype, regime)
        assert not result.passed and result.value == worse and result.margin > 1
        (nan,) = check({metric: float("nan")}, dtype, regime)
        assert not nan.passed and nan.margin == math.inf


def test_check_on_real_metrics():
    metrics = compare_logprobs(REF, REF + 1e-6, MASK)
    assert all(r.passed for r in check(metrics, torch.float32))
    # |delta| up to 0.03: acceptable as bf16 rounding noise (approximate regime, k3 ~ 3e-4), far
    # outside fp32 and the exact regime.
    metrics = compare_logprobs(REF, REF + torch.tensor([[0.03, -0.03, 0.01, 9.0]]), MASK)
    assert not any(r.passed for r in check(metrics, "fp32"))
    assert not any(r.passed for r in check(metrics, "bf16", "exact"))
    assert all(r.passed for r in check(metrics, "bf16", "approximate"))
    # One outlier of 0.1 in three tokens passes the approximate max/mean/tmpe bounds (mean 0.033,
    # tmpe 1.035) but not its kl_k3 limit (k3 = 1.7e-3): the k3 bound is the stricter one.
    outlier = compare_logprobs(REF, REF + torch.tensor([[0.1, 0.0, 0.0, 9.0]]), MASK)
    failed = [r.metric for r in check(outlier, "bf16", "approximate") if not r.passed]
    assert failed == ["kl_k3"]


def test_tolerance_passes_by_kind():
    assert Tolerance("m", "fp32", 1.0, "max").passes(1.0)
    assert not Tolerance("m", "fp32", 1.0, "max").passes(1.5)
    assert Tolerance("m", "fp32", 0.9, "min", ideal=1.0).passes(0.9)
    assert not Tolerance("m", "fp32", 0.9, "min", ideal=1.0).passes(0.5)


def test_margin_is_distance_from_perfect_in_units_of_the_allowed_distance():
    assert Tolerance("m", "fp32", 0.1).margin(0.3) == pytest.approx(3.0)
    assert Tolerance("m", "fp32", 0.9, "min", ideal=1.0).margin(0.7) == pytest.approx(3.0)
    assert Tolerance("m", "fp32", 1.05, ideal=1.0).margin(1.01) == pytest.approx(0.2)
    exact = Tolerance("m", "fp32", 0.0)
    assert exact.margin(0.0) == 0.0 and exact.margin(1e-9) == math.inf


def test_table_markdown_lists_every_entry_with_origin():
    text = table_markdown()
    lines = text.splitlines()
    assert lines[0].startswith("| dtype | regime | metric | bound | origin |")
    assert len(lines) == 2 + len(all_tolerances())
    for t in all_tolerances():
        origin = t.origin.replace("|", r"\|")
        assert any(f"| {t.dtype} | {t.regime} | {t.metric} |" in line and origin in line for line in lines)
    assert "<= 1e-05" in text and ">= 0.9" in text


def test_bf16_noise_measures_each_engine_against_the_fp32_logprobs_of_the_same_weights():
    """harness.parity.runner.bf16_noise on known values: HF's bf16 is 0.01 from fp32 on every token,
    Megatron's 0.03 on half of them, one top-1 flipped."""
    from harness.parity.runner import bf16_noise

    mask = torch.ones(1, 4, dtype=torch.bool)
    fp32 = torch.full((1, 4), -2.0, dtype=torch.float64)
    top = torch.tensor([[1, 2, 3, 4]])
    hf = (fp32 + 0.01, top)
    megatron = (fp32 + torch.tensor([[0.03, -0.03, 0.0, 0.0]], dtype=torch.float64), torch.tensor([[1, 2, 3, 5]]))
    noise = bf16_noise(hf, (fp32, top), megatron, mask)
    assert noise["noise_hf_mean_abs"] == pytest.approx(0.01) and noise["noise_hf_max_abs"] == pytest.approx(0.01)
    assert noise["noise_megatron_mean_abs"] == pytest.approx(0.015)
    assert noise["noise_megatron_max_abs"] == pytest.approx(0.03)
    assert noise["noise_ratio"] == pytest.approx(1.5)
    assert noise["noise_hf_top1_agreement"] == 1.0 and noise["noise_megatron_top1_agreement"] == 0.75
