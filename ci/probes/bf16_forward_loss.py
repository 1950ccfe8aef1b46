"""How far HF's own bf16 forward moves the training test's first loss: the yardstick for a bf16 training gap.

A -shape model's bf16 training test compares Megatron's loss with the ground truth's, which runs in fp32 arithmetic
on the weights rounded to bf16 (harness.training.ground_truth, "Weights"). Its first step's loss comes before any
update, so a gap there is the bf16 forward's rounding. gpt-oss-shape's first-step gap was 0.0167 and its second
0.0261, past the 0.02 bound (stack B, TE, H200, session 49). This computes, on the host (where the ground truth runs
on the GPU machines too), the same first-step loss twice on the same state: as the ground truth does, and with the
model itself in bf16 (HF's eager bf16, the reference implementation's own rounding). No Megatron, no GPU.

    .venv-b/bin/python ci/probes/bf16_forward_loss.py gpt-oss-shape > reports/cpu/DIR/NAME.json

Host memory: the fp32 model (4 bytes a parameter: 17.8 GB for gpt-oss-shape's 4.45 B), nothing else of its size.
Prints one JSON line: both losses, |difference| / max(|truth|, 1) (the test's loss_rel_diff), timings.
"""
from __future__ import annotations

import json
import platform
import sys
import time

import torch


def main(model_name: str) -> dict:
    from harness.logprobs import hf_logprobs
    from harness.models import build_hf_model
    from harness.training.ground_truth import GroundTruthTrainer
    from harness.training.invariance import OPTIM, UNCLIPPED, train_batch

    t0 = time.monotonic()
    hf = build_hf_model(model_name, dtype=torch.float32, seed=0)
    built_s = time.monotonic() - t0
    tb = train_batch(model_name)
    with torch.no_grad():  # the ground truth's on-policy old logprobs (invariance._ground_truth): unrounded fp32
        tb = tb.with_old_logprobs(hf_logprobs(hf, tb.batch) + 0.02 * tb.advantages.sign())
    trainer = GroundTruthTrainer(hf, **OPTIM, weights="bf16", **UNCLIPPED)  # rounds the weights to bf16 in place
    t1 = time.monotonic()
    with torch.no_grad():  # its first step's forward: the weights are the rounded ones before any update
        truth, _ = trainer._micro_losses(tb, micro_batches=2, backward=False)
    truth_s = time.monotonic() - t1
    hf.to(torch.bfloat16)  # the same values (already bf16-representable), now computed in bf16
    t2 = time.monotonic()
    with torch.no_grad():
        hf_bf16, _ = trainer._micro_losses(tb, micro_batches=2, backward=False)
    bf16_s = time.monotonic() - t2
    return {"model": model_name, "step": 0, "truth_loss": truth, "hf_bf16_loss": hf_bf16,
            "hf_bf16_loss_rel_diff": abs(hf_bf16 - truth) / max(abs(truth), 1.0),
            "loss": dict(UNCLIPPED), "truth_weights": "bf16", "device": "cpu", "torch": torch.__version__,
            "python": platform.python_version(), "seconds": {"build": built_s, "truth": truth_s, "hf_bf16": bf16_s}}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: bf16_forward_loss.py ZOO_MODEL")
    print(json.dumps(main(sys.argv[1])))
