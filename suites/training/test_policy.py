"""The Megatron policy worker (DDP + DistributedOptimizer) trains exactly like the ground truth.

Two steps on tiny-qwen3 in fp32 (clip 1.0, lr 1e-3, 2 micro-batches per DP rank) under each
layout: loss and pre-clip grad norm equal to `GroundTruthTrainer` (rel 1e-5), every updated
tensor equal (max |diff| <= 1e-5). Catches unscaled / double-averaged gradients (micro-batch count,
DP averaging), missing finalize_model_grads (DP all-reduce, tied/embedding grads under PP), and a
wrong optimizer or parameter grouping.
"""
from __future__ import annotations

import functools

import pytest
import torch

from harness.logprobs import hf_logprobs
from harness.models import TINY_VOCAB_SIZE, build_hf_model
from harness.parallel.layout import LayoutError
from harness.training import GroundTruthTrainer, make_rl_train_batch
from harness.training.tolerances import training_tolerance

MODEL = "tiny-qwen3"
PROMPTS = [5, 3, 7, 1, 10, 2, 12, 4]
RESPONSES = [19, 9, 10, 23, 4, 13, 1, 16]
STEPS = 2
# Adam eps 1e-6, not 1e-8: Adam's update lr * m / (sqrt(v) + eps) is ill-conditioned for the few
# elements whose gradient is ~eps (1e4x below the median): there, fp32 reduction-order noise from
# TP-split matmuls (relative ~1e-3 on a cancelling 1e-8 gradient) moves the update by up to ~2e-5
# at eps 1e-8 (measured at TP2: 2.3e-5 on 1 element of 8192, loss and grad norm within 1.3e-6).
# eps 1e-6 bounds that sensitivity (d update / d g <= lr / eps) without changing anything else.
OPTIM = dict(lr=1e-3, weight_decay=0.01, clip_grad=1.0, eps=1e-6)
LOSS = dict(kl_coef=0.05, clip_eps_high=0.28, aggregation="token-mean")


@functools.lru_cache(maxsize=2)
def _reference(model_name: str = MODEL):
    """(batches, ground-truth step results, final HF state dict): computed once per session."""
    model = build_hf_model(model_name, dtype=torch.float32, seed=0)
    tb = make_rl_train_batch(TINY_VOCAB_SIZE, batch_size=8, seed=0, prompt_lengths=PROMPTS,
                             response_lengths=RESPONSES)
    # On-policy old logprobs, perturbed so that both clipping branches occur in step 2.
    with torch.no_grad():
        tb = tb.with_old_logprobs(hf_logprobs(model, tb.batch) + 0.02 * tb.advantages.sign())
    trainer = GroundTruthTrainer(model, **OPTIM, **LOSS)
    results = [trainer.step(tb, micro_batches=2) for _ in range(STEPS)]
    state = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return [tb] * STEPS, results, state


def _check(policy, layout, report, **kwargs):
    """Assert the Megatron steps equal the ground truth (see `_compare`)."""
    failures = _compare(policy, layout, report, **kwargs)
    assert not failures, "; ".join(failures)


def _compare(policy, layout, report, micro_batches=2, variant=None, model=MODEL, dtype="fp32",
             world_size=None) -> list[str]:
    """Every way the Megatron steps differ from the ground truth (empty when they match)."""
    batches, expected, ref_state = _reference(model)
    try:
        worker = policy(layout, model, world_size=world_size, **OPTIM, micro_batches=micro_batches,
                        loss_kwargs=LOSS, variant=variant, dtype=dtype)
    except LayoutError as exc:  # e.g. pp4vpp2 on a 4-layer model: not a valid layout
        pytest.skip(str(exc).replace("\n", " "))
    steps = worker.steps(batches)
    state = worker.hf_state_dict()
    layout = str(worker.layout)
    rows = dict(layout=layout, dtype=dtype, micro_batches=micro_batches, variant=variant, model=model)
    failures = []
    for i, (got, want) in enumerate(zip(steps, expected)):
        # The per-micro-batch losses are the pieces of the global loss, one per (dp rank, index).
        assert len(got["micro_batches"]) == micro_batches * worker.layout.dp
        assert sum(m["loss"] for m in got["micro_batches"]) == pytest.approx(got["loss"], rel=1e-9, abs=1e-12)
        for key in ("loss", "grad_norm"):
            # Relative to max(|value|, 1): the surrogate is a mean of +-ratio * A terms with
            # |A| ~ N(0, 1), which cancel to ~0.01, so a plain relative diff would amplify fp32
            # noise ~100x (TP2 step 2: |diff| 1.7e-7 on a loss of 0.0122).
            rel = abs(got[key] - want[key]) / max(abs(want[key]), 1.0)
            bound = training_tolerance(f"{key}_rel_diff", dtype)
            ok = bound.passes(rel)
            report.add(f"{key}_rel_diff", rel, tolerance=bound.limit, passed=ok, step=i, **rows)
            if not ok:
                failures.append(f"step {i} {key}: megatron {got[key]!r} vs ground truth {want[key]!r}")
        if got["lr"] != pytest.approx(want["lr"], rel=1e-12):
            failures.append(f"step {i} lr: {got['lr']} vs {want['lr']}")
    if "lm_head.weight" not in state and torch.equal(ref_state["lm_head.weight"], ref_state["model.embed_tokens.weight"]):
        # Tied: HF's state dict lists the shared tensor twice, the export (like the checkpoint) once.
        ref_state = {n: t for n, t in ref_state.items() if n != "lm_head.weight"}
    missing = sorted(set(ref_state) ^ set(state))
    assert not missing, f"state dict keys differ: {missing}"
    worst_name, worst = "", 0.0
    for name, want in ref_state.items():
        diff = (state[name].float() - want.float()).abs().max().item()
        if diff > worst:
            worst_name, worst = name, diff
    bound = training_tolerance("param_max_abs_diff", dtype)
    ok = bound.passes(worst)
    report.add("param_max_abs_diff", worst, tolerance=bound.limit, passed=ok, tensor=worst_name, **rows)
    if not ok:
        failures.append(f"params: max |diff| {worst:.3g} at {worst_name}")
    # The step must actually have moved the weights (else equality proves nothing).
    moved = max((state[n].float() - p.float()).abs().max().item()
                for n, p in build_hf_model(model, dtype=torch.float32, seed=0).state_dict().items()
                if n in state)
    assert moved > 100 * training_tolerance("param_max_abs_diff", "fp32").limit, \
        f"weights barely moved ({moved:.3g})"
    return failures


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


@pytest.mark.upstream
@pytest.mark.parametrize("variant", ["no-finalize-grads", "grad-times-microbatches"])
def test_upstream_bug_variant_is_detected(policy, device, variant, report):
    """Each shipped upstream bug makes the comparison fail (and the fixed worker passes above)."""
    failures = _compare(policy, "dp2", report, micro_batches=2, variant=variant)
    assert any("grad_norm" in f for f in failures), f"variant {variant} went unnoticed: {failures}"


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
