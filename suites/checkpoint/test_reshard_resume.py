"""A policy checkpoint saved under one layout resumes exactly under another.

For each (source, target) pair: K steps at the source, save; load at the target, then
(a) every parameter and optimizer tensor equals the source's exactly (the target re-saves and the
two checkpoints are diffed as full tensors), (b) one more step at the target equals one more step
at the source without the save (harness.checkpoint.resume_check: within the training tolerance
table at another layout, bit for bit at the same one), and the data position comes back. (c) With
dropout on, resuming at the same layout with the RNG restored is bit-exact. The buggy variants of
the catalog are shown failing these checks in suites/sensitivity/test_checkpoint_variants.py.
"""
from __future__ import annotations

import pytest
import torch

from harness.checkpoint.diff import diff_checkpoints
from harness.checkpoint.resume_check import CONFIG, K_STEPS, MODEL, assert_dp_reshardable_refused, resume_and_compare, \
    train_and_save, train_batch
from harness.parallel.state import run_in_layout
from harness.pytest_plugin.worlds import skip_unless_converted

# The pairs (tp1 fills the world with dp), plus tp2pp2 -> tp4: TP4 pads the vocab to 512
# rows where TP2 pads it to 256, so the two checkpoints' embeddings differ in shape. CI resumes TP at
# DP, PP at TP and TP x PP at TP4 (4 ranks, the vocab padding); the other pairs run nightly.
NIGHTLY = pytest.mark.nightly
CPU_PAIRS = [("tp2", "dp2"), pytest.param("dp2", "pp2", marks=NIGHTLY), ("pp2", "tp2"),
             pytest.param("dp2", "tp2", marks=NIGHTLY), pytest.param("tp2pp2", "dp4", marks=NIGHTLY),
             ("tp2pp2", "tp4")]


@pytest.mark.layout_pairs(cpu=CPU_PAIRS, cuda="all")
def test_resume_at_another_layout_continues_exactly(policy, device, source, target, source_checkpoint,
                                                    tmp_path, report):
    src = source_checkpoint(source)
    diffs = []

    def resave_and_diff(resumed):
        """(a) the loaded state, saved again at the target, equals the source checkpoint exactly."""
        resumed.save(tmp_path / "resaved")
        diffs.append(diff_checkpoints(src.directory, tmp_path / "resaved"))

    result = resume_and_compare(policy, src, target, after_load=resave_and_diff)
    pair = result.pair
    info = result.load
    report.add("save_s", src.manifest.save_s, tolerance=None, passed=True, claim="timing", layout=pair, units="s")
    report.add("load_s", info["load_s"], tolerance=None, passed=True, claim="timing", layout=pair, units="s")
    assert (info["steps_done"], info["consumed_samples"]) == (K_STEPS, K_STEPS * 8)
    assert not info["rng_restored"]  # per-rank RNG states do not map onto another layout
    (diff,) = diffs
    worst = max((m["max_abs"] or float("inf") for m in diff.mismatched.values()), default=0.0)
    report.add("tensors_differing", len(diff.mismatched) + len(diff.missing) + len(diff.extra),
               tolerance=0, passed=diff.ok, claim="exact", layout=pair, max_abs=worst)
    assert diff.ok, diff.summary()
    assert diff.equal > 0
    # (b) the next step at the target is the step the source took without stopping.
    report.extend(result.rows())
    assert result.passed, result.summary()


def _noop(layout) -> None:
    return None


@pytest.mark.layouts(cpu=["tp2"], cuda=["tp2pp2"])
def test_resume_with_rng_and_dropout_is_bit_exact(policy, device, layout, tmp_path, report):
    """(c) With dropout 0.1 and the RNG restored, the resumed step is the uninterrupted one bit for
    bit; the loaded RNG streams are the worker's own, so a new handle and a default-seed call in
    between (each reseeds the process's streams) do not reach them."""
    src = train_and_save(policy, layout, tmp_path / "ckpt", dropout=0.1, deterministic=True)

    def disturb(resumed):
        policy(layout, MODEL, **src.config)
        run_in_layout(resumed.world, layout, _noop)

    result = resume_and_compare(policy, src, layout, load_rng=True, after_load=disturb)
    report.extend(result.rows(dropout=0.1))
    assert result.load["rng_restored"]
    assert result.passed, result.summary()


@pytest.mark.layouts(cpu=["tp2"], cuda=["tp2pp2"])
def test_a_dp_reshardable_checkpoint_resumes_bit_for_bit_at_its_layout(policy, device, layout, tmp_path,
                                                                       report):
    """The dp_reshardable format at the layout it was saved at: the next step (loss, grad norm and
    every weight after it) is the uninterrupted one bit for bit. (Its flat buffers carry
    uninitialized padding, so two saves of one state differ there: the files are not compared.)
    The weights after the step are what catch a wrong torch-Adam step (its bias correction), which
    loss and grad norm, taken before the update, do not: megatron-core's dp_reshardable load resets
    it to the loading policy's own (`dp-reshardable-step-reset`, harness.compat.megatron_core)."""
    src = train_and_save(policy, layout, tmp_path / "dp", optimizer_format="dp_reshardable", deterministic=True)
    result = resume_and_compare(policy, src, layout)
    report.extend(result.rows(optimizer_format="dp_reshardable"))
    assert (result.load["steps_done"], result.load["consumed_samples"]) == (K_STEPS, K_STEPS * 8)
    assert result.passed, result.summary()


@pytest.mark.upstream
def test_dp_reshardable_optimizer_cannot_resume_at_another_tp_pp(policy, device, tmp_path):
    """The buggy variant (optimizer in the dp_reshardable format, flat buffers of one TP/PP layout):
    loading it at another TP/PP is refused with one clear error, the target left untouched (at
    the same layout it resumes exactly: the test above)."""
    assert_dp_reshardable_refused(policy, "tp2", "pp2", tmp_path / "dp")


