"""A policy checkpoint saved under one layout resumes exactly under another.

For each (source, target) pair: K steps at the source, save; load at the target, then
(a) every parameter and optimizer tensor equals the source's exactly (the target re-saves and the
two checkpoints are diffed as full tensors), (b) one more step at the target equals one more step
at the source without the save (loss and grad norm, training tolerance table), and the data
position comes back. (c) With dropout on, resuming at the same layout with the RNG restored is
bit-exact, and without it is not.
"""
from __future__ import annotations

import pytest
import torch

from harness.checkpoint import CheckpointError
from harness.checkpoint.diff import diff_checkpoints
from harness.parallel.state import run_in_layout
from harness.training.tolerances import training_tolerance
from suites.checkpoint.common import CONFIG, K_STEPS, MODEL, train_batch

# The pairs (tp1 fills the world with dp), plus tp2pp2 -> tp4: TP4 pads the vocab to 512
# rows where TP2 pads it to 256, so the two checkpoints' embeddings differ in shape.
CPU_PAIRS = [("tp2", "dp2"), ("dp2", "pp2"), ("pp2", "tp2"), ("dp2", "tp2"), ("tp2pp2", "dp4"),
             ("tp2pp2", "tp4")]


@pytest.mark.layout_pairs(cpu=CPU_PAIRS, cuda="all")
def test_resume_at_another_layout_continues_exactly(policy, device, source, target, source_checkpoint,
                                                    tmp_path, report):
    src = source_checkpoint(source)
    resumed = policy(target, MODEL, **CONFIG)
    info = resumed.load(src.directory)
    pair = f"{source}->{target}"
    report.add("save_s", src.manifest.save_s, tolerance=None, passed=True, layout=pair, units="s")
    report.add("load_s", info["load_s"], tolerance=None, passed=True, layout=pair, units="s")
    assert (info["steps_done"], info["consumed_samples"]) == (K_STEPS, K_STEPS * 8)
    assert not info["rng_restored"]  # per-rank RNG states do not map onto another layout

    # (a) the loaded state, saved again at the target, equals the source checkpoint exactly.
    resumed.save(tmp_path / "resaved")
    diff = diff_checkpoints(src.directory, tmp_path / "resaved")
    worst = max((m["max_abs"] or float("inf") for m in diff.mismatched.values()), default=0.0)
    report.add("tensors_differing", len(diff.mismatched) + len(diff.missing) + len(diff.extra),
               tolerance=0, passed=diff.ok, layout=pair, max_abs=worst)
    assert diff.ok, diff.summary()
    assert diff.equal > 0

    # (b) the next step at the target is the step the source took without stopping.
    failures = _next_step_failures(resumed, src, pair, report)
    assert not failures, "; ".join(failures)


def _next_step_failures(resumed, src, pair, report, **fields) -> list[str]:
    """Take the next step on `resumed`; every way it differs from the source's uninterrupted one
    (loss, grad norm, lr, and the weights after the optimizer update)."""
    got = resumed.step(train_batch(K_STEPS))
    failures = []
    for key in ("loss", "grad_norm"):
        bound = training_tolerance(f"{key}_rel_diff", "fp32")
        rel = abs(got[key] - src.next_step[key]) / max(abs(src.next_step[key]), 1.0)
        report.add(f"next_{key}_rel_diff", rel, tolerance=bound.limit, passed=bound.passes(rel), layout=pair, **fields)
        if not bound.passes(rel):
            failures.append(f"{key}: resumed {got[key]!r} vs uninterrupted {src.next_step[key]!r}")
    if got["lr"] != pytest.approx(src.next_step["lr"], rel=1e-12):
        failures.append(f"lr: resumed {got['lr']} vs uninterrupted {src.next_step['lr']}")
    state = resumed.hf_state_dict()
    worst = max((state[n].float() - t.float()).abs().max().item() for n, t in src.next_state.items())
    bound = training_tolerance("param_max_abs_diff", "fp32")
    report.add("next_param_max_abs_diff", worst, tolerance=bound.limit, passed=bound.passes(worst),
               layout=pair, **fields)
    if not bound.passes(worst):
        failures.append(f"weights after the next step: max |diff| {worst:.3g}")
    return failures


