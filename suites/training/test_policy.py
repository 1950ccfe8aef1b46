"""The Megatron policy worker (DDP + DistributedOptimizer) trains exactly like the ground truth.

Two steps on tiny-qwen3 in fp32 (clip 1.0, lr 1e-3, 2 micro-batches per DP rank) under each
layout: loss and pre-clip grad norm equal to `GroundTruthTrainer` (rel 1e-5), every updated
tensor equal (max |diff| <= 1e-5). Catches unscaled / double-averaged gradients (micro-batch count,
DP averaging), missing finalize_model_grads (DP all-reduce, tied/embedding grads under PP), and a
wrong optimizer or parameter grouping.
"""
from __future__ import annotations

import pytest

from harness.pytest_plugin.worlds import skip_invalid_layout, skip_unless_converted
from harness.training.invariance import LOSS, MODEL, OPTIM, compare_to_ground_truth, ground_truth, ground_truth_moved, \
    policy_config
from harness.training.tolerances import training_tolerance


def _check(policy, layout, report, **kwargs):
    """Assert the Megatron steps equal the ground truth (harness.training.invariance)."""
    result = _compare(policy, layout, report, **kwargs)
    assert result.passed, result.summary()


def _compare(policy, layout, report, micro_batches=2, variant=None, model=MODEL, dtype="fp32",
             world_size=None, loss=LOSS, lr=OPTIM["lr"], truth_weights="fp32", loss_within_hf_bf16=False):
    # The micro-batches the layout's schedule takes, so a layout the model cannot take (pp4vpp2 on 4 layers)
    # reaches the model's check and skips, rather than failing on the count first.
    config = policy_config(micro_batches=micro_batches, dtype=dtype, variant=variant, loss=loss, layout=layout, lr=lr)
    micro_batches = config["micro_batches"]
    with skip_invalid_layout():  # e.g. pp4vpp2 on a 4-layer model
        worker = policy(layout, model, world_size=world_size, **config)
    result = compare_to_ground_truth(worker, model=model, truth_weights=truth_weights,
                                     loss_within_hf_bf16=loss_within_hf_bf16)
    report.extend(result.rows(model, micro_batches=micro_batches, **({} if loss is LOSS else {"loss": "unclipped"}),
                              **({} if truth_weights == "fp32" else {"truth_weights": truth_weights})))
    for got in result.steps:
        assert sum(m["loss"] for m in got["micro_batches"]) == pytest.approx(got["loss"], rel=1e-9, abs=1e-12)
    # The steps must move the model far past the bounds (else equality proves nothing): the ground truth's
    # weights by >= 10x the weight bound (two steps move a weight by up to 2 lr: 2e-3 at the default lr), or,
    # at the -shape models' lr (1e-6: 2e-6, below it), its second step's loss by >= 10x the loss bound from
    # its first, which a policy that did not update would repeat.
    moved = ground_truth_moved(model, loss, lr, truth_weights)
    _, truth, _ = ground_truth(model, loss, lr, truth_weights)
    loss_moved = abs(truth[1]["loss"] - truth[0]["loss"]) / max(abs(truth[0]["loss"]), 1.0)
    assert moved > 10 * training_tolerance("param_max_abs_diff", "fp32").limit or \
        loss_moved > 10 * training_tolerance("loss_rel_diff", "fp32").limit, \
        f"the steps barely moved the model (weights {moved:.3g}, loss {loss_moved:.3g})"
    return result


# CPU: the layouts (2 ranks; tp2pp2 below). GPU: every valid layout of the machine's GPUs.
@pytest.mark.layouts(cpu=["dp2", "tp2", "pp2"], cuda="all")
def test_policy_steps_match_ground_truth(policy, device, layout, report):
    _check(policy, layout, report)


@pytest.mark.layouts(cpu=["tp1"])
def test_policy_steps_match_ground_truth_single_rank(policy, device, layout, report):
    _check(policy, layout, report)


@pytest.mark.layouts(cpu=["tp2pp2"], cuda=["tp2pp2"])
def test_policy_steps_match_ground_truth_tp2pp2(policy, device, layout, report):
    _check(policy, layout, report)


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_micro_batch_count_does_not_change_training(policy, device, micro_batches, report):
    """NeMo-RL PR 1426's invariant: loss, grad norm and update independent of micro-batching."""
    _check(policy, "dp2", report, micro_batches=micro_batches)


