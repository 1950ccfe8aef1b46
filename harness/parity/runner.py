"""HF vs Megatron logprob parity for one (model, layout, dtype, device, variant) case.

Parent-side `run_parity` validates everything first (model, layout, variant, batch split), then one
call on the world loads the model through the bridge under the layout, computes Megatron logprobs
(forward-only schedule, vocab-parallel) and, once per model/dtype/device, the HF reference on the
same device. The comparison, its tolerances and the report rows are computed in the parent.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.data.rl_batch import RLBatch, standard_parity_batch
from harness.bridge.mbridge_compat import resolve_norm_precision, resolve_spec
from harness.parallel.layout import Layout, parse_layout, resolve, validate
from harness.parallel.state import run_in_layout
from harness.parity.metrics import compare_logprobs, top1_agreement
from harness.parity.tolerances import CheckResult, check, regime
from harness.tolerance import separation
from harness.parity.variants import FORCED_PACKING, apply_variant, check_variant
from harness.report import Row

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ParityCase:
    model: str  # zoo name or local HF checkpoint dir
    layout: Layout | str
    dtype: str = "fp32"
    variant: str | None = None
    micro_batches: int | None = None  # default: 2 per pipeline stage (1 without PP)
    batch_seed: int = 0
    packing: str = "right"  # "right" (remove left padding) or "packed" (see harness.logprobs.megatron)
    norm_precision: str = "auto"  # Megatron's RMSNorm rounding: "hf" on the local spec (see harness.bridge.norms)
    reference: str = "arranged"  # HF rounding like Megatron (harness.logprobs.arithmetic), or "plain" eager


REFERENCES = ("arranged", "plain")


@dataclass
class ParityResult:
    case: ParityCase
    layout: Layout
    device: str
    regime: str  # "exact" or "approximate" (harness.parity.tolerances.regime)
    norm_precision: str  # Megatron's RMSNorm rounding, resolved ("hf" or "fused")
    metrics: dict[str, float]
    checks: list[CheckResult]
    rows: list[Row] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(ok for *_, ok in self.checks)

    @property
    def separation(self) -> float:
        """How far the worst metric is past its bound (harness.tolerance.separation)."""
        return separation(self.checks)

    def summary(self) -> str:
        parts = [f"{m}={v:.3g} ({'ok' if ok else 'FAIL'} vs {t.limit:g})" for m, v, t, ok in self.checks]
        what = f"{self.case.model} {self.layout} {self.case.dtype} {self.device} ({self.regime})"
        if self.case.packing != "right":
            what += f" packing={self.case.packing}"
        if self.case.variant:
            what += f" variant={self.case.variant}"
        return f"{what}: " + ", ".join(parts)


def _micro_batches(case: ParityCase, layout: Layout, rows_per_dp: int) -> int:
    wanted = case.micro_batches or (2 * layout.pp if layout.pp > 1 else 1)
    layout.check_micro_batches(wanted)
    if rows_per_dp % wanted:
        raise ValueError(f"{rows_per_dp} rows per data-parallel rank do not split into {wanted} micro-batches")
    return wanted


# ----------------------------------------------------------------------------- rank-side
def _hf_reference(path: str, dtype: torch.dtype, batch: RLBatch, arranged_tp: int | None,
                  rows_per_forward: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF logprobs and top-1: arranged to round like Megatron at TP `arranged_tp`, one forward per
    `rows_per_forward` rows as Megatron's micro-batches; or plain eager HF when None."""
    from harness.launch import context
    from harness.logprobs.arithmetic import arrange_like_megatron
    from harness.logprobs.hf import hf_token_outputs
    from harness.models import build_hf_model

    model = build_hf_model(path, dtype=dtype).to(context().device)
    if arranged_tp is not None:
        arrange_like_megatron(model, tp=arranged_tp)
    device_batch = batch.to(context().device)
    with torch.no_grad():
        logprobs, top1 = hf_token_outputs(model, device_batch, micro_batch_size=rows_per_forward)
    del model
    return logprobs.cpu(), top1.cpu()


def _rank_parity(layout: Layout, path: str, dtype: torch.dtype, batch: RLBatch, micro_batches: int,
                 variant: str | None, packing: str, norm_precision: str, want_hf: bool,
                 arranged: tuple[int, int] | None):
    import torch.distributed as dist

    from harness.bridge import load_megatron_model
    from harness.logprobs.megatron import megatron_logprobs

    models = load_megatron_model(path, dtype=dtype, sequence_parallel=layout.sequence_parallel,
                                 norm_precision=norm_precision)
    apply_variant(variant, models)
    with torch.no_grad():
        result = megatron_logprobs(models, batch, micro_batches=micro_batches, packing=packing)
    del models
    want_hf = want_hf and dist.get_rank() == 0
    hf = _hf_reference(path, dtype, batch, *(arranged or (None, None))) if want_hf else None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result, hf


