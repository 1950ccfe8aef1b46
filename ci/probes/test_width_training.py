"""The training comparison at a real width on the CPU tier: what session 45 measured after its GPU runs.

Not collected by `pytest suites` (CI) or the nightly run: one model of 454 M parameters needs ~20 GB of host
memory (the policy rank's weights, gradients and Adam state, and the ground truth's) and 2-6 min on 2 cores.
Run by hand, with its report kept (reports/cpu/2026-12-01-width-training/):

    .venv/bin/pytest ci/probes/test_width_training.py --mrh-timeout 1200 --mrh-report-dir DIR

The model: Qwen3-8B's layer (hidden 4096, 32 heads of 128, 8 KV heads, intermediate 12288) once, a 32k
vocabulary, random weights from seed 0. The policy (local spec, gloo, tp1) against the single-process ground
truth at the -shape models' lr (suites/models/test_shapes.py, SHAPE_LR), in fp32 and in bf16 (unclipped).
"""
from __future__ import annotations

import pytest

from harness.training.invariance import LOSS, UNCLIPPED

from suites.models.test_shapes import SHAPE_LR
from suites.training.test_policy import _check

WIDTH = dict(hidden_size=4096, num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             intermediate_size=12288, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def width_model(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from harness.models.randomize import randomize_weights

    path = tmp_path_factory.mktemp("qwen3-width4096")
    model = AutoModelForCausalLM.from_config(Qwen3Config(**WIDTH), dtype=torch.float32)
    randomize_weights(model, 0)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.layouts(cpu=["tp1"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_hidden_4096_layer_trains_like_the_ground_truth(policy, device, layout, dtype, width_model, report):
    _check(policy, layout, report, model=width_model, dtype=dtype, loss=UNCLIPPED if dtype == "bf16" else LOSS,
           lr=SHAPE_LR)
