"""Seeded random weights for zoo models, norms and biases included.

HF initializes norm weights to ones and biases to zeros. A bridge that forgets to load a norm or a
bias (or loads it into the wrong place) then still matches, because the Megatron default is the same
ones/zeros. Drawing every tensor at random makes such mapping bugs visible in the logits.
"""
from __future__ import annotations

import torch

NORM_SPREAD = 0.1  # norm weights ~ 1 + 0.1 * N(0, 1): near 1, so activations stay O(1)
BIAS_STD = 0.1
EXPERT_BIAS_BUFFERS = ("e_score_correction_bias",)  # router biases HF keeps as buffers, not parameters


def _draw(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith(".bias"):
        return BIAS_STD * noise
    if len(shape) == 1:  # every 1-D weight in these models is a norm scale
        return 1.0 + NORM_SPREAD * noise
    # Matrices (linear [out, in] and embedding [vocab, hidden]): std 1/sqrt(last dim) keeps
    # activations and logits O(1), so softmax is neither flat nor one-hot and errors show.
    return noise * shape[-1] ** -0.5


@torch.no_grad()
def randomize_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with values that depend only on (`seed`, parameter order, shape).

    Tied parameters appear once in `named_parameters()`, so a tied lm_head stays equal to the
    embedding.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        param.copy_(_draw(name, param.shape, generator))
    # DeepSeek-V3's router bias is a buffer (`e_score_correction_bias`, zeros in HF's init): drawn after
    # the parameters (so no other model's weights move), as a bias, so that a bridge that drops it shows.
    for name, buffer in model.named_buffers():
        if name.endswith(EXPERT_BIAS_BUFFERS):
            buffer.copy_(BIAS_STD * torch.randn(buffer.shape, generator=generator, dtype=torch.float32))
