"""Tests for harness.report.compare: each row judged by its claim (harness.report.claims), never by
how far its value moved: a run whose figures move inside their bounds (another machine) compares
clean; a row past its bound, a broken exact claim, a control below its margin, a loosened bound and
a weakened claim are regressions; timings and observations never gate. Also new/missing rows,
duplicate keys, legacy (schema 1) runs, fingerprints, and the CLI's exit codes."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

from harness.report.claims import CLAIMS, ClaimError, infer_legacy
from harness.report.compare import compare_runs, main_compare, row_key
from harness.report.rules import RULES, rule_for
from harness.tolerance import SENSITIVITY_MARGIN
from suites.report.runs import make_run, nodeid, parity_rows, row, write_run

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def baseline() -> dict[str, Any]:
    return make_run(parity_rows())


def find(run: dict[str, Any], metric: str, layout: str = "tp2", model: str = "tiny-qwen3",
         dtype: str = "fp32") -> dict[str, Any]:
    return next(r for r in run["rows"] if (r["metric"], r["layout"], r["model"], r["dtype"])
                == (metric, layout, model, dtype))


def _exit(tmp_path: Path, base: dict[str, Any], current: dict[str, Any]) -> int:
    return main_compare([str(write_run(tmp_path / "a", base)), str(write_run(tmp_path / "b", current))])


def test_identical_runs_pass(tmp_path: Path, baseline: dict[str, Any], capsys) -> None:
    result = compare_runs(baseline, copy.deepcopy(baseline))
    assert not result.regressed and result.unchanged == len(baseline["rows"])
    assert not (result.regressions or result.improvements or result.new or result.missing)
    a, b = write_run(tmp_path / "a", baseline), write_run(tmp_path / "b", baseline)
    assert main_compare([str(a), str(b / "results.json")]) == 0  # a dir and a results.json path
    assert "**no regression**" in capsys.readouterr().out


# ------------------------------------------------------------------ the four claims of issue 23
def test_every_figure_moving_within_its_own_bound_compares_clean(tmp_path: Path, baseline, capsys) -> None:
    """Another machine's run: each bounded value moves (fp32 1.9e-6 -> 9.9e-6 under 1e-5: 5x, once
    a regression by value) but stays inside its bound."""
    other_machine = copy.deepcopy(baseline)
    for r in other_machine["rows"]:
        if r["metric"] == "top1_agreement":  # a "min" bound: one token in 200 flips
            r["value"] = max(r["tolerance"], r["value"] - 0.005)
        else:  # 99% of the way from a perfect match to the bound
            ideal = 1.0 if r["metric"] == "token_mult_prob_error" else 0.0
            r["value"] = ideal + 0.99 * (r["tolerance"] - ideal)
    result = compare_runs(baseline, other_machine)
    assert not result.regressed and result.moved > 0 and not result.ungated
    assert _exit(tmp_path, baseline, other_machine) == 0
    assert f"{result.moved} moved within their bounds" in capsys.readouterr().out


def test_a_row_past_its_bound_exits_1(tmp_path: Path, baseline, capsys) -> None:
    current = copy.deepcopy(baseline)
    past = find(current, "max_abs")
    past.update(value=1.9 * past["tolerance"], passed=False)  # the test recorded it failing its bound
    result = compare_runs(baseline, current)
    assert [c.current for c in result.regressions] == [past]
    assert result.regressions[0].reasons == [f"past its own bound: {1.9 * past['tolerance']:.3g} vs bound "
                                             f"{past['tolerance']:.3g}"]
    assert _exit(tmp_path, baseline, current) == 1
    out = capsys.readouterr().out
    assert "**REGRESSED**: 1 rows regressed" in out
    line = next(l for l in out.splitlines() if "cpu-tp2-tiny-qwen3-fp32" in l)
    assert "| max_abs | bounded | tp2 | tiny-qwen3 | fp32 | cpu | local |" in line


def test_an_exact_claim_that_breaks_exits_1(tmp_path: Path) -> None:
    test = nodeid("test_offload_round_trip", "cpu-dp2")
    base = make_run([row(test, "freed_minus_theory_bytes", 0.0, tolerance=0, units="bytes")])
    broke = copy.deepcopy(base)
    broke["rows"][0].update(value=512.0, passed=False)
    result = compare_runs(base, broke)
    assert base["rows"][0]["claim"] == "exact"
    assert result.regressions[0].reasons == ["exact claim broke: 512 vs bound 0"]
    assert _exit(tmp_path, base, broke) == 1


def test_a_control_whose_margin_drops_below_3x_exits_1(tmp_path: Path) -> None:
    test = nodeid("test_variant_is_caught", "cpu-scaled-norm-tp2-bf16")
    variant_rows = [row(test, "max_abs", 0.05, tolerance=1e-5, passed=False, claim="observed",
                        dtype="bf16", extra={"variant": "scaled-norm"}),
                    row(test, "separation", 5000.0, tolerance=SENSITIVITY_MARGIN, claim="control",
                        dtype="bf16", extra={"variant": "scaled-norm", "tolerance_kind": "min"})]
    base = make_run(variant_rows)
    drifted = copy.deepcopy(base)  # another machine rounds the wrong model otherwise: still caught
    drifted["rows"][0]["value"] = 0.057
    drifted["rows"][1]["value"] = 5700.0 * 0.3
    assert not compare_runs(base, drifted).regressed
    weak = copy.deepcopy(base)
    weak["rows"][0]["value"] = 2.5e-5
    weak["rows"][1].update(value=2.5, passed=False)  # no longer 3x past the bound
    result = compare_runs(base, weak)
    assert [c.current["metric"] for c in result.regressions] == ["separation"]
    assert result.regressions[0].reasons[0].startswith("margin fell below its required multiple: 2.5 vs bound 3")
    assert _exit(tmp_path, base, weak) == 1


def test_the_issue_23_false_regressions_compare_clean() -> None:
    """What `make compare` flagged on untouched code on another CPU: RL loop grad norms 1e-5 apart
    (observations) and bf16 negative controls' token_mult_prob_error moved (a variant's figures)."""
    loop = nodeid("test_the_reward_goes_up", "cpu-dp2")
    control = nodeid("test_variant_is_caught", "cpu-unmasked-padding-tp2-bf16")
    base = make_run([row(loop, "grad_norm", 4.946338516997, tolerance=None, claim="observed", extra={"iteration": 6}),
                     row(control, "token_mult_prob_error", 1.46, tolerance=1.0 + 1e-5, passed=False,
                         claim="observed", dtype="bf16"),
                     row(control, "separation", 4.6e4, tolerance=3.0, claim="control", dtype="bf16")])
    other = copy.deepcopy(base)
    other["rows"][0]["value"] = 4.946401177930992
    other["rows"][1]["value"] = 1.46122
    result = compare_runs(base, other)
    assert not result.regressed
    assert sorted(c.current["metric"] for c in result.ungated) == ["grad_norm", "token_mult_prob_error"]


# ------------------------------------------------------------------ bounds and claims themselves
def test_a_loosened_bound_or_a_weakened_claim_is_a_regression(baseline) -> None:
    looser = copy.deepcopy(baseline)
    find(looser, "max_abs")["tolerance"] = 1e-4
    find(looser, "top1_agreement")["tolerance"] = 0.5  # a "min" bound loosens downwards
    result = compare_runs(baseline, looser)
    assert sorted(c.current["metric"] for c in result.regressions) == ["max_abs", "top1_agreement"]
    assert result.regressions[0].reasons[0].startswith("bound loosened")
    tighter = compare_runs(looser, baseline)
    assert not tighter.regressed and len(tighter.improvements) == 2
    weaker = copy.deepcopy(baseline)
    find(weaker, "max_abs")["claim"] = "observed"
    assert compare_runs(baseline, weaker).regressions[0].reasons == ["claim weakened: bounded → observed"]


def test_passed_false_to_true_is_an_improvement(baseline) -> None:
    current = copy.deepcopy(baseline)
    find(current, "top1_agreement")["passed"] = False
    back = compare_runs(current, baseline)
    assert not back.regressed and back.improvements[0].reasons == ["failed → passed"]


def test_timings_and_observations_are_listed_never_gate() -> None:
    test = nodeid("test_resume", "cpu-tp2-to-pp2")
    base = make_run([row(test, "save_s", 0.5, tolerance=None, units="s"),
                     row(test, "load_s", 0.4, tolerance=None, units="s"),
                     row(test, "reward_mean", 0.56, tolerance=None, claim="observed")])
    slower = copy.deepcopy(base)
    slower["rows"][0]["value"] = 1.5  # 3x: another machine, or a loaded one
    slower["rows"][1]["value"] = 0.45  # within the noise: not even listed
    slower["rows"][2]["value"] = 0.53
    result = compare_runs(base, slower)
    assert not result.regressed and [c.current["metric"] for c in result.ungated] == ["save_s", "reward_mean"]
    assert result.ungated[0].reasons == ["timing: worse by 1 (not gating)"]
    text = result.to_markdown()
    assert "**no regression**" in text and "### Moved, not gating (timings, observations) (2)" in text


def test_nan_in_a_gating_row_fails_its_bound() -> None:
    test = nodeid("test_x", "cpu")
    base = make_run([row(test, "kl_k3", 2e-13, tolerance=1e-10)])
    nan = copy.deepcopy(base)
    nan["rows"][0].update(value=math.nan, passed=False)  # NaN fails every bound (Tolerance.passes)
    assert compare_runs(base, nan).regressed


def test_every_row_says_its_claim() -> None:
    from harness.report import Row

    with pytest.raises(ClaimError, match="must say what it claims"):
        Row(suite="s", test="t", layout="", metric="m", value=1.0, tolerance=None, passed=True, claim="maybe")
    with pytest.raises(TypeError):
        Row(suite="s", test="t", layout="", metric="m", value=1.0, tolerance=None, passed=True)  # noqa
    assert set(CLAIMS) == {"exact", "bounded", "control", "timing", "observed"}


# ------------------------------------------------------------------ legacy runs and fingerprints
def test_a_schema_1_run_loads_with_inferred_claims() -> None:
    test = nodeid("test_variant_is_caught", "cpu-x")
    rows = [dict(row(test, m, v, tolerance=t, passed=p)) for m, v, t, p in
            [("save_s", 0.5, None, True), ("separation", 9.0, 3.0, True), ("reward_mean", 0.5, None, True),
             ("max_abs", 0.05, 1e-5, False), ("export_mismatched_tensors", 0.0, 0, True), ("max_abs", 1e-6, 1e-5, True)]]
    for r in rows:
        del r["claim"]
    old = dict(make_run(rows), schema_version=1)
    assert [infer_legacy(r) for r in rows] == ["timing", "control", "observed", "observed", "exact", "bounded"]
    result = compare_runs(old, old)
    assert not result.regressed and result.unchanged == len(rows)


def test_rows_of_another_bridge_never_pair_up(baseline) -> None:
    """A row's bridge (the megatron-core line it ran on) is part of its key: the same test on
    Megatron-Bridge is a new row against an mbridge baseline, not a moved figure. Rows written before
    the column existed take the bridge their run's fingerprint lists."""
    old = copy.deepcopy(baseline)
    old["meta"]["fingerprint"]["mbridge"] = "0.15.1"
    for r in old["rows"]:
        r.pop("bridge", None)
    same = copy.deepcopy(baseline)
    for r in same["rows"]:
        r["bridge"] = "mbridge"
    assert compare_runs(old, same).unchanged == len(same["rows"])
    other = copy.deepcopy(same)
    for r in other["rows"]:
        r["bridge"] = "megatron-bridge"
    result = compare_runs(old, other)
    assert result.unchanged == 0 and len(result.new) == len(result.missing) == len(other["rows"])


