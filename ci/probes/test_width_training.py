"""The training comparison at a real width on the CPU tier: what session 45 measured after its GPU runs.

Not collected by `pytest suites` (CI) or the nightly run: one model of 454 M parameters needs ~20 GB of host
memory (the policy rank's weights, gradients and Adam state, and the ground truth's) and ~2 min a test on 2
cores in fp32 (bf16 on these CPUs, which have no bf16 arithmetic, took 27 min: bf16 is the GPU runs').
Run by hand, with its report kept (reports/cpu/2026-12-01-width-training/):

    .venv/bin/pytest ci/probes/test_width_training.py --mrh-timeout 1200 --mrh-report-dir DIR

The model: Qwen3-8B's layer (hidden 4096, 32 heads of 128, 8 KV heads, intermediate 12288) once, a 32k
vocabulary, random weights from seed 0. The policy (local spec, gloo, tp1) against the single-process ground
truth at the -shape models' lr (suites/models/test_shapes.py, SHAPE_LR), and why that lr: at 1e-4 the ground
truth's second step already diverges there.
"""
from __future__ import annotations

import pytest

from harness.training.invariance import LOSS, ground_truth

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
def test_a_hidden_4096_layer_trains_like_the_ground_truth(policy, device, layout, width_model, report):
    _check(policy, layout, report, model=width_model, lr=SHAPE_LR)


def test_at_lr_1e_4_the_second_step_diverges_at_this_width(width_model, report):
    """Adam's first step moves every weight by ~lr; at hidden 4096 (weights of std 4096 ** -0.5) 1e-4 is enough
    for the second step's ratios to explode: its loss is orders of magnitude past the first's."""
    _, steps, _ = ground_truth(width_model, LOSS, 1e-4)
    first, second = abs(steps[0]["loss"]), abs(steps[1]["loss"])
    report.add("second_step_loss_over_first", second / first, tolerance=None, passed=True, claim="observed",
               layout="tp1", lr=1e-4)
    assert second > 1e3 * first, (first, second)
