"""Issue 37's `-shape` models on GPU: each family's published widths, heads, head dims, experts, top-k and
vocab (4 layers, random weights from a seed) give HF's logprobs in Megatron-Core on Transformer Engine.

These are the bf16 regimes re-measured at real widths: hidden 1152-5120, 128 experts with top-8 routing
and its near-ties. Each bf16 run is also evaluated in fp32 on the same state, held to the fp32 bounds,
which is the control that keeps a fine conversion bug visible under bf16 noise.

The models are built from configs and written once per machine. The 3-8 B-parameter checkpoints are
stored in fp32 (12-32 GB), so these tests are CUDA-only and nightly. GLM-4.5 and DeepSeek-V3 at full
width (13-15 B parameters with their 160-256 experts) are not here: in fp32 their weights alone fill
an 80 GB card.

The family's stack refuses it by name where it cannot build it (skip_unless_converted): gpt-oss runs on
stack B only, Gemma 3 and Qwen2-MoE on stack A only (Gemma 3 there on the local spec only, harness.bridge.gemma3).
DeepSeek-V3's MLA runs as Moonlight-16B-A3B's shape (moonlight-shape: 64 experts of 1408, ~2.4B parameters at 4
layers), which one GPU holds where DeepSeek-V3's own does not.

Training and checkpoints at real widths: the policy's two steps against the single-process ground truth
(harness.training.invariance, the training table's bounds), and a checkpoint of the trained state resumed at
its own layout, the next step bit for bit (harness.checkpoint.resume_check). One GPU each (tp1); resuming
under another layout takes two.
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest

from harness.checkpoint.resume_check import resume_and_compare, train_and_save
from harness.parity.runner import ParityCase, run_parity
from harness.pytest_plugin.worlds import skip_invalid_layout, skip_unless_converted
from harness.training.invariance import LOSS, UNCLIPPED

from suites.training.test_policy import _check

DENSE = ["qwen3-8b-shape", "gemma3-shape"]
MOE = ["qwen3-30b-a3b-shape", "glm4.5-air-shape", "gpt-oss-shape", "qwen2-moe-shape", "moonlight-shape"]
# The GPU layouts: tp1, tp2, pp2, and ep2 for the experts (ep2 on 2 ranks is dp2ep2). With tp,
# megatron-core's MoE layer needs sequence parallelism: tp2-sp.
DENSE_LAYOUTS = ["tp1", "tp2", "pp2"]
MOE_LAYOUTS = ["tp1", "dp2ep2", "tp2-sp", "pp2"]
pytestmark = [pytest.mark.nightly, pytest.mark.parametrize("dtype", ["bf16", "fp32"])]
# What one GPU must hold at tp1 (GiB): glm4.5-air-shape (8.2 B parameters) holds its bf16 model and that
# state's fp32 copy (49 GB), then HF's fp32 reference (33 GB). An 80 GB H100 ran out at 50.4 GiB allocated
# (2026-11-27, da99309); the other layouts split the experts or the layers over two GPUs.
TP1_GIB = {"glm4.5-air-shape": 100}


def _total_gib() -> float:
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30


def _on_its_spec(model: str, spec: str) -> None:
    skip_unless_converted(model)
    if model.startswith("gemma3") and spec == "te":
        pytest.skip("harness.bridge.gemma3 builds Gemma 3 on the local spec only (docs/gemma3.md)")


# Where the HF reference's own bf16 is the noisy side: (model, dtype) -> what was measured. Its bf16 logprobs
# against Megatron's are past the approximate-moe bounds, and HF's bf16 is as far from the fp32 logprobs of the
# same bf16 weights (harness.parity.runner.bf16_noise): the bf16-vs-HF rows are then recorded (claim "observed"),
# and the case is held to the fp32 evaluation of the same state and to Megatron's bf16 being no farther from fp32
# than HF's own (noise_ratio <= 1: the reference implementation's noise, a claim, not a fitted figure).
NOISY_HF_BF16 = {
    ("gpt-oss-shape", "bf16"): (
        "gpt-oss-shape's eager HF bf16 is the noisy side (stack B, TE, H200, 2026-12-02): against the fp32 "
        "logprobs of the same bf16 weights HF's bf16 is mean |d| 0.0707 off with top-1 0.80, Megatron's 0.042 "
        "with 0.916 (noise_ratio 0.59); the bf16-vs-HF gap (0.075, top-1 0.79) is HF's. The other MoE shapes: "
        "qwen3-30b-a3b-shape 0.027 vs 0.0195 (ratio 0.71)"),
    # moonlight-shape was here until the MLA latent norm fix (harness.bridge.mla_norms): its bf16-vs-HF
    # token_mult_prob_error then sat on the approximate-moe bound (1.083 against 1.08, stack B, H200, 2026-12-03).
    # With the fix it is within every approximate-moe bound on both stacks (1.067 / 1.055, mean |d| 0.061 / 0.050,
    # top-1 0.82 / 0.83; TE, H100, 2026-12-06, reports/gpu/2026-12-06-h100-session50), and Megatron's bf16 is as far
    # from fp32 as HF's own (noise_ratio 1.001 on stack A, 0.75 on B): held to the bounds against HF, like the others.
}
# Where fp32 at a real width passed the wide regime's bounds against HF's fp32, bounds measured between two fp32
# engines (each rounding): model -> what was measured. Its fp32 rows against HF's fp32 are then recorded (claim
# "observed", their bound beside them) and the gate is the same bounds against HF in float64 on the same weights
# (ParityCase.fp64_reference), where only Megatron's fp32 rounding is left: shared rounding passes it, Megatron's
# own excess does not.
FP32_AGAINST_FP64 = {
    "moonlight-shape": (
        "moonlight-shape's fp32 against HF's fp32 (TE, H200, 2026-12-03): mean |d| 5.40e-6 (stack B) and 5.48e-6 "
        "(stack A) past the wide regime's 5e-6 (max 1.81e-5 within 2e-5, top-1 1.0). Against HF's float64 (stack A) "
        "Megatron's fp32 was 5.33e-6 off and HF's own fp32 2.03e-6 (ratio 2.6; the bf16 state's 5.79e-6 and 1.54e-6): "
        "the excess was Megatron's MLA latent norm taking rms_norm_eps where HF's takes 1e-6 (bisected on the CPU "
        "tier: ratio 4.5 at these widths, 1.15 with the epsilons equal; fixed in harness.bridge.mla_norms). Rerun "
        "with the fix (TE, H100, 2026-12-06): 2.05e-6 against HF's 2.03e-6 from float64 on stack A (ratio 1.009), "
        "2.10e-6 on stack B (1.035); 1.53e-6 from HF's fp32. The gate stays on the model that found it"),
}


def _parity(world, layout, model, dtype, hf_cache, report):
    _on_its_spec(model, world.spec)
    if layout == "tp1" and model in TP1_GIB and world.run(_total_gib)[0] < TP1_GIB[model]:
        pytest.skip(f"{model} at tp1 needs a GPU of >= {TP1_GIB[model]} GiB (an 80 GB H100 ran out of memory)")
    case = ParityCase(model, layout, dtype, fp64_reference=model in FP32_AGAINST_FP64)
    with skip_invalid_layout():
        result = run_parity(world, case, hf_cache=hf_cache, test=report.test)
    if dtype == "bf16" and result.regime != "exact":  # TE's kernels: the same state also held in fp32
        assert "fp32" in result.evaluated_in, result.summary()
    observed = {"bf16"} if (model, dtype) in NOISY_HF_BF16 else set()
    if model in FP32_AGAINST_FP64:
        observed.add("fp32")
    # the rows held to another gate for the record, their bound kept beside them
    report.extend([dataclasses.replace(row, claim="observed", passed=True, tolerance=None,
                                       extra={**row.extra, "bound": row.tolerance, "within_bound": row.passed})
                   if row.extra.get("evaluated_in") in observed and row.tolerance is not None else row
                   for row in result.rows])
    gating = [ok for (*_, ok), within in zip(result.checks, result.evaluated_in) if within not in observed]
    assert gating and all(gating), result.summary()
    if model in FP32_AGAINST_FP64:
        assert "fp32-vs-fp64" in result.evaluated_in, result.summary()
    if (model, dtype) in NOISY_HF_BF16:
        _held_to_hf_noise(result, report)


def _held_to_hf_noise(result, report) -> None:
    """NOISY_HF_BF16's gate (beside the fp32 evaluation's bounds): Megatron's bf16 no noisier than HF's."""
    assert "noise_ratio" in result.metrics, result.summary()
    ratio = result.metrics["noise_ratio"]
    report.add("noise_ratio", ratio, tolerance=1.0, passed=ratio <= 1.0, claim="bounded", layout=result.layout.name,
               model=result.case.model, dtype=result.case.dtype, tolerance_kind="max",
               why=NOISY_HF_BF16[(result.case.model, result.case.dtype)])
    assert ratio <= 1.0, result.summary()


@pytest.mark.layouts(cuda=DENSE_LAYOUTS)
@pytest.mark.parametrize("model", DENSE)
def test_dense_shape_models_match_hf(world, device, layout, model, dtype, hf_cache, report):
    _parity(world, layout, model, dtype, hf_cache, report)


@pytest.mark.layouts(cuda=MOE_LAYOUTS)
@pytest.mark.parametrize("model", MOE)
def test_moe_shape_models_match_hf(world, device, layout, model, dtype, hf_cache, report):
    _parity(world, layout, model, dtype, hf_cache, report)


# What one GPU trains at tp1 in fp32 with Adam (16 bytes a parameter): the 2-4 B-parameter shapes. The
# ground truth trains on the host (its model, gradients, Adam state and a copy of the start: 20 bytes a
# parameter). glm4.5-air-shape (8.2 B) would need 131 GB on the GPU.
TRAIN = ["qwen3-8b-shape", "qwen3-30b-a3b-shape", "gpt-oss-shape", "gemma3-shape", "qwen2-moe-shape", "moonlight-shape"]
# The learning rate of the -shape models' steps: RL's (1e-6). At the tiny models' 1e-3, Adam's first step moves
# every weight by ~1e-3, 6% of a hidden-4096 weight (std 4096 ** -0.5): the second step's loss was 8.7e9 on
# qwen3-8b-shape (H200, 2026-12-01), ratios of e^20 that turn 1e-7 differences into 5e-4. At 1e-4 the CPU tier's
# hidden-4096 layer still diverged (loss 8.4e6; bf16 then 2x off its ground truth), at 1e-5 its ratios left the
# clip range for 90% of the tokens (docs/families.md). The weights then move 2e-6, under the weight bound: the
# comparison's guard is the second step's loss (suites/training/test_policy.py).
SHAPE_LR = 1e-6
# A checkpoint of the 8B shape holds 8 GB of fp32 weights and 16 GB of Adam state; moonlight-shape's (~2.4 B
# parameters: MLA without q LoRA, 64 experts a sparse layer, a checkpoint of ~29 GB) is the one MoE shape's.
RESUME = ["qwen3-8b-shape", "moonlight-shape"]


@pytest.mark.layouts(cuda=["tp1"])
@pytest.mark.parametrize("model", TRAIN)
def test_shape_models_train_like_the_ground_truth(policy, device, layout, model, dtype, report):
    _on_its_spec(model, policy.spec)
    # bf16 without the ratio clip: a ratio rounded across the clip boundary moves the grad norm by that
    # token's whole share (one token of 95 for tiny-qwen3-moe: 8.3% here on the CPU tier, 17.7% on 4x H100
    # at cp2ep2, docs/context-parallel.md), which is the clip's, not the width's; fp32 keeps it.
    # bf16 against the ground truth that runs on its weights rounded to bf16 as Megatron's bf16 copy of its fp32
    # main parameters (harness.training.ground_truth, "Weights"): at SHAPE_LR an update is below bf16's spacing
    # (1e-6 against 6e-5 at a weight of 0.016), and the plain fp32 ground truth's second step saw it where no bf16
    # run can (H200, 2026-12-02: step-2 loss 0.39 apart on qwen3-8b-shape, 0.13 on qwen3-30b-a3b-shape, 0.08 on
    # gemma3-shape; step 1 within 1.8e-3).
    # Where HF's own bf16 is the noisy side (NOISY_HF_BF16), the loss is held to the larger of the bf16 bound and
    # how far HF's own bf16 forward of each step's state is from the ground truth (compare_to_ground_truth's
    # loss_within_hf_bf16): gpt-oss-shape's first step, before any update, was 0.0167 off (session 49), and HF's
    # own bf16 of that state is 0.0295 off (ci/probes/bf16_forward_loss.py on the CPU tier, 2026-12-06,
    # reports/cpu/2026-12-06-bf16-forward-loss). The grad norm and the weights keep the table's bounds.
    _check(policy, layout, report, model=model, dtype=dtype, loss=UNCLIPPED if dtype == "bf16" else LOSS, lr=SHAPE_LR,
           truth_weights=dtype, loss_within_hf_bf16=(model, dtype) in NOISY_HF_BF16)


@pytest.mark.layouts(cuda=["tp1"])
@pytest.mark.parametrize("model", RESUME)
def test_shape_models_resume_exactly_at_their_layout(policy, device, layout, model, dtype, tmp_path, report):
    _on_its_spec(model, policy.spec)
    directory = tmp_path / "ckpt"
    try:
        source = train_and_save(policy, layout, directory, model=model, dtype=dtype, lr=SHAPE_LR)
        result = resume_and_compare(policy, source, layout)
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # the next tests' checkpoints need the disk
    report.extend(result.rows())
    assert result.passed, result.summary()
