"""Llama-3 RoPE scaling: Megatron reproduces HF's logprobs on sequences that run past the
checkpoint's original window, and the check notices when the scaling is dropped.

tiny-llama3 (harness.models.zoo) has an original window of 32 positions and a factor of 8, so six
of its eight RoPE frequencies are divided by 8 and one is smoothed. Megatron-Core 0.16.1 hard-codes
an original window of 8192: without the bridge's fix (harness.bridge.mbridge_compat, override 4)
its frequencies would differ from HF's by up to 7x. The batch's rows reach position 95.
"""
from __future__ import annotations

import pytest
import torch

from harness.data.rl_batch import make_rl_batch
from harness.models import TINY_VOCAB_SIZE
from harness.parity.runner import ParityCase, run_parity
from harness.pytest_plugin.worlds import skip_invalid_layout
from harness.parity.tolerances import tolerance

MODEL = "tiny-llama3"
ORIGINAL_WINDOW = 32  # the zoo model's original_max_position_embeddings


def long_batch():
    """4 rows of 80 to 96 tokens: responses start past the original window (right, left, no
    padding), so most response tokens attend across more than 32 positions."""
    return make_rl_batch(TINY_VOCAB_SIZE, batch_size=4, prompt_lengths=[40, 36, 48, 33],
                         response_lengths=[56, 44, 48, 50], padding=["right", "left", "none", "right"],
                         seed=11)


def test_the_batch_reaches_past_the_original_window():
    batch = long_batch()
    positions = batch.attention_mask.long().cumsum(-1) - 1  # token position within its row
    response_positions = positions[batch.response_mask]
    assert batch.attention_mask.sum(-1).max() == 96
    assert (response_positions >= ORIGINAL_WINDOW).float().mean() > 0.9


def test_the_scaling_changes_the_frequencies():
    """HF's llama3 inv_freq for tiny-llama3 differs from plain RoPE in 7 of 8 dims (else the test
    below would not test the scaling)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from harness.models import load_hf_config

    config = load_hf_config(MODEL)
    scaled, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    ratio = plain / scaled
    assert attention_factor == 1.0
    assert ratio[0] == 1.0 and 1.0 < ratio[1] < 8.0 and torch.allclose(ratio[2:], torch.tensor(8.0))


# (rope_theta, head_dim, llama3 values): the zoo model's, Llama 3.1's and Llama 3.2's (as published),
# and one whose smoothing band is wider than Llama's.
_LLAMA3_CASES = {
    "tiny-llama3": (10000.0, 16, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=32)),
    "llama-3.1": (500000.0, 128, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192)),
    "llama-3.2": (500000.0, 64, dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192)),
    "wide-band": (10000.0, 64, dict(factor=4.0, low_freq_factor=0.5, high_freq_factor=8.0,
                                    original_max_position_embeddings=1024)),
}


@pytest.mark.parametrize("case", list(_LLAMA3_CASES))
def test_megatron_llama3_frequencies_equal_hf(case):
    """The bridge's inv_freq (Megatron's own scaling function at the checkpoint's four values) equals
    HF's bit for bit; Megatron's stock path (GPTModel's rope_scaling + factor only) does so only
    for Llama 3.1's window and band (8192, 1, 4), which it hard-codes."""
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from harness.bridge.mbridge_compat import llama3_inv_freq
    from harness.bridge.preflight import rope_settings

    theta, head_dim, values = _LLAMA3_CASES[case]
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=2 * values["original_max_position_embeddings"],
                         rope_parameters={"rope_type": "llama3", "rope_theta": theta, **values})
    hf, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    stock = RotaryEmbedding(head_dim, 1.0, rotary_base=theta, rope_scaling=True,
                            rope_scaling_factor=values["factor"], use_cpu_initialization=True)
    assert torch.equal(llama3_inv_freq(stock, rope_settings(config), config), hf)
    llama31_band = (values["original_max_position_embeddings"], values["low_freq_factor"],
                    values["high_freq_factor"]) == (8192, 1.0, 4.0)
    assert torch.equal(stock.inv_freq, hf) == llama31_band


def _run_or_skip_invalid(world, case, **kwargs):
    with skip_invalid_layout():  # e.g. tp4 on a model with 2 query groups
        return run_parity(world, case, **kwargs)


@pytest.mark.layouts(cpu=["tp1", "tp2", "pp2"], cuda=["tp1", "tp2", "pp2"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_llama3_rope_scaling_matches_hf(world, device, layout, dtype, hf_cache, report):
    result = _run_or_skip_invalid(world, ParityCase(MODEL, layout, dtype), batch=long_batch(),
                                  hf_cache=hf_cache, test=report.test)
    report.extend(result.rows)
    assert result.passed, result.summary()


# (variant, model, layout): the rope-scaling negative controls (test_parity.py checks that every
# shipped variant has one).
NEGATIVE_CONTROLS = [("dropped-rope-scaling", MODEL, "tp2")]


@pytest.mark.parametrize("variant, model, layout", NEGATIVE_CONTROLS, ids=[v for v, *_ in NEGATIVE_CONTROLS])
def test_dropped_rope_scaling_fails_parity(world, device, variant, model, layout, hf_cache, report):
    """Plain RoPE on the Megatron side (HF keeps the scaling) must fail, far beyond fp32 noise.
    Measured (CPU, fp32, tp2, 2026-11-23): max |Δ| 3.60, top-1 agreement 0.26, against the fp32
    limit 1e-5 (the scaled model passes with 2.9e-6). Megatron's stock Llama-3 path without the
    bridge's fix (original window 8192) is as far off: 3.61 at tp1, because with a window of 8192
    it scales only the two lowest frequencies."""
    result = run_parity(world, ParityCase(model, layout, "fp32", variant=variant), batch=long_batch(),
                        hf_cache=hf_cache, test=report.test)
    report.extend(result.rows)
    assert not result.passed, f"dropped RoPE scaling went unnoticed: {result.summary()}"
    assert result.metrics["max_abs"] > 100 * tolerance("max_abs", "fp32").limit, result.summary()
