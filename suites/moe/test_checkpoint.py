"""A Mixture-of-Experts policy's checkpoint resumes exactly under another expert layout, and its
saves keep the checkpoint suite's promises (async equals sync, crash safety).

The checks of suites/checkpoint/test_reshard_resume.py with tiny Qwen3-MoE: K steps at the source,
save; load at the target, then (a) the state re-saved at the target equals the source checkpoint
exactly (every expert's weights and Adam moments, whether they sat on one rank, were split over
ranks (ep) or split their own width (etp)), and (b) one more step at the target is the step the
source took without the save (bit for bit at the same layout, within the training tolerance table
at another). Across ep1 <-> ep >= 2 the optimizer's plain state (its param groups) is laid out per
optimizer, one at ep1 and two at ep >= 2 (harness.checkpoint.sharded.regroup_optimizer_state): there
the param groups' settings must be equal, not their places. The dp_reshardable format resumes bit
for bit at its own layout and is refused before any work at another expert layout, as for dense
models at another TP/PP. CI runs dp2ep2 -> tp2-sp (experts by expert, then by width; two optimizers,
then one); the nightly run the rest.
"""
from __future__ import annotations

import pytest

from harness.checkpoint.diff import diff_checkpoints
from harness.checkpoint.resume_check import CONFIG, K_STEPS, assert_dp_reshardable_refused, resume_and_compare, \
    train_and_save, train_batch
from harness.parallel.state import as_layout
from harness.pytest_plugin.worlds import skip_unless_converted

MODEL = "tiny-qwen3-moe"
# ep2 <-> etp2 (the experts split by expert, then by width), ep2 <-> pp2 (by expert, then by layer),
# ep2 -> dp2 (every rank holds every expert).
CI_PAIRS = [("dp2ep2", "tp2-sp")]
NIGHTLY_PAIRS = [("tp2-sp", "dp2ep2"), ("dp2ep2", "pp2"), ("pp2", "dp2ep2"), ("dp2ep2", "dp2"),
                 ("tp2ep2etp1-sp", "pp2")]


def _group_settings(directory) -> set[tuple]:
    """Every optimizer param group's settings (lr, weight decay, betas, step, ...) in a checkpoint's
    plain state, whichever optimizer holds it: one optimizer at ep1, two at ep >= 2 (dense and
    expert-parallel, `is_expert_parallel` telling them apart), so the layout of these entries is
    the layout's own, and what must survive the reshard is the settings."""
    from harness.checkpoint.diff import load_common

    state = load_common(directory)["optimizer"]
    parts = [state[i] for i in sorted(k for k in state if isinstance(k, int))] or [state]
    return {tuple(sorted((k, repr(v)) for k, v in group.items() if k != "is_expert_parallel"))
            for part in parts for group in part["optimizer"]["param_groups"]}


def _equal_but_optimizer_chaining(diff, source, target) -> tuple[bool, str]:
    """The diff of a checkpoint re-saved at `target` against the source's: every tensor equal and
    every plain entry too, except, across ep1 <-> ep >= 2, where the param groups sit (above)."""
    tensors_ok = not (diff.missing or diff.extra or diff.mismatched)
    chaining = {k for k in diff.common if k.startswith("optimizer.")}
    if (as_layout(source).ep > 1) == (as_layout(target).ep > 1):
        return tensors_ok and not diff.common, diff.summary()
    settings = _group_settings(diff.a), _group_settings(diff.b)
    other = sorted(set(diff.common) - chaining)
    ok = tensors_ok and not other and settings[0] == settings[1]
    return ok, f"{diff.summary()}; plain entries other than the optimizer's: {other[:5]}; " \
               f"param group settings equal: {settings[0] == settings[1]}"


# The experts' entries of a checkpoint: megatron-core stacks uniform layers' keys (`decoder.layers.mlp...`);
# a model with dense first layers (GLM-4.5-MoE) keeps them per layer (`decoder.layers.<l>.mlp.experts...`).
EXPERT_KEYS = ("decoder.layers.mlp.experts.", "optimizer.state.exp_avg.decoder.layers.mlp.experts.")


def _resume_elsewhere(policy, source, target, tmp_path, report, model=MODEL, experts=EXPERT_KEYS):
    src = train_and_save(policy, source, tmp_path / "src", model=model)
    diffs = []

    def resave_and_diff(resumed):
        resumed.save(tmp_path / "resaved")
        diffs.append(diff_checkpoints(src.directory, tmp_path / "resaved"))

    result = resume_and_compare(policy, src, target, after_load=resave_and_diff)
    report.extend(result.rows())
    assert result.load_error is None, result.summary()
    assert (result.load["steps_done"], result.load["consumed_samples"]) == (K_STEPS, K_STEPS * 8)
    (diff,) = diffs
    ok, summary = _equal_but_optimizer_chaining(diff, source, target)
    worst = max((m["max_abs"] or float("inf") for m in diff.mismatched.values()), default=0.0)
    report.add("tensors_differing", len(diff.mismatched) + len(diff.missing) + len(diff.extra), tolerance=0,
               passed=ok, claim="exact", layout=result.pair, model=model, max_abs=worst)
    assert ok, summary
    experts = diff_checkpoints(src.directory, tmp_path / "resaved", include=list(experts))
    assert experts.equal >= 4 and not experts.mismatched, experts.summary()  # weights and moments of the experts
    assert result.passed, result.summary()