def test_the_committed_baseline_loads_and_compares_with_itself() -> None:
    committed = REPO / "reports" / "baselines" / "cpu"
    result = compare_runs(committed, committed)
    assert not result.regressed and not result.fingerprint_changes and result.unchanged > 1000


def test_fingerprints_that_change_arithmetic_are_printed(baseline) -> None:
    base = copy.deepcopy(baseline)
    base["meta"]["fingerprint"].update(cpu_model="Intel Xeon", cpu_flags=["avx2", "fma"], torch_threads=2)
    current = copy.deepcopy(baseline)
    current["meta"]["fingerprint"].update(cpu_model="AMD EPYC", cpu_flags=["avx2", "fma", "avx512f"],
                                          torch_threads=2, host="elsewhere")
    result = compare_runs(base, current)
    assert [k for k, _, _ in result.fingerprint_changes] == ["cpu_model", "cpu_flags"]  # not the host
    text = result.to_markdown()
    assert "fingerprints differ in what changes arithmetic" in text and "| cpu_model | Intel Xeon | AMD EPYC |" in text
    assert not result.regressed


# ------------------------------------------------------------------ joining and listing
def test_new_and_missing_rows_are_listed_not_dropped(baseline: dict[str, Any]) -> None:
    current = copy.deepcopy(baseline)
    gone = current["rows"].pop(0)
    added = row(nodeid("test_megatron_logprobs_match_hf", "cpu-tp4-tiny-qwen3-fp32"), "max_abs", 2e-6,
                layout="tp4")
    current["rows"].append(added)
    result = compare_runs(baseline, current)
    assert result.missing == [gone] and result.new == [added]
    assert not result.regressed  # a subset run is legitimate; the listing says what changed
    text = result.to_markdown()
    assert "cpu-tp4-tiny-qwen3-fp32" in text.split("### New rows")[1]
    assert gone["test"] in text.split("### Missing rows")[1]
    current["rows"] += [dict(added, metric=f"m{i}") for i in range(5)]
    capped = compare_runs(baseline, current).to_markdown(max_rows=2)
    assert "### New rows (only in current) (6)" in capped and "... 4 more (run `compare`" in capped


