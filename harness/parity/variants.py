"""Negative controls: shipped wrong variants of the Megatron side that the parity check must catch.

Each variant reproduces a real class of bridge/runtime bug. The parity suite proves each one fails
the check, so a passing parity run means something (the suite is sensitive), and the measured Δ of
each variant goes into the report.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from harness.parallel.layout import Layout


@dataclass(frozen=True)
class Variant:
    name: str
    description: str
    applies: Callable[[Layout, bool], str | None]  # (layout, tied) -> None or why it does not apply
    packing: str | None = None  # forces how the batch is fed (see harness.logprobs.megatron)
    # (HF config) -> None or why the variant does not apply to that model.
    applies_to_model: Callable[[Any], str | None] | None = None


def _always(layout: Layout, tied: bool) -> str | None:
    return None


def _tied_under_pp(layout: Layout, tied: bool) -> str | None:
    if not tied or layout.pp < 2:
        return "needs a tied-embedding model and pp >= 2 (only then does the last stage keep its own copy)"
    return None


def _llama3_rope(config: Any) -> str | None:
    from harness.bridge.preflight import rope_settings

    if rope_settings(config).llama3 is None:
        return "needs a model with Llama-3 RoPE scaling (rope_type 'llama3', e.g. tiny-llama3)"
    return None


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("swapped-gate-up", "SwiGLU gate and up projections swapped in every MLP", _always),
    Variant("wrong-rope-base", "RoPE base 100x the checkpoint's (e.g. 1e6 instead of 1e4)", _always),
    Variant("scaled-norm", "layer 0 input norm weight scaled by 1.01", _always),
    Variant("unmasked-padding", "padded rows fed as they are: left pads visible, positions shifted",
            _always, packing="none"),
    Variant("unsynced-tied-embedding",
            "tied model under PP: the last stage's output-layer copy of the embedding not loaded "
            "(mbridge PR 14)", _tied_under_pp),
    Variant("dropped-rope-scaling",
            "Llama-3 RoPE scaling dropped on the Megatron side: plain RoPE at the checkpoint's base "
            "(what a bridge that ignores rope_parameters builds)", _always,
            applies_to_model=_llama3_rope),
)}


class VariantError(ValueError):
    """An unknown variant, or one that does not apply to the model/layout."""


def check_variant(name: str | None, layout: Layout, tied: bool, config: Any = None) -> Variant | None:
    """The variant, after checking it exists and applies (parent-side, before any work); with the
    model's HF `config`, also that it applies to that model (rank-side `apply_variant` checks that
    again)."""
    if name is None:
        return None
    if name not in VARIANTS:
        raise VariantError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    variant = VARIANTS[name]
    why_not = variant.applies(layout, tied)
    if why_not:
        raise VariantError(f"variant {name!r} does not apply to layout {layout}: {why_not}")
    why_not = variant.applies_to_model(config) if config is not None and variant.applies_to_model else None
    if why_not:
        raise VariantError(f"variant {name!r} does not apply to this model: {why_not}")
    return variant


# ----------------------------------------------------------------------------- rank-side
def _params(models: list[torch.nn.Module]):
    from mbridge.core.util import unwrap_model

    for chunk in unwrap_model(list(models)):
        yield chunk, dict(chunk.named_parameters())


@torch.no_grad()
def _swap_gate_up(models) -> None:
    for _, params in _params(models):
        for name, weight in params.items():
            if name.endswith("mlp.linear_fc1.weight"):
                # Each TP shard holds [gate_shard; up_shard] stacked on dim 0.
                gate, up = weight.chunk(2, dim=0)
                weight.copy_(torch.cat([up, gate], dim=0))


@torch.no_grad()
def _wrong_rope_base(models) -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for chunk, _ in _params(models):
        rope = chunk.rotary_pos_emb
        dim = rope.inv_freq.numel() * 2
        # inv_freq = base^(-2i/dim): 100x the base multiplies each exponent by 100^(-2i/dim).
        scale = 100.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=rope.inv_freq.device) / dim)
        rope.inv_freq = (rope.inv_freq.double() * scale).to(rope.inv_freq.dtype)
    RotaryEmbedding.forward.cache_clear()  # freqs are memoized per (module, length)


_LAYER0_NORM = re.compile(r"decoder\.layers\.0\.(input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)$")


@torch.no_grad()
def _scale_norm(models) -> None:
    for chunk, params in _params(models):
        if chunk.decoder.layers[0].layer_number != 1:
            continue  # global layer 0 lives on the first (virtual) stage only
        for name, weight in params.items():
            if _LAYER0_NORM.search(name):
                weight.mul_(1.01)


@torch.no_grad()
def _unsync_tied_embedding(models) -> None:
    for chunk, params in _params(models):
        if getattr(chunk, "post_process", False) and not getattr(chunk, "pre_process", True):
            weight = params["output_layer.weight"]
            generator = torch.Generator().manual_seed(1234)
            fresh = torch.randn(weight.shape, generator=generator) * weight.float().std().item()
            weight.copy_(fresh.to(weight.dtype))


@torch.no_grad()
def _drop_rope_scaling(models) -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from harness.bridge import hf_bridge
    from harness.bridge.preflight import rope_settings

    hf_config = hf_bridge(models).hf_config
    why_not = _llama3_rope(hf_config)
    if why_not:  # a no-op variant would "pass" its negative control
        raise VariantError(f"variant 'dropped-rope-scaling': {why_not}")
    for chunk, _ in _params(models):
        rope = chunk.rotary_pos_emb
        plain = RotaryEmbedding(kv_channels=rope.inv_freq.numel() * 2, rotary_percent=1.0,
                                rotary_base=rope_settings(hf_config).theta, use_cpu_initialization=True)
        rope.inv_freq = plain.inv_freq.to(rope.inv_freq.device)
    RotaryEmbedding.forward.cache_clear()  # freqs are memoized per (module, length)


_APPLY: dict[str, Callable] = {
    "swapped-gate-up": _swap_gate_up,
    "wrong-rope-base": _wrong_rope_base,
    "scaled-norm": _scale_norm,
    "unmasked-padding": lambda models: None,  # acts on the input, see Variant.packing
    "unsynced-tied-embedding": _unsync_tied_embedding,
    "dropped-rope-scaling": _drop_rope_scaling,
}


def apply_variant(name: str | None, models: list[torch.nn.Module]) -> None:
    """Make `models` wrong in the way `name` says (rank-side, after loading the weights)."""
    if name is not None:
        _APPLY[name](models)
