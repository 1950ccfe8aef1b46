"""The single-process ground-truth trainer and the training batch it consumes.

Gradient accumulation must be invisible: 1, 2 or 4 micro-batches give the same loss, grad norm
and updated weights (the loss is normalised by global counts). A step must actually train, the
LR schedule must be Megatron's, and the batch must not depend on how it is split.
"""
from __future__ import annotations

import math

import pytest
import torch

from harness.logprobs import hf_logprobs
from harness.models import TINY_VOCAB_SIZE, build_hf_model
from harness.training import (
    AGGREGATIONS,
    GroundTruthTrainer,
    concat_train_batches,
    make_rl_train_batch,
    megatron_lr_lambda,
    policy_logprobs,
)

PROMPTS = [5, 3, 7, 1, 10, 2, 12, 4]
RESPONSES = [19, 9, 10, 23, 4, 13, 1, 16]


def _train_batch(seed=0, **kwargs):
    return make_rl_train_batch(TINY_VOCAB_SIZE, batch_size=8, seed=seed, prompt_lengths=PROMPTS,
                               response_lengths=RESPONSES, **kwargs)


def _fields(tb):
    return [tb.batch.input_ids, tb.batch.attention_mask, tb.batch.response_mask,
            tb.advantages, tb.old_logprobs, tb.ref_logprobs]


# ---- the batch --------------------------------------------------------------------------------
def test_batch_is_deterministic_and_well_formed():
    tb = _train_batch()
    for a, b in zip(_fields(tb), _fields(_train_batch())):
        assert torch.equal(a, b)
    assert not torch.equal(tb.advantages, _train_batch(seed=1).advantages)
    assert set(tb.batch.padding_sides()) == {"left", "right", "none"}
    mask = tb.loss_mask()
    for name in ("advantages", "old_logprobs", "ref_logprobs"):
        value = getattr(tb, name)
        assert value.dtype == torch.float32
        assert bool((value[~mask] == 0).all()), name
    assert bool((tb.old_logprobs[mask] < 0).all()) and bool((tb.ref_logprobs[mask] < 0).all())
    assert not torch.equal(tb.old_logprobs, tb.ref_logprobs)
    for row in range(tb.batch_size):  # one advantage per sequence
        assert tb.advantages[row][mask[row]].unique().numel() == 1


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_batch_is_identical_however_split(n):
    tb = _train_batch()
    parts = tb.split(n)
    assert len(parts) == n and all(p.batch_size == 8 // n for p in parts)
    for a, b in zip(_fields(concat_train_batches(parts)), _fields(tb)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        tb.split(3)


# ---- the trainer ------------------------------------------------------------------------------
def _run(micro_batches, steps=2, aggregation="token-mean", batch_invariant=True):
    model = build_hf_model("tiny-qwen3", dtype=torch.float32, seed=0)
    tb = _train_batch()
    # On-policy old logprobs (ratio 1 on the first step, as in a real loop), a bit perturbed so
    # that both clipping branches occur in step 2.
    tb = tb.with_old_logprobs(hf_logprobs(model, tb.batch) + 0.02 * tb.advantages.sign())
    trainer = GroundTruthTrainer(model, lr=1e-3, weight_decay=0.01, clip_grad=1.0,
                                 kl_coef=0.05, aggregation=aggregation, clip_eps_high=0.28,
                                 batch_invariant=batch_invariant)
    results = [trainer.step(tb, micro_batches=micro_batches) for _ in range(steps)]
    return results, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batching_is_invisible(aggregation):
    """Default (batch-invariant) reference: 1, 2, 4 micro-batches agree bit for bit. This still
    tests the global-count normalisation: local counts would change every number."""
    ref_results, ref_params = _run(1, aggregation=aggregation)
    assert any(r["grad_norm"] > 1.0 for r in ref_results)  # clipping is exercised
    for micro in (2, 4):
        results, params = _run(micro, aggregation=aggregation)
        for step, (got, want) in enumerate(zip(results, ref_results)):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-7), (micro, step)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6), (micro, step)
            assert got["lr"] == want["lr"]
            assert len(got["micro_batches"]) == micro
            assert got["tokens"] == want["tokens"]
        worst = max(float((params[n] - ref_params[n]).abs().max()) for n in params)
        assert worst < 1e-6, f"{micro} micro-batches: params differ by {worst}"
        assert worst == 0.0  # in fact exactly equal