def test_regressions_come_first_in_markdown(baseline: dict[str, Any]) -> None:
    current = copy.deepcopy(baseline)
    find(current, "max_abs").update(value=1.9e-5, passed=False)
    find(current, "kl_k3", layout="pp2").update(value=1e-9, passed=False)
    current["rows"].pop()  # missing
    current["rows"].append(row(nodeid("test_new", "cpu"), "max_abs", 1e-6))  # new
    text = compare_runs(baseline, current).to_markdown()
    order = [text.index(h) for h in ("### Regressions (2)", "### New rows (only in current) (1)",
                                     "### Missing rows (only in baseline) (1)")]
    assert order == sorted(order)


def test_key_includes_variant_and_duplicates_pair_in_order() -> None:
    test = nodeid("test_negative_control", "cpu")
    rows = [row(test, "max_abs", 1.0, extra={"variant": "a"}), row(test, "max_abs", 2.0, extra={"variant": "b"}),
            row(test, "max_abs", 1e-6), row(test, "max_abs", 2e-6)]  # last two: identical keys
    assert row_key(rows[0]) != row_key(rows[1]) and row_key(rows[2]) == row_key(rows[3])
    swapped = [rows[1], rows[0], rows[2], dict(rows[3], value=2e-3, passed=False)]
    result = compare_runs(make_run(rows), make_run(swapped))
    assert [c.current["value"] for c in result.regressions] == [2e-3]  # 2nd occurrence vs 2nd
    assert result.unchanged == 3 and not result.new and not result.missing