# ----------------------------------------------------------------------------- parent-side
def prepare_model(model: str, cache_dir: str | os.PathLike | None = None) -> tuple[Path, Any]:
    """The checkpoint dir (materialized once, here in the parent) and its HF config.

    Raises UnsupportedModelError (harness.bridge.preflight) for any model feature the bridge would
    not convert faithfully, from the config and the safetensors tensor names, before any rank works.
    """
    from harness.bridge.preflight import check_model_supported
    from harness.models import resolve_model

    path = resolve_model(model, cache_dir)
    return path, check_model_supported(path)


def run_parity(world, case: ParityCase, *, device: str | None = None, batch: RLBatch | None = None,
               hf_cache: dict | None = None, cache_dir: str | os.PathLike | None = None,
               suite: str = "parity", test: str = "") -> ParityResult:
    """Run one parity case on `world` and return metrics, tolerance checks and report rows."""
    device = device or world.device
    if case.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {case.dtype!r}")
    if case.reference not in REFERENCES:
        raise ValueError(f"reference must be one of {REFERENCES}, got {case.reference!r}")
    layout = case.layout if isinstance(case.layout, Layout) else parse_layout(case.layout)
    layout = resolve(layout, world.size)
    path, config = prepare_model(case.model, cache_dir)
    validate(layout, world.size, config)
    check_variant(case.variant, layout, config)
    batch = batch if batch is not None else standard_parity_batch(config.vocab_size, seed=case.batch_seed)
    batch.validate(config.vocab_size)
    micro = _micro_batches(case, layout, batch.batch_size // layout.dp)

    spec = resolve_spec("auto")
    norm_precision = resolve_norm_precision(case.norm_precision, spec)
    arithmetic = regime(layout, reference=case.reference, spec=spec, norm_precision=norm_precision)
    # The arranged reference rounds its row-parallel sums like the layout's TP, and runs one forward
    # per Megatron micro-batch: cuBLAS picks its bf16 GEMM by shape, so a whole-batch reference
    # differs from dp2/pp2 micro-batches (H200, qwen3-0.6b-shape bf16: max |d| 0.047 vs 9.5e-7).
    arranged = (layout.tp, batch.batch_size // layout.dp // micro) if case.reference == "arranged" else None
    key = (str(path), case.dtype, device, _batch_key(batch), arranged)
    cached = (hf_cache or {}).get(key)
    results = run_in_layout(
        world, layout, _rank_parity, str(path), DTYPES[case.dtype], batch, micro, case.variant,
        FORCED_PACKING.get(case.variant, case.packing), norm_precision,
        cached is None, arranged,
    )
    from harness.logprobs.megatron import assemble

    megatron_lp, megatron_top1 = assemble([r for r, _ in results])
    reference = cached or results[0][1]
    if hf_cache is not None:
        hf_cache[key] = reference
    hf_lp, hf_top = reference
    mask = batch.response_mask
    metrics = compare_logprobs(hf_lp, megatron_lp, mask)
    metrics["top1_agreement"] = top1_agreement(hf_top, megatron_top1, mask)
    checks = check(metrics, case.dtype, arithmetic)
    result = ParityResult(case, layout, device, arithmetic, norm_precision, metrics, checks)
    result.rows = _rows(result, suite, test, str(case.model))
    return result


def _batch_key(batch: RLBatch) -> int:
    return hash((batch.input_ids.numpy().tobytes(), batch.attention_mask.numpy().tobytes(),
                 batch.response_mask.numpy().tobytes()))


def _rows(result: ParityResult, suite: str, test: str, model: str) -> list[Row]:
    extra = {"variant": result.case.variant, "packing": result.case.packing,
             "tokens": result.metrics.get("tokens"), "regime": result.regime,
             "reference": result.case.reference, "norm_precision": result.norm_precision}
    return [
        Row(suite=suite, test=test, layout=result.layout.name, metric=metric, value=float(value),
            tolerance=tol.limit, passed=bool(ok), claim=tol.claim, model=model, dtype=result.case.dtype,
            device=result.device, extra={**extra, "tolerance_kind": tol.kind})
        for metric, value, tol, ok in result.checks
    ]
