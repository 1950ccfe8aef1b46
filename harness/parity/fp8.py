"""FP8 forward logprobs (Transformer Engine on Hopper) against the bf16 run of the same weights.

RL frameworks run the trainer's forward in FP8 (verl, NeMo-RL and slime expose Megatron's `fp8`
settings) and must know how far that moves the logprobs the policy loss uses. This check loads the
same HF checkpoint twice on one rank set, as a bf16 model and as the same bf16 model with
megatron-core's FP8 settings on (`fp8="hybrid"`, `fp8_recipe`: its TE recipe wraps every layer's
GEMMs; the output layer and attention stay in bf16, as in Megatron training), and compares the
per-token logprobs of one batch (`compare_logprobs`, the parity metrics). Both forwards pad each
micro-batch on the right to a multiple of 16 tokens (TE's FP8 GEMMs need it; right pads change no
real token), so both see the same shapes.

Recipes (megatron-core's names): "delayed" (DelayedScaling: a tensor is scaled by the amax of the
forwards before it, so a first calibrating forward on the batch comes first, as a trainer's earlier
iterations would; with gradients on, because TE updates delayed scales only when
`torch.is_grad_enabled()` (TE 2.20.2 quantization.py, `autocast_exit`): a model that only ever ran
forwards under no_grad keeps its initial scales of 1) and "tensorwise" (Float8CurrentScaling: each tensor scaled by its own amax).
"blockwise" and "mxfp8" are left out: MXFP8 needs Blackwell, and Float8BlockScaling's 128-element
blocks are wider than the tiny models' 64-wide hidden rows.

The catalog control `fp8-stale-amax` calibrates on the same model with every layer's linear weights
at a quarter of their size (an older policy's amax history, not refreshed before the forward):
each FP8 scale is then 4x too large and the largest weights and activations saturate at FP8's max.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.report import Row
from harness.tolerance import CheckResult, separation

RECIPES = ("delayed", "tensorwise")
FP8_FORMAT = "hybrid"  # e4m3 in the forward (e5m2 only for gradients), Megatron's usual setting
ALIGN = 16  # TE's FP8 GEMMs: every dimension a multiple of 16
STALE_FACTOR = 0.25  # fp8-stale-amax: the calibrating forward's weights, relative to the real ones
IMPLEMENTED = ("fp8-stale-amax",)


class Fp8Error(ValueError):
    """FP8 cannot run here (device, spec, GPU, recipe): said before any rank works."""


@dataclass(frozen=True)
class Fp8Case:
    model: str
    layout: str = "tp1"
    recipe: str = "delayed"
    variant: str | None = None
    batch_seed: int = 0


@dataclass
class Fp8Result:
    case: Fp8Case
    layout: str
    device: str
    metrics: dict[str, float]
    checks: list[CheckResult]
    rows: list[Row] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def separation(self) -> float:
        return separation(self.checks)

    def summary(self) -> str:
        parts = [f"{c.metric}={c.value:.3g} ({'ok' if c.passed else 'FAIL'} vs {c.tolerance.limit:g})"
                 for c in self.checks]
        what = f"{self.case.model} {self.layout} fp8-{self.case.recipe} vs bf16 {self.device}"
        if self.case.variant:
            what += f" variant={self.case.variant}"
        return f"{what}: " + ", ".join(parts)


def why_not(device: str, spec: str, recipe: str) -> str | None:
    """Why FP8 cannot run on a world of `device` and `spec` (parent-side, nothing imported)."""
    if recipe not in RECIPES:
        return f"unknown FP8 recipe {recipe!r}; choose from {', '.join(RECIPES)}"
    if device != "cuda":
        return "FP8 runs on CUDA only (Transformer Engine's FP8 GEMMs; no CPU kernels)"
    if spec != "te":
        return "FP8 runs on Transformer Engine's layer spec only: the local spec has no FP8 GEMMs"
    return None


def overrides(recipe: str) -> dict[str, Any]:
    """megatron-core's TransformerConfig fields that turn the forward into FP8 with `recipe`."""
    return {"fp8": FP8_FORMAT, "fp8_recipe": recipe}


# ----------------------------------------------------------------------------- rank-side
def _require_fp8_gpu() -> None:
    import transformer_engine.pytorch as te

    available, reason = te.is_fp8_available(return_reason=True)
    if not available:
        raise Fp8Error(f"this GPU cannot run FP8: {reason}")