def test_batched_gradient_accumulation_matches_to_rounding():
    """batch_invariant=False: real batched accumulation; batched fp32 kernels round differently
    per batch size (~1e-6 on logprobs), so agreement is to rounding, not bits."""
    start = {n: p.detach().clone() for n, p in build_hf_model("tiny-qwen3", dtype=torch.float32, seed=0).named_parameters()}
    ref_results, ref_params = _run(1, batch_invariant=False)
    update = torch.cat([(ref_params[n] - start[n]).flatten() for n in ref_params])
    for micro in (2, 4):
        results, params = _run(micro, batch_invariant=False)
        for got, want in zip(results, ref_results):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        # Adam moves an element whose gradient is rounding noise by up to ~lr whatever its sign, so one
        # element's difference says little (1.4e-5 of a 2e-3 step on an Intel Xeon, 2026-11-27; under 1e-5
        # on AMD EPYC): the two runs' updates must agree as a whole. Measured 2.7e-5 relative (Intel Xeon).
        diff = torch.cat([(params[n] - ref_params[n]).flatten() for n in ref_params])
        relative = float(diff.norm() / update.norm())
        assert relative < 1e-4, f"{micro} micro-batches: params differ by {relative:g} of the update (L2)"


def test_a_step_trains():
    model = build_hf_model("tiny-qwen3", dtype=torch.float32, seed=0)
    tb = _train_batch()
    tb = tb.with_old_logprobs(hf_logprobs(model, tb.batch))
    trainer = GroundTruthTrainer(model, lr=1e-3)
    before = trainer.evaluate(tb)
    params = [p.detach().clone() for p in model.parameters()]
    result = trainer.step(tb)
    after = trainer.evaluate(tb)
    assert result["loss"] == pytest.approx(before["loss"], rel=1e-6, abs=1e-7)
    assert result["ratio_mean"] == pytest.approx(1.0, rel=1e-6)  # on-policy
    assert after["loss"] < before["loss"], (before["loss"], after["loss"])
    assert any(not torch.equal(p, q) for p, q in zip(params, model.parameters()))


def test_policy_logprobs_match_the_parity_reference_and_have_grad():
    model = build_hf_model("tiny-qwen3", dtype=torch.float32, seed=0)
    tb = _train_batch()
    lp = policy_logprobs(model, tb)
    assert lp.requires_grad
    # the same math to rounding: 1e-6, or 4 fp32 ulps of the logprob (2 ulps of a logprob near -10 measured
    # on an Intel Xeon, 2026-11-27: 1.9e-6)
    torch.testing.assert_close(lp.detach(), hf_logprobs(model, tb.batch), rtol=4 * torch.finfo(torch.float32).eps,
                               atol=1e-6)


# Megatron's OptimizerParamScheduler(init_lr=0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=2,
# lr_decay_steps=6, lr_decay_style="cosine"): its lr before step 1, 2, ... (recorded from
# megatron.core 's scheduler, stepped once after each optimizer step).
MEGATRON_COSINE_LRS = [0.0, 5e-4, 1e-3, 8.681980515339464e-4, 5.5e-4, 2.3180194846605365e-4,
                       1e-4, 1e-4]


def test_lr_schedule_is_megatrons():
    factor = megatron_lr_lambda(2, "cosine", 6, min_lr_ratio=0.1)
    for n, want in enumerate(MEGATRON_COSINE_LRS):
        assert 1e-3 * factor(n) == pytest.approx(want, rel=1e-12, abs=1e-18), n
    constant = megatron_lr_lambda(3, "constant", None, 0.0)
    assert [constant(n) for n in range(6)] == [0.0, 1 / 3, 2 / 3, 1.0, 1.0, 1.0]
    assert math.isclose(megatron_lr_lambda(0, "constant", None, 0.0)(0), 1.0)


def test_trainer_reports_the_lr_each_step_used():
    model = build_hf_model("tiny-qwen3", dtype=torch.float32, seed=0)
    tb = _train_batch()
    trainer = GroundTruthTrainer(model, lr=1e-3, warmup_steps=2, decay_style="cosine",
                                 total_steps=6, min_lr=1e-4)
    params = [p.detach().clone() for p in model.parameters()]
    lrs = [trainer.step(tb)["lr"] for _ in range(3)]
    assert lrs == pytest.approx(MEGATRON_COSINE_LRS[:3], rel=1e-12, abs=1e-18)
    assert trainer.lr == pytest.approx(MEGATRON_COSINE_LRS[3], rel=1e-12)
    del params


def test_trainer_rejects_non_fp32_models():
    model = build_hf_model("tiny-qwen3", dtype=torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="fp32"):
        GroundTruthTrainer(model)


