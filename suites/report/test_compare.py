"""Tests for harness.report.compare and harness.report.rules: regressions by rule and direction,
passed flips, new/missing rows, duplicate keys, and the CLI's exit codes."""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest

from harness.report.compare import compare_runs, main_compare, row_key
from harness.report.rules import RULES, rule_for
from suites.report.runs import make_run, nodeid, parity_rows, row, write_run


@pytest.fixture
def baseline() -> dict[str, Any]:
    return make_run(parity_rows())


def find(run: dict[str, Any], metric: str, layout: str = "tp2", model: str = "tiny-qwen3",
         dtype: str = "fp32") -> dict[str, Any]:
    return next(r for r in run["rows"] if (r["metric"], r["layout"], r["model"], r["dtype"])
                == (metric, layout, model, dtype))


def test_identical_runs_pass(tmp_path: Path, baseline: dict[str, Any], capsys) -> None:
    result = compare_runs(baseline, copy.deepcopy(baseline))
    assert not result.regressed and result.unchanged == len(baseline["rows"])
    assert not (result.regressions or result.improvements or result.new or result.missing)
    a, b = write_run(tmp_path / "a", baseline), write_run(tmp_path / "b", baseline)
    assert main_compare([str(a), str(b / "results.json")]) == 0  # a dir and a results.json path
    assert "**no regression**" in capsys.readouterr().out


def test_max_abs_times_ten_is_a_named_regression(tmp_path: Path, baseline: dict[str, Any], capsys) -> None:
    current = copy.deepcopy(baseline)
    find(current, "max_abs")["value"] *= 10  # 1.9e-6 -> 1.9e-5: still "passed" as recorded
    result = compare_runs(baseline, current)
    assert result.regressed and len(result.regressions) == 1
    change = result.regressions[0]
    assert change.current["test"] == nodeid("test_megatron_logprobs_match_hf", "cpu-tp2-tiny-qwen3-fp32")
    assert change.delta == pytest.approx(1.9e-5 - 1.9e-6)
    assert "worse by" in change.reasons[0] and "lower_is_better" in change.reasons[0]
    md_path = tmp_path / "out" / "compare.md"
    code = main_compare([str(write_run(tmp_path / "a", baseline)), str(write_run(tmp_path / "b", current)),
                         "--markdown", str(md_path)])
    assert code == 1
    out = capsys.readouterr().out
    assert "**REGRESSED**: 1 rows regressed" in out
    regression_line = next(l for l in out.splitlines() if "cpu-tp2-tiny-qwen3-fp32" in l)
    assert "| max_abs | tp2 | tiny-qwen3 | fp32 | cpu |" in regression_line
    assert "| 1.9e-06 | 1.9e-05 |" in regression_line
    assert out == md_path.read_text() + "\n"  # the file holds exactly what was printed


def test_regressions_come_first_in_markdown(baseline: dict[str, Any]) -> None:
    current = copy.deepcopy(baseline)
    find(current, "max_abs")["value"] *= 10
    find(current, "top1_agreement", dtype="bf16")["value"] = 1.0  # no change (already 1.0)
    find(current, "mean_abs", layout="pp2")["value"] = 0.0  # improvement below the floor? 5e-7 -> 0
    find(current, "kl_k3", layout="pp2")["value"] = 1e-9  # 2e-13 -> 1e-9: regression past the floor
    current["rows"].pop()  # missing
    current["rows"].append(row(nodeid("test_new", "cpu"), "max_abs", 1e-6))  # new
    text = compare_runs(baseline, current).to_markdown()
    order = [text.index(h) for h in ("### Regressions (2)", "### New rows (only in current) (1)",
                                     "### Missing rows (only in baseline) (1)")]
    assert order == sorted(order)
    assert "Improvements" not in text  # 5e-7 -> 0 is within mean_abs's floor (1e-6)


def test_noise_below_the_floor_is_not_flagged(baseline: dict[str, Any]) -> None:
    current = copy.deepcopy(baseline)
    find(current, "max_abs")["value"] = 3.8e-6  # one fp32 ulp more: "2x worse", but noise
    find(current, "mean_abs")["value"] = 9e-7
    result = compare_runs(baseline, current)
    assert not result.regressed and not result.improvements


def test_passed_true_to_false_is_a_regression(baseline: dict[str, Any]) -> None:
    current = copy.deepcopy(baseline)
    flipped = find(current, "top1_agreement")
    flipped["passed"] = False  # same value, but e.g. the tolerance was tightened
    result = compare_runs(baseline, current)
    assert result.regressed and [c.current for c in result.regressions] == [flipped]
    assert result.regressions[0].reasons == ["passed → failed (tolerance 0.99)"]  # fp32 top-1 bound
    back = compare_runs(current, baseline)  # and the reverse is an improvement
    assert not back.regressed and back.improvements[0].reasons == ["failed → passed"]