@contextlib.contextmanager
def _layer_weights_scaled(models: list[torch.nn.Module], factor: float):
    """Every 2-D weight of the transformer layers times `factor` (a power of two: exact in bf16),
    and back on exit."""
    from harness.bridge import unwrap_model

    weights = [p for chunk in unwrap_model(models) for name, p in chunk.named_parameters()
               if name.startswith("decoder.layers.") and p.dim() == 2]
    with torch.no_grad():
        for p in weights:
            p.mul_(factor)
    try:
        yield
    finally:
        with torch.no_grad():
            for p in weights:
                p.div_(factor)


def _rank_fp8(layout, path: str, batch, micro_batches: int, recipe: str, variant: str | None):
    from harness.bridge import load_megatron_model
    from harness.logprobs.megatron import megatron_logprobs

    _require_fp8_gpu()

    def logprobs(models, grad: bool = False):
        with torch.set_grad_enabled(grad):
            return megatron_logprobs(models, batch, micro_batches=micro_batches, length_multiple=ALIGN)

    reference = logprobs(load_megatron_model(path, dtype=torch.bfloat16))
    gc.collect()
    models = load_megatron_model(path, dtype=torch.bfloat16, config_overrides=overrides(recipe))
    if recipe == "delayed":  # the scales come from the amax of earlier forwards: calibrate first,
        # with gradients on: TE updates delayed scales only then (module docstring)
        with _layer_weights_scaled(models, STALE_FACTOR if variant == "fp8-stale-amax" else 1.0):
            logprobs(models, grad=True)
    quantized = logprobs(models)
    del models
    gc.collect()
    torch.cuda.empty_cache()
    return reference, quantized


# ----------------------------------------------------------------------------- parent-side
def run_fp8(world, case: Fp8Case, *, suite: str = "parity", test: str = "") -> Fp8Result:
    """FP8 vs bf16 logprobs of `case.model` on `world` (module docstring), checked against the FP8
    table (harness.parity.tolerances.FP8). Fp8Error before any rank works if FP8 cannot run there."""
    from harness.data.rl_batch import standard_parity_batch
    from harness.logprobs.megatron import assemble
    from harness.parallel.layout import parse_layout, resolve, validate
    from harness.parallel.state import run_in_layout
    from harness.parity.metrics import compare_logprobs, top1_agreement
    from harness.parity.runner import default_micro_batches, prepare_model
    from harness.parity.tolerances import FP8
    from harness.variants import require

    why = why_not(world.device, world.spec, case.recipe)
    if why:
        raise Fp8Error(why)
    if case.variant is not None:
        require(case.variant, check="fp8")
        if case.recipe != "delayed":
            raise Fp8Error(f"variant {case.variant!r} breaks delayed scaling's amax history: recipe 'delayed' only")
    layout = resolve(parse_layout(case.layout), world.size)
    path, config = prepare_model(case.model)
    validate(layout, world.size, config)
    batch = standard_parity_batch(config.vocab_size, seed=case.batch_seed)
    micro = default_micro_batches(layout)
    results = run_in_layout(world, layout, _rank_fp8, str(path), batch, micro, case.recipe, case.variant)
    bf16_lp, bf16_top1 = assemble([r[0] for r in results])
    fp8_lp, fp8_top1 = assemble([r[1] for r in results])
    metrics = compare_logprobs(bf16_lp, fp8_lp, batch.response_mask)
    metrics["top1_agreement"] = top1_agreement(bf16_top1, fp8_top1, batch.response_mask)
    checks = FP8.check(metrics, "bf16", "fp8")
    result = Fp8Result(case, layout.name, world.device, metrics, checks)
    result.rows = [
        Row(suite=suite, test=test, layout=layout.name, metric=c.metric, value=c.value, tolerance=c.tolerance.limit,
            passed=c.passed, claim=c.claim, model=case.model, dtype="bf16", device=world.device, spec=world.spec,
            extra={"variant": case.variant, "recipe": case.recipe, "fp8_format": FP8_FORMAT,
                   "tokens": metrics["tokens"], "compared_to": "bf16", "tolerance_kind": c.tolerance.kind})
        for c in checks]
    return result