def test_the_ground_truths_grad_norm_is_exact_at_real_widths():
    """A real embedding's gradient (1e7 elements and more): torch's float32 norm on the CPU is 3.7e-4 low on
    1e7 N(0, 1) elements (its clip_grad_norm_ the same), which made the ground truth's grad norm 1.3e-3 below
    Megatron's at qwen3-8b-shape; the ground truth sums the squares in float64 (harness.backends.norms)."""
    from harness.training.ground_truth import exact_grad_norm

    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10**7, 300)]
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
    exact = math.sqrt(sum(p.grad.double().square().sum().item() for p in params))
    fp32 = torch.nn.utils.clip_grad_norm_(params, float("inf"), foreach=False).item()
    assert abs(fp32 - exact) / exact > 1e-4  # the float32 sum this replaces (the check can fail)
    assert exact_grad_norm(params) == pytest.approx(exact, rel=1e-12)


def test_the_bf16_weights_ground_truth_runs_on_its_fp32_weights_rounded_as_megatrons_bf16_copy():
    """weights="bf16" (harness.training.ground_truth, "Weights"): the fp32 weights start as the loaded bf16
    weights; each step's forward and backward see them rounded to bf16, the update lands on the fp32 weights
    unrounded; an update below bf16's spacing then leaves the next forward where it was."""
    from harness.training.ground_truth import round_weights

    tb = _train_batch()
    tb = tb.with_old_logprobs(hf_logprobs(build_hf_model("tiny-qwen3", dtype=torch.float32, seed=0), tb.batch))
    model = build_hf_model("tiny-qwen3", dtype=torch.float32, seed=0)
    trainer = GroundTruthTrainer(model, lr=1e-6, weights="bf16")
    start = [p.detach().clone() for p in trainer.params]
    assert all(torch.equal(p, p.to(torch.bfloat16).float()) for p in start)  # started as bf16 values
    # its step is the plain trainer's step on the rounded weights...
    plain_model = build_hf_model("tiny-qwen3", dtype=torch.float32, seed=0)
    round_weights(plain_model.parameters(), torch.bfloat16)
    plain = GroundTruthTrainer(plain_model, lr=1e-6)
    first, plain_first = trainer.step(tb), plain.step(tb)
    assert (first["loss"], first["grad_norm"]) == (plain_first["loss"], plain_first["grad_norm"])
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, plain.params))  # fp32 weights, unrounded
    moved = [p for p, s in zip(trainer.params, start) if not torch.equal(p, s)]
    assert moved and any(not torch.equal(p, p.to(torch.bfloat16).float()) for p in moved)
    # ...but its next forward sees the fp32 weights rounded to bf16: at lr 1e-6 most of them where they were
    changed = sum(int((p.to(torch.bfloat16).float() != s).sum()) for p, s in zip(trainer.params, start))
    total = sum(s.numel() for s in start)
    assert changed < total // 10, f"{changed} of {total} weights"
    assert trainer.evaluate(tb)["loss"] != plain.evaluate(tb)["loss"]
    with pytest.raises(ValueError, match="weights must be one of"):
        GroundTruthTrainer(build_hf_model("tiny-qwen3", dtype=torch.float32, seed=0), weights="fp16")


def test_the_bf16_yardstick_is_hfs_own_bf16_loss_and_changes_nothing_in_the_steps():
    """bf16_yardstick (harness.training.ground_truth, "HF's own bf16"): each step records the loss of the model
    itself in bf16 on the state the step starts from, the reference implementation's own rounding; the steps,
    their weights and the model's buffers stay bit for bit those of a trainer without it. tiny-gpt-oss: its YaRN
    inverse frequencies are no bf16 values, so a buffer left rounded would move the second step."""
    from harness.training.loss import loss_counts, rl_loss

    model = "tiny-gpt-oss"
    tb = _train_batch()
    tb = tb.with_old_logprobs(hf_logprobs(build_hf_model(model, dtype=torch.float32, seed=0), tb.batch))
    with_it = GroundTruthTrainer(build_hf_model(model, dtype=torch.float32, seed=0), weights="bf16", bf16_yardstick=True)
    without = GroundTruthTrainer(build_hf_model(model, dtype=torch.float32, seed=0), weights="bf16")
    steps = [(with_it.step(tb, micro_batches=2), without.step(tb, micro_batches=2)) for _ in range(2)]
    for got, plain in steps:
        assert (got["loss"], got["grad_norm"]) == (plain["loss"], plain["grad_norm"])
        assert "hf_bf16_loss" not in plain
    assert all(torch.equal(p, q) for p, q in zip(with_it.params, without.params))
    assert all(torch.equal(a, b) for a, b in zip(with_it.model.buffers(), without.model.buffers()))
    assert all(p.dtype == torch.float32 for p in with_it.model.parameters())
    # the first step's yardstick is HF's bf16 model (its fp32 weights rounded) on the batch, row by row
    hf16 = build_hf_model(model, dtype=torch.bfloat16, seed=0)
    tokens, seqs = loss_counts(tb)
    with torch.no_grad():
        loss = sum(float(rl_loss(policy_logprobs(hf16, row, batch_invariant=False), row, global_token_count=tokens,
                                 global_seq_count=seqs)[0]) for row in tb.split(tb.batch_size))
    first = steps[0][0]
    assert first["hf_bf16_loss"] == pytest.approx(loss, rel=1e-12)
    assert abs(first["hf_bf16_loss"] - first["loss"]) > 1e-4  # the yardstick is bf16's, not the fp32 forward's
    with pytest.raises(ValueError, match="bf16_yardstick needs weights='bf16'"):
        GroundTruthTrainer(build_hf_model(model, dtype=torch.float32, seed=0), bf16_yardstick=True)