@pytest.mark.upstream
@pytest.mark.layout_pairs(cpu=[("tp2", "tp2")], cuda=[("tp2pp2", "tp2pp2")])
def test_shared_adam_step_after_load_is_detected(policy, device, source, target, source_checkpoint, report):
    """megatron-core 0.16.1 without Apex/TE hands every parameter one shared Adam step tensor on
    load (our load un-shares it). The shipped variant keeps the bug: the loss and grad norm of the
    next step still match, but the update's bias correction is wrong, and the weights show it."""
    src = source_checkpoint(source)
    resumed = policy(target, MODEL, **CONFIG)
    resumed.load(src.directory, variant="shared-adam-step")
    failures = _next_step_failures(resumed, src, f"{source}->{target}", report, variant="shared-adam-step")
    assert failures and all(f.startswith("weights") for f in failures), failures


def _dropout_resume(policy, layout, tmp_path, load_rng):
    """(uninterrupted next step + weights, resumed next step + weights) with dropout 0.1."""
    config = dict(CONFIG, dropout=0.1, deterministic=True)  # bit-exact needs deterministic kernels
    first = policy(layout, MODEL, **config)
    first.steps([train_batch(i) for i in range(K_STEPS)])
    first.save(tmp_path / "ckpt")
    want = first.step(train_batch(K_STEPS)), first.hf_state_dict()
    second = policy(layout, MODEL, **config)  # built (and seeded) afresh: its RNG is not first's
    info = second.load(tmp_path / "ckpt", load_rng=load_rng)
    assert info["rng_restored"] is load_rng
    # The loaded RNG states are the worker's own: a new handle and a default-seed call in between
    # (each reseeds the process's streams) do not reach them.
    policy(layout, MODEL, **config)
    run_in_layout(second.world, layout, _noop)
    return want, (second.step(train_batch(K_STEPS)), second.hf_state_dict())


def _noop(layout) -> None:
    return None


def _bit_exact(a, b) -> bool:
    (step_a, state_a), (step_b, state_b) = a, b
    return (step_a["loss"] == step_b["loss"] and step_a["grad_norm"] == step_b["grad_norm"]
            and all(torch.equal(state_a[n], state_b[n]) for n in state_a))


@pytest.mark.layouts(cpu=["tp2"], cuda=["tp2pp2"])
def test_resume_with_rng_and_dropout_is_bit_exact(policy, device, layout, tmp_path, report):
    want, got = _dropout_resume(policy, layout, tmp_path, load_rng=True)
    exact = _bit_exact(want, got)
    report.add("bit_exact", float(exact), tolerance=1.0, passed=exact, layout=layout, dropout=0.1)
    assert exact, f"resumed step {got[0]['loss']!r} vs uninterrupted {want[0]['loss']!r}"


@pytest.mark.upstream
@pytest.mark.layouts(cpu=["tp2"], cuda=["tp2pp2"])
def test_rng_not_restored_with_dropout_is_detected(policy, device, layout, tmp_path, report):
    """The buggy variant (RNG left as the fresh worker's): the resumed step is not the same step."""
    want, got = _dropout_resume(policy, layout, tmp_path, load_rng=False)
    exact = _bit_exact(want, got)
    report.add("bit_exact", float(exact), tolerance=1.0, passed=exact, layout=layout, dropout=0.1,
               variant="rng-not-restored")
    assert not exact, "with dropout on, a resume without the RNG states must differ"