def _distinct_adam_steps(worker) -> int:
    """How many distinct torch-Adam "step" tensors this rank's optimizer holds (one per parameter
    when healthy; megatron-core 0.16.1's load_state_dict makes them one shared tensor)."""
    optimizers = getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
    return len({id(state["step"]) for dist_opt in optimizers
                for state in dist_opt.optimizer.state.values() if "step" in state})


@pytest.mark.upstream
def test_dp_reshardable_optimizer_at_another_tp_pp_fails_inside_megatron_and_damages_the_target(
        policy, device, tmp_path, report):
    """The buggy variant without the harness's refusal (`variant="dp-reshardable"`): a
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
        target.load(tmp_path / "dp", variant="dp-reshardable")
    assert type(raised.value).__name__ == "CheckpointException" and not isinstance(raised.value, Exception)
    assert "Global shape mismatch" in str(raised.value) and "optimizer.distributed" in str(raised.value)

    after, steps_after = target.hf_state_dict(), target.apply(_distinct_adam_steps)
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    zeroed = sorted(n for n in changed if not after[n].any())
    worst = max(((before[n] - after[n]).abs().max().item() for n in changed), default=0.0)
    report.add("tensors_changed_by_failed_load", len(changed), tolerance=0, passed=not changed, claim="observed",
               layout="tp2->pp2", variant="dp-reshardable", zeroed=zeroed, max_abs=worst)
    report.add("distinct_adam_steps_after_failed_load", min(steps_after), tolerance=min(steps_before),
               passed=steps_after == steps_before, claim="observed", layout="tp2->pp2", variant="dp-reshardable")
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


# Gemma 3 text (issue 37; stack A only: refused by name on Megatron-Bridge 0.6.2): its post-norms (inside
# linear_proj / linear_fc2, replicated over TP) and zero-centered norms reshard with the rest: pp2 -> tp2
# (the tied embedding's two copies under PP become one), tp2 -> dp2, dp2 -> pp2. Nightly only: 10.5 s a
# pair on the CPU tier (2 cores, warm worlds), past the CI's budget for the family; the export path it
# shares is in CI (suites/rollout/test_sync.py, the Gemma 3 sync at pp2).
GEMMA3 = "tiny-gemma3"


@pytest.mark.nightly
@pytest.mark.layout_pairs(cpu=[("pp2", "tp2"), ("tp2", "dp2"), ("dp2", "pp2")], cuda=[("pp2", "tp2")])
def test_gemma3_resume_at_another_layout_continues_exactly(policy, device, source, target, tmp_path, report):
    skip_unless_converted(GEMMA3)
    if policy.spec != "local":
        pytest.skip("harness.bridge.gemma3 builds Gemma 3 on the local spec only (docs/gemma3.md)")
    src = train_and_save(policy, source, tmp_path / "src", model=GEMMA3)
    diffs = []

    def resave_and_diff(resumed):
        resumed.save(tmp_path / "resaved")
        diffs.append(diff_checkpoints(src.directory, tmp_path / "resaved"))

    result = resume_and_compare(policy, src, target, after_load=resave_and_diff)
    assert (result.load["steps_done"], result.load["consumed_samples"]) == (K_STEPS, K_STEPS * 8)
    (diff,) = diffs
    worst = max((m["max_abs"] or float("inf") for m in diff.mismatched.values()), default=0.0)
    report.add("tensors_differing", len(diff.mismatched) + len(diff.missing) + len(diff.extra),
               tolerance=0, passed=diff.ok, claim="exact", layout=result.pair, model=GEMMA3, max_abs=worst)
    assert diff.ok, diff.summary()
    # The post-norms (Gemma's own tensors, inside linear_proj / linear_fc2) were among those compared.
    post_norms = diff_checkpoints(src.directory, tmp_path / "resaved", include=[
        f"{state}decoder.layers.{module}.post_layernorm." for state in ("", "optimizer.state.exp_avg.")
        for module in ("self_attention.linear_proj", "mlp.linear_fc2")])
    assert diff.equal > 0 and post_norms.ok and post_norms.equal > 0, post_norms.summary()
    report.extend(result.rows())
    assert result.passed, result.summary()


def test_a_load_that_takes_the_world_down_reports_the_loads_own_error(tmp_path):
    """A load whose rank died or hung (a 2.5 B-parameter checkpoint on 1x H100, session 54) leaves no policy to
    read back: the check raises the load's own error (its ranks' stacks), noting the read that failed after it,
    not the follow-up "worker is not on this rank" that once hid it. No world: a stand-in policy."""
    from types import SimpleNamespace

    from harness.checkpoint.resume_check import Uninterrupted

    class Gone:  # the load timed out and the world restarted: every later call fails
        world = SimpleNamespace(device="cpu")
        layout = "tp1"
        reads = 0

        def hf_state_dict(self):
            self.reads += 1
            if self.reads > 1:
                raise RuntimeError("worker 'policy-1' is not on this rank: it was closed, or the world restarted")
            return {"w": torch.zeros(2)}

        def load(self, directory, **options):
            raise TimeoutError("harness.checkpoint load timed out after 300.0s on ranks [0] of 1")

    source = Uninterrupted("tp1", {"dtype": "fp32"}, tmp_path, {}, {}, None)
    with pytest.raises(TimeoutError, match="timed out after 300.0s") as raised:
        resume_and_compare(lambda layout, model, **config: Gone(), source, "tp1")
    assert any("could not be read" in note and "not on this rank" in note for note in raised.value.__notes__)