def test_direction_is_respected(baseline: dict[str, Any]) -> None:
    base = copy.deepcopy(baseline)
    find(base, "top1_agreement")["value"] = 0.9
    up = copy.deepcopy(base)
    find(up, "top1_agreement")["value"] = 0.97
    result = compare_runs(base, up)
    assert not result.regressed and len(result.improvements) == 1
    assert result.improvements[0].reasons[0].startswith("better by 0.07")
    down = copy.deepcopy(base)
    find(down, "top1_agreement")["value"] = 0.85
    assert compare_runs(base, down).regressed
    small = copy.deepcopy(base)
    find(small, "top1_agreement")["value"] = 0.89  # within the 0.02 allowance
    assert compare_runs(base, small).unchanged == len(base["rows"])


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


def test_key_includes_variant_and_duplicates_pair_in_order() -> None:
    test = nodeid("test_negative_control", "cpu")
    rows = [row(test, "max_abs", 1.0, extra={"variant": "a"}), row(test, "max_abs", 2.0, extra={"variant": "b"}),
            row(test, "max_abs", 1e-6), row(test, "max_abs", 2e-6)]  # last two: identical keys
    assert row_key(rows[0]) != row_key(rows[1]) and row_key(rows[2]) == row_key(rows[3])
    swapped = [rows[1], rows[0], rows[2], dict(rows[3], value=2e-3)]
    result = compare_runs(make_run(rows), make_run(swapped))
    assert [c.current["value"] for c in result.regressions] == [2e-3]  # 2nd occurrence vs 2nd
    assert result.unchanged == 3 and not result.new and not result.missing


def test_test_that_stops_passing_and_nan_are_regressions(baseline: dict[str, Any]) -> None:
    current = copy.deepcopy(baseline)
    crashed = current["tests"][0]
    crashed.update(outcome="error", message="RuntimeError: NCCL\nError 1")
    find(current, "kl_k3", layout="pp2")["value"] = math.nan
    result = compare_runs(baseline, current)
    assert [t.nodeid for t in result.tests_regressed] == [crashed["nodeid"]]
    assert result.tests_regressed[0].message == "RuntimeError: NCCL Error 1"
    assert [c.reasons for c in result.regressions] == [["became NaN"]]