@pytest.mark.layout_pairs(cpu=CI_PAIRS, cuda=CI_PAIRS)
def test_moe_resume_at_another_expert_layout_continues_exactly(policy, device, source, target, tmp_path, report):
    _resume_elsewhere(policy, source, target, tmp_path, report)


@pytest.mark.nightly
@pytest.mark.layout_pairs(cpu=NIGHTLY_PAIRS)
def test_moe_resume_at_every_expert_layout_pair(policy, device, source, target, tmp_path, report):
    _resume_elsewhere(policy, source, target, tmp_path, report)


@pytest.mark.nightly
@pytest.mark.layout_pairs(cpu=[("dp2ep2", "tp2-sp"), ("tp2-sp", "dp2ep2")])
def test_qwen2_moe_resume_at_another_expert_layout(policy, device, source, target, tmp_path, report):
    """Qwen2-MoE (stack A only): the shared expert (replicated over DP at dp2ep2, split over TP at tp2-sp)
    and its gate (replicated everywhere) reshard with the routed experts."""
    skip_unless_converted("tiny-qwen2-moe")
    _resume_elsewhere(policy, source, target, tmp_path, report, model="tiny-qwen2-moe")


@pytest.mark.nightly
@pytest.mark.layout_pairs(cpu=[("dp2ep2", "tp2-sp"), ("tp2-sp", "dp2ep2"), ("dp2ep2", "pp2")])
def test_glm4_moe_resume_at_another_expert_layout(policy, device, source, target, tmp_path, report):
    """GLM-4.5-MoE (stack A only): the dense first layer, the shared expert and the routers' expert bias
    (a buffer: in the checkpoint, never trained) reshard with the routed experts; to pp2 the dense layer
    and the first sparse one sit on one stage, the other two on the other."""
    skip_unless_converted("tiny-glm4-moe")
    per_layer = tuple(f"{prefix}decoder.layers.{layer}.mlp.{what}." for layer in (1, 2, 3)
                      for prefix in ("", "optimizer.state.exp_avg.") for what in ("experts", "router"))
    _resume_elsewhere(policy, source, target, tmp_path, report, model="tiny-glm4-moe", experts=per_layer)


def _bucket_entries(worker) -> list[int]:
    """Rank function: the parameter entries of each bucket of this rank's DP shard, per optimizer."""
    return [len(bucket) for opt in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
            for per_dtype in opt.get_parameter_state_dp_reshardable().values() if isinstance(per_dtype, dict)
            for buckets in per_dtype.values() for bucket in buckets]


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["dp2ep2"], cuda=["dp2ep2"])
def test_moe_dp_reshardable_checkpoint_resumes_bit_for_bit_at_its_layout(policy, device, layout, tmp_path, report):
    """The dp_reshardable format at the layout it was saved at (flat buffers, dense and
    expert-parallel): the next step (loss, grad norm, every weight after it) is the uninterrupted
    one bit for bit. With the precondition of radixark/Megatron-LM PR 66 (a dp_reshardable resume
    of a MoE model crashed in `merge`, "Cannot merge two lists with different lengths", because the
    per-bucket list of parameter entries, whose length differs per DP rank, went into the rank-0
    common state): here the two ranks' dense buckets hold 16 and 15 entries, and megatron-core
    0.16.1 and 0.19.2 resume anyway, since their entries hold only sharded tensors and
    non-persistent objects, so no list reaches the common state."""
    src = train_and_save(policy, layout, tmp_path / "dp", optimizer_format="dp_reshardable", model=MODEL,
                         deterministic=True)
    result = resume_and_compare(policy, src, layout)
    report.extend(result.rows(optimizer_format="dp_reshardable"))
    assert result.passed, result.summary()
    entries = policy(layout, MODEL, **src.config).apply(_bucket_entries)
    assert entries[0] != entries[1], entries  # PR 66's precondition: uneven entries per rank
    assert (result.load["steps_done"], result.load["consumed_samples"]) == (K_STEPS, K_STEPS * 8)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["dp2ep2"])
def test_moe_dp_reshardable_checkpoint_at_another_expert_layout_is_refused(policy, device, layout, tmp_path):
    """A dp_reshardable optimizer (flat buffers of one layout, the expert buffers of one ep/etp
    included) loaded at another expert layout: refused with one clear error, the target untouched."""
    for target_layout in ("tp2-sp", "dp2"):  # another TP and ETP; the same TP/PP at ep1
        assert_dp_reshardable_refused(policy, layout, target_layout, tmp_path / "dp", model=MODEL)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["dp2ep2"])