def test_tied_embeddings_stay_identical_under_pp(policy, device, report):
    """mbridge PR 14's territory: with tied embeddings at PP=2 the last stage trains its own copy
    of the embedding; Megatron all-reduces the two copies' gradients. The export raises if the
    copies differ, and the trained weights must still equal the single-process ground truth."""
    _check(policy, "pp2", report, model="tiny-qwen3-tied")


# bf16 weights (fp32 main params, grads reduced in fp32) against the fp32 ground truth: the
# differences are bf16 rounding, bounded by the measured bf16 rows of the training tolerance table.
@pytest.mark.layouts(cpu=["tp2", "pp2"], cuda="all")
def test_bf16_policy_steps_track_the_ground_truth(policy, device, layout, report):
    _check(policy, layout, report, dtype="bf16")


# The same against the ground truth that runs its forward on its fp32 weights rounded to bf16, as Megatron runs
# its bf16 copy of the fp32 main params (harness.training.ground_truth, "Weights"): what the -shape models take
# at RL's lr, where an update is below bf16's spacing (suites/models/test_shapes.py).
@pytest.mark.layouts(cpu=["tp2"], cuda=["tp1", "tp2"])
def test_bf16_policy_steps_track_the_bf16_weights_ground_truth(policy, device, layout, report):
    _check(policy, layout, report, dtype="bf16", truth_weights="bf16")


# Context parallelism (issue 36): every sequence split over the CP ranks, against the same fp32 ground
# truth. TE's CP attention on CUDA runs bf16 only (harness.parallel.layout.check_backend): the bf16
# bounds; the local spec's gathered-kv attention (harness.parallel.cp_attention) runs fp32: the fp32 ones.
@pytest.mark.layouts(cuda=["cp2", "cp2tp2", "cp2tp2-sp", "cp2dp2", "cp4"])
def test_bf16_policy_steps_under_context_parallelism_track_the_ground_truth(policy, device, spec, layout, report):
    if spec != "te":
        pytest.skip("TE's CP attention (the local spec's: test_policy_steps_under_cp_on_the_local_spec...)")
    _check(policy, layout, report, dtype="bf16")


@pytest.mark.layouts(cpu=["cp2", *(pytest.param(name, marks=pytest.mark.nightly)
                                  for name in ("cp2tp2", "cp2tp2-sp", "cp2dp2", "cp4"))], cuda=["cp2"])
def test_policy_steps_under_cp_on_the_local_spec_match_ground_truth(policy, device, spec, layout, report):
    if spec != "local":
        pytest.skip("the local spec's CP attention (TE's: the bf16 test above)")
    _check(policy, layout, report)


# Gemma 3 text (issue 37; stack A only: refused by name on Megatron-Bridge 0.6.2). Its pieces train too:
# the zero-centered norms' w (their grads reduced over TP where partial: QK-norm, sequence parallelism),
# the post-norms inside linear_proj / linear_fc2, the tied embedding under PP with its scale. CI: tp2;
# nightly every other layout and bf16.
GEMMA3 = "tiny-gemma3"


def _gemma3(policy, layout, report, **kwargs):

    skip_unless_converted(GEMMA3)
    if policy.spec != "local":
        pytest.skip("harness.bridge.gemma3 builds Gemma 3 on the local spec only (docs/gemma3.md)")
    _check(policy, layout, report, model=GEMMA3, **kwargs)


@pytest.mark.layouts(cpu=["tp2"], cuda=["tp2"])
def test_gemma3_policy_steps_match_ground_truth(policy, device, layout, report):
    _gemma3(policy, layout, report)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "dp2", "pp2", "tp2-sp", "tp2pp2"], cuda="all")
def test_gemma3_policy_steps_match_ground_truth_at_every_layout(policy, device, layout, report):
    _gemma3(policy, layout, report)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp2", "pp2"], cuda="all")
def test_gemma3_bf16_policy_steps_track_the_ground_truth(policy, device, layout, report):
    _gemma3(policy, layout, report, dtype="bf16")