def test_unreadable_input_exits_2_with_one_message(tmp_path: Path, baseline: dict[str, Any], capsys) -> None:
    good = write_run(tmp_path / "good", baseline)
    assert main_compare([str(tmp_path / "nope"), str(good)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mrh compare: cannot read the baseline run:")
    assert "no such file" in err[0]
    future = write_run(tmp_path / "future", dict(baseline, schema_version=7))
    assert main_compare([str(good), str(future)]) == 2
    assert "schema_version 7 is unknown" in capsys.readouterr().err
    assert main_compare([str(good)]) == 2  # argparse usage error


# ----------------------------------------------------------------------------------------- rules
def test_rule_table() -> None:
    assert rule_for("max_abs").direction == "lower_is_better" and rule_for("max_abs").kind == "rel"
    assert rule_for("top1_agreement").direction == "higher_is_better"
    assert rule_for("token_mult_prob_error").kind == "abs"
    assert rule_for("peak_bytes").metric_pattern == "*bytes*"  # not the *_s time rule
    assert rule_for("weight_sync_blocking_s_p50").metric_pattern == "*blocking_s*"
    assert rule_for("step_s").metric_pattern == "*_s"
    fallback = rule_for("something_new")
    assert fallback.metric_pattern == "*" and fallback.direction == "equal"
    assert RULES[-1] is fallback and all(r.why for r in RULES)
    assert rule_for("max_abs").allowed(1e-9) == rule_for("max_abs").floor  # floor wins near 0
    assert rule_for("step_s").allowed(10.0) == pytest.approx(2.5)


def test_equal_metrics_flag_any_change() -> None:
    base = make_run([row(nodeid("t", "cpu"), "num_layers", 4.0)])
    changed = make_run([row(nodeid("t", "cpu"), "num_layers", 5.0)])
    result = compare_runs(base, changed)
    assert result.regressed and result.regressions[0].reasons[0].startswith("changed by 1")
    assert not compare_runs(changed, base).improvements  # "equal" has no better direction


# ------------------------------------------------------------- another machine, same code (CI)
def test_another_machines_rounding_is_not_a_regression(baseline: dict[str, Any]) -> None:
    """bf16 values move with the machine's kernels: a quarter of a row's room to its own bound is
    allowed; an fp32 value near its bound gets no such room."""
    base = copy.deepcopy(baseline)
    find(base, "max_abs", dtype="bf16")["value"] = 0.05  # bound 0.2: room 0.15, allowed 0.0375
    find(base, "top1_agreement", dtype="bf16")["value"] = 0.96  # bound 0.9: room 0.06
    find(base, "max_abs")["value"] = 9e-6  # fp32 bound 1e-5: room 1e-6 adds nothing; rel 0.5 decides
    other_cpu = copy.deepcopy(base)
    find(other_cpu, "max_abs", dtype="bf16")["value"] = 0.085  # past rel 0.5 (0.025), within the room
    find(other_cpu, "top1_agreement", dtype="bf16")["value"] = 0.945
    find(other_cpu, "max_abs")["value"] = 9.9e-6
    result = compare_runs(base, other_cpu)
    assert not result.regressed and result.unchanged == len(base["rows"])
    worse = copy.deepcopy(base)
    find(worse, "max_abs", dtype="bf16")["value"] = 0.15
    find(worse, "top1_agreement", dtype="bf16")["value"] = 0.93  # past 0.02 and a quarter of 0.06
    find(worse, "max_abs")["value"] = 1.4e-5  # 5e-6 worse > 4.5e-6 allowed
    assert sorted((c.current["metric"], c.current["dtype"]) for c in compare_runs(base, worse).regressions) == [
        ("max_abs", "bf16"), ("max_abs", "fp32"), ("top1_agreement", "bf16")]


def test_wall_times_are_listed_but_never_gate() -> None:
    test = nodeid("test_resume", "cpu-tp2-to-pp2")
    base = make_run([row(test, "save_s", 0.5, tolerance=None, units="s"),
                     row(test, "load_s", 0.4, tolerance=None, units="s")])
    slower = copy.deepcopy(base)
    slower["rows"][0]["value"] = 1.5  # 3x: another machine, or a loaded one
    result = compare_runs(base, slower)
    assert not result.regressed and [c.current["metric"] for c in result.ungated] == ["save_s"]
    text = result.to_markdown()
    assert "**no regression**" in text and "### Worse, not gating (machine-dependent: wall times) (1)" in text
    slower["rows"][1]["passed"] = False  # a timing the test itself bounded and missed still gates
    assert [c.current["metric"] for c in compare_runs(base, slower).regressions] == ["load_s"]


def test_generated_rows_are_listed_never_paired() -> None:
    """Rows of a hypothesis test come from examples that differ between runs."""
    test = nodeid("test_parity_holds_on_generated_batches", "cpu")
    fixed = row(nodeid("test_x", "cpu"), "max_abs", 1e-6)
    base = make_run([fixed] + [row(test, "max_abs", v, extra={"generated": True}) for v in (1e-7, 2e-6)])
    current = make_run([fixed] + [row(test, "max_abs", v, extra={"generated": True}) for v in (9e-6, 3e-7, 1e-6)])
    result = compare_runs(base, current)
    assert not result.regressed and result.unchanged == 1
    assert [r["value"] for r in result.new] == [9e-6, 3e-7, 1e-6] and [r["value"] for r in result.missing] == [1e-7, 2e-6]
    old_baseline = make_run([fixed] + [row(test, "max_abs", 1e-7)])  # recorded before rows were marked
    assert compare_runs(old_baseline, current).missing[0]["value"] == 1e-7


def test_training_and_checkpoint_metrics_tolerate_noise_not_bugs() -> None:
    test = nodeid("test_policy_matches_ground_truth", "cpu-tp2-fp32")
    base = make_run([row(test, "loss_rel_diff", 1e-7), row(test, "grad_norm_rel_diff", 1.3e-6),
                     row(test, "param_max_abs_diff", 3e-6), row(test, "tensors_differing", 0.0, tolerance=0)])
    noise = copy.deepcopy(base)
    for r, v in zip(noise["rows"], (9e-7, 2e-6, 4.5e-6, 0.0)):
        r["value"] = v
    assert not compare_runs(base, noise).regressed
    bug = copy.deepcopy(base)
    for r, v in zip(bug["rows"], (3e-6, 2e-5, 9e-6, 1.0)):
        r["value"] = v
    assert [c.current["metric"] for c in compare_runs(base, bug).regressions] == [
        "loss_rel_diff", "grad_norm_rel_diff", "param_max_abs_diff", "tensors_differing"]


def test_rules_room_and_gating() -> None:
    rule = rule_for("max_abs")
    assert rule.allowed(0.05, 0.4) == pytest.approx(0.0875) and rule.allowed(0.05) == pytest.approx(0.025)
    assert rule.allowed(0.5, 0.4) == pytest.approx(0.25)  # past its bound: no room
    assert rule_for("top1_agreement").room(0.96, 0.9) == pytest.approx(0.06)
    assert rule_for("num_layers").room(4.0, 1.0) == 0.0  # "equal" metrics have no room
    assert not rule_for("save_s").gating and not rule_for("weight_sync_blocking_s").gating
    # A negative control's margin gates in its own test (>= 3), never in compare.
    assert not rule_for("separation").gating and rule_for("separation").direction == "higher_is_better"
    assert all(r.gating for r in RULES if not r.metric_pattern.endswith("_s") and "blocking_s" not in r.metric_pattern
               and r.metric_pattern != "separation")
    assert rule_for("next_loss_rel_diff").metric_pattern == "*_rel_diff"
    assert rule_for("next_param_max_abs_diff").metric_pattern == "*max_abs_diff"