def test_moe_async_save_equals_the_sync_save(policy, device, layout, tmp_path, report):
    """An async save of a MoE policy (staged, then written by forked writers while training could go
    on) holds exactly what the sync save of the same state holds: every expert, moment and step."""
    from harness.checkpoint.checkpointer import Checkpointer

    handle = policy(layout, MODEL, **CONFIG)
    handle.steps([train_batch(i) for i in range(K_STEPS)])
    saved = {}
    for mode in ("sync", "async"):
        ckpt = Checkpointer(handle, tmp_path / mode, keep=1, async_save=mode == "async")
        ckpt.save(K_STEPS)
        ckpt.close()  # finalizes the async one
        saved[mode] = ckpt.root.directory(K_STEPS)
    diff = diff_checkpoints(saved["sync"], saved["async"])
    experts = diff_checkpoints(saved["sync"], saved["async"], include=["decoder.layers.mlp.experts.",
                                                                         "optimizer.state.exp_avg.decoder.layers.mlp.experts."])
    report.add("tensors_differing", len(diff.mismatched) + len(diff.missing) + len(diff.extra) + len(diff.common),
               tolerance=0, passed=diff.ok, claim="exact", layout=layout, model=MODEL, compared="async vs sync save")
    assert diff.ok and diff.equal > 0, diff.summary()
    assert experts.equal >= 4, experts.summary()


# Crash safety with the MoE policy: the async keep=1 job of suites/checkpoint/test_crash_safety.py
# (a save after each step; SIGKILLed at a named point of the save of iteration 3, or not at all)
# training tiny Qwen3-MoE at dp2ep2. Nightly: each trial forks a training job of its own.
CRASH_POINTS = ["clean", "shard-writes", "before-commit", "tracker-rename"]


@pytest.mark.nightly
@pytest.mark.crash_injection
@pytest.mark.parametrize("point", CRASH_POINTS)
def test_moe_job_killed_mid_save_leaves_a_resumable_root(policy, device, point, world_pool, tmp_path_factory,
                                                          crash_cache, report):
    from harness.checkpoint.crash import CrashConfig, cached_trial

    if device != "cpu":
        pytest.skip("CPU worlds (dp2ep2 takes two ranks)")
    config = CrashConfig(True, 1, layout="dp2ep2", device=device, model=MODEL)
    how = {} if point == "clean" else {"point": point}
    verdict = cached_trial(crash_cache, config, tmp_path_factory.mktemp("moe-crash"), policy, **how)
    report.extend(verdict.rows(point=point))
    if point == "clean":
        assert verdict.outcome.completed and verdict.resumed == config.steps, verdict.summary()
    else:
        assert verdict.outcome.crashed and verdict.outcome.exitcode == -9, verdict.summary()
    assert verdict.passed, verdict.summary()


@pytest.mark.nightly
@pytest.mark.layout_pairs(cpu=[("dp2ep2", "tp2etp1-sp"), ("tp2etp1-sp", "dp2ep2")])
def test_gpt_oss_resume_at_another_expert_layout(policy, device, source, target, tmp_path, report):
    """gpt-oss (stack B only): the experts (with their biases) split over EP, then whole beside a TP split
    of the attention (its sinks split over the heads), and back."""
    skip_unless_converted("tiny-gpt-oss")
    _resume_elsewhere(policy, source, target, tmp_path, report, model="tiny-gpt-oss")


# DeepSeek-V3's and Moonlight's routed experts (layers 1-3, after the dense first one) and their Adam moments,
# per layer: what the re-save must hold as the source did.
MLA_PER_LAYER_EXPERTS = [f"{p}decoder.layers.{layer}.mlp.experts." for layer in (1, 2, 3)
                         for p in ("", "optimizer.state.exp_avg.")]


@pytest.mark.nightly
@pytest.mark.layout_pairs(cpu=[("dp2ep2", "pp2"), ("pp2", "dp2ep2"), ("dp2ep2", "tp2-sp")])
def test_deepseek_v3_resume_at_another_expert_layout(policy, device, source, target, tmp_path, report):
    """DeepSeek-V3 (both stacks): MLA (column-parallel under TP), the dense first layer, the router's
    expert bias (a buffer) and the shared experts reshard with the routed experts."""
    skip_unless_converted("tiny-deepseek-v3")
    _resume_elsewhere(policy, source, target, tmp_path, report, model="tiny-deepseek-v3", experts=MLA_PER_LAYER_EXPERTS)


@pytest.mark.nightly
@pytest.mark.layout_pairs(cpu=[("dp2ep2", "tp2-sp")])
def test_moonlight_resume_at_another_expert_layout(policy, device, source, target, tmp_path, report):
    """Moonlight (both stacks): MLA's one q_proj (whole per rank at dp2ep2, split by heads at tp2-sp) reshards
    with the rest of DeepSeek-V3's model: the re-save equals the source, the next step holds the bounds."""
    skip_unless_converted("tiny-moonlight")
    _resume_elsewhere(policy, source, target, tmp_path, report, model="tiny-moonlight", experts=MLA_PER_LAYER_EXPERTS)