def test_a_test_that_stops_passing_is_a_regression(baseline: dict[str, Any]) -> None:
    current = copy.deepcopy(baseline)
    crashed = current["tests"][0]
    crashed.update(outcome="error", message="RuntimeError: NCCL\nError 1")
    result = compare_runs(baseline, current)
    assert [t.nodeid for t in result.tests_regressed] == [crashed["nodeid"]]
    assert result.tests_regressed[0].message == "RuntimeError: NCCL Error 1"


def test_generated_rows_are_listed_never_paired() -> None:
    """Rows of a hypothesis test come from examples that differ between runs."""
    test = nodeid("test_parity_holds_on_generated_batches", "cpu")
    fixed = row(nodeid("test_x", "cpu"), "max_abs", 1e-6)
    base = make_run([fixed] + [row(test, "max_abs", v, extra={"generated": True}) for v in (1e-7, 2e-6)])
    current = make_run([fixed] + [row(test, "max_abs", v, extra={"generated": True}) for v in (9e-6, 3e-7, 1e-6)])
    result = compare_runs(base, current)
    assert not result.regressed and result.unchanged == 1
    assert [r["value"] for r in result.new] == [9e-6, 3e-7, 1e-6] and [r["value"] for r in result.missing] == [1e-7, 2e-6]


def test_unreadable_input_exits_2_with_one_message(tmp_path: Path, baseline: dict[str, Any], capsys) -> None:
    good = write_run(tmp_path / "good", baseline)
    assert main_compare([str(tmp_path / "nope"), str(good)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mrh report compare: cannot read the baseline run:")
    assert "no such file" in err[0]
    future = write_run(tmp_path / "future", dict(baseline, schema_version=7))
    assert main_compare([str(good), str(future)]) == 2
    assert "schema_version 7 is unknown" in capsys.readouterr().err
    assert main_compare([str(good)]) == 2  # argparse usage error
    assert "usage: mrh report compare" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- rules
def test_rule_table() -> None:
    assert rule_for("max_abs").direction == "lower_is_better"
    assert rule_for("top1_agreement").direction == "higher_is_better"
    assert rule_for("separation").direction == "higher_is_better"
    assert rule_for("peak_bytes").metric_pattern == "*bytes*"  # not the *_s time rule
    assert rule_for("step_s").metric_pattern == "*_s"
    assert rule_for("next_loss_rel_diff").metric_pattern == "*_rel_diff"
    assert rule_for("next_param_max_abs_diff").metric_pattern == "*max_abs_diff"
    fallback = rule_for("something_new")
    assert fallback.metric_pattern == "*" and RULES[-1] is fallback and all(r.why for r in RULES)
    assert rule_for("top1_agreement").worse(0.99, 0.98) and not rule_for("max_abs").worse(2e-6, 1e-6)