def test_a_loss_held_within_hfs_own_bf16_takes_the_larger_of_the_bound_and_that_gap():
    """compare_to_ground_truth(loss_within_hf_bf16=True), for the -shape models whose HF bf16 is the noisy side:
    a step's loss bound is the table's bf16 bound, or HF's own bf16 gap on that state where that is larger
    (gpt-oss-shape: 0.0295 against the table's 0.02); without the option, always the table's."""
    from harness.training.invariance import HF_BF16_BOUND, _loss_bound, compare_to_ground_truth
    from harness.training.tolerances import training_tolerance

    table = training_tolerance("loss_rel_diff", "bf16")
    noisy = {"loss": 0.1236, "hf_bf16_loss": 0.1236 - 0.0295}
    quiet = {"loss": 0.1236, "hf_bf16_loss": 0.1236 - table.limit / 2}
    widened = _loss_bound("bf16", noisy, True)
    assert widened.limit == pytest.approx(0.0295) and widened.rationale.startswith(HF_BF16_BOUND)
    assert widened.passes(0.0261) and not table.passes(0.0261)  # session 49's second step
    assert not widened.passes(0.031)
    assert _loss_bound("bf16", quiet, True) is table
    assert _loss_bound("bf16", noisy, False) is table
    with pytest.raises(ValueError, match="loss_within_hf_bf16 needs truth_weights='bf16'"):
        compare_to_ground_truth(None, loss_within_hf_bf16=True)


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_the_gradients_in_float64_are_fp32s_to_rounding_and_change_nothing(model):
    """GroundTruthTrainer.gradients (harness.training.grad_check's reference): in fp32 the step's own unclipped
    gradient, bit for bit; in float64 (a MoE model's experts on HF's eager loop, padded rows run unpadded) the
    same gradient to fp32's rounding, and the model back in fp32 with its weights and buffers as they were."""
    from harness.training.ground_truth import exact_grad_norm

    tb = _train_batch()
    hf = build_hf_model(model, dtype=torch.float32, seed=0)
    tb = tb.with_old_logprobs(hf_logprobs(hf, tb.batch))
    trainer = GroundTruthTrainer(hf, lr=1e-3, clip_grad=None)
    weights = [p.detach().clone() for p in hf.parameters()]
    buffers = [b.detach().clone() for b in hf.buffers()]
    fp32, exact = trainer.gradients(tb, 2), trainer.gradients(tb, 2, compute=torch.float64)
    assert all(p.dtype == torch.float32 and p.grad is None for p in hf.parameters())
    assert all(torch.equal(p, w) for p, w in zip(hf.parameters(), weights))
    assert all(torch.equal(b, k) for b, k in zip(hf.buffers(), buffers))
    assert getattr(hf.config, "_experts_implementation", None) == getattr(
        build_hf_model(model, dtype=torch.float32, seed=0).config, "_experts_implementation", None)
    assert set(fp32) == set(exact) == {n for n, p in hf.named_parameters() if p.requires_grad}
    for name, g in fp32.items():  # fp32 rounding of the same gradient: 1e-4 of its norm (measured 2.1e-6, 2.2e-6)
        assert (g - exact[name]).norm() <= 1e-4 * exact[name].norm() + 1e-12, name
    trainer.step(tb, micro_batches=2)  # the step's own gradient is the fp32 one
    assert all(torch.equal(p.grad.double(), fp32[n]) for n, p in hf.named_parameters() if p.grad is not None)
    assert exact_grad_norm(trainer.params) == pytest.approx(
        math.sqrt(sum(float(g.square().sum()) for g in fp32.values())), rel=1e-9)
    with pytest.raises(ValueError, match="compute must be"):
        trainer.gradients(tb, 2, compute=torch.bfloat16)
