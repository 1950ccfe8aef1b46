"""Megatron chunks -> one full HF state dict (rank-side)."""
from __future__ import annotations

import torch

from harness.bridge.load import iter_hf_weights


@torch.no_grad()
def export_hf_state_dict(models: list[torch.nn.Module],
                         device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The full HF state dict of `models` (from `load_megatron_model`), on every rank.

    Call on every rank of the model-parallel group at once: tensors are broadcast over PP and
    gathered over TP. Keys are the checkpoint's (`save_pretrained`) names: a tied model has
    model.embed_tokens.weight and no lm_head.weight. Vocab padding is sliced off. Values are
    copies in the model's dtype on `device`; in float32 they equal the HF weights bit for bit.
    """
    state: dict[str, torch.Tensor] = {}
    for name, tensor in iter_hf_weights(models):
        # Copy: the bridge yields views into its gather buffers.
        tensor = tensor.detach().to(device).clone(memory_format=torch.contiguous_format)
        if name not in state:
            state[name] = tensor
        elif not torch.equal(state[name], tensor):
            # A tied model under PP keeps a second embedding copy on the last stage; Megatron keeps
            # the two in sync by all-reducing their grads, so a difference is a real bug.
            raise RuntimeError(f"{name}: the copies on different pipeline stages differ "
                               f"(max |diff| {(state[name] - tensor).abs().max().item():.3g})")
    return state