@pytest.mark.upstream
def test_dp_reshardable_optimizer_cannot_resume_at_another_tp_pp(policy, device, tmp_path):
    """The buggy variant (optimizer in the dp_reshardable format, flat buffers of one TP/PP layout):
    loading it at another TP/PP is refused with one clear error, the target left untouched; at
    the same layout it round-trips exactly."""
    config = dict(CONFIG, deterministic=True)  # the step comparison below is exact
    source = policy("tp2", MODEL, **config)
    source.step(train_batch(0))
    source.save(tmp_path / "dp", optimizer_format="dp_reshardable")
    target = policy("pp2", MODEL, **CONFIG)
    before = target.hf_state_dict()
    with pytest.raises(CheckpointError, match="dp_reshardable"):
        target.load(tmp_path / "dp")
    after = target.hf_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert target.position()["steps_done"] == 0

    # At the same layout it loads. (Its flat buffers carry uninitialized padding, so two saves of
    # one state differ there: compare the loaded weights and the next step instead of the files.)
    same = policy("tp2", MODEL, **config)
    same.load(tmp_path / "dp")
    want, got = source.hf_state_dict(), same.hf_state_dict()
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert same.step(train_batch(1)) == source.step(train_batch(1))


def _distinct_adam_steps(worker) -> int:
    """How many distinct torch-Adam "step" tensors this rank's optimizer holds (one per parameter
    when healthy; megatron-core 0.16.1's load_state_dict makes them one shared tensor)."""
    optimizers = getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
    return len({id(state["step"]) for dist_opt in optimizers
                for state in dist_opt.optimizer.state.values() if "step" in state})


@pytest.mark.upstream
def test_dp_reshardable_optimizer_at_another_tp_pp_fails_inside_megatron_and_damages_the_target(
        policy, device, tmp_path, report):
    """The buggy variant without the harness's refusal (`variant="dp-reshardable-any-layout"`): a
    tp2 dp_reshardable checkpoint loaded into a trained pp2 policy. megatron-core 0.16.1 raises deep
    inside dist_checkpointing (torch's CheckpointException, a BaseException, so `except Exception`
    misses it: "Global shape mismatch" for the optimizer's flat buffers, which are sized by the
    saved TP/PP), and only after damaging the live target: its torch_dist loader first zeroes, in
    place, the template's shape-mismatch-tolerant tensors (the vocab-padded embedding and output
    layer, which alias the live weights), and building the load template already made every
    parameter share one Adam step tensor. Nothing is restored when the load fails."""
    source = policy("tp2", MODEL, **CONFIG)
    source.step(train_batch(0))
    source.save(tmp_path / "dp", optimizer_format="dp_reshardable")
    target = policy("pp2", MODEL, **CONFIG)
    target.step(train_batch(0))
    before, steps_before = target.hf_state_dict(), target.apply(_distinct_adam_steps)
    with pytest.raises(BaseException) as raised:
        target.load(tmp_path / "dp", variant="dp-reshardable-any-layout")
    assert type(raised.value).__name__ == "CheckpointException" and not isinstance(raised.value, Exception)
    assert "Global shape mismatch" in str(raised.value) and "optimizer.distributed" in str(raised.value)

    after, steps_after = target.hf_state_dict(), target.apply(_distinct_adam_steps)
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    zeroed = sorted(n for n in changed if not after[n].any())
    worst = max(((before[n] - after[n]).abs().max().item() for n in changed), default=0.0)
    report.add("tensors_changed_by_failed_load", len(changed), tolerance=0, passed=not changed,
               layout="tp2->pp2", variant="dp-reshardable-any-layout", zeroed=zeroed, max_abs=worst)
    report.add("distinct_adam_steps_after_failed_load", min(steps_after), tolerance=min(steps_before),
               passed=steps_after == steps_before, layout="tp2->pp2", variant="dp-reshardable-any-layout")
    assert changed and zeroed == changed == ["lm_head.weight", "model.embed_tokens.weight"], changed
    assert min(steps_before) > 1 and steps_after == [1, 1], (steps_before, steps_after)
    assert target.position()["steps_done"] == 1  # the data position was not reached


def test_without_fully_parallel_save_and_load_the_checkpoint_is_the_same(policy, device, source_checkpoint,
                                                                          tmp_path):
    """The knobs change who writes and reads which shard, never the content."""
    src = source_checkpoint("tp2")
    resumed = policy("pp2", MODEL, **CONFIG)
    resumed.load(src.directory, fully_parallel_load=False)
    resumed.save(tmp_path / "serial", fully_parallel_save=False)
    diff = diff_checkpoints(src.directory, tmp_path / "serial")
    assert diff.ok and diff.equal > 0, diff.summary()
