"""HF vs Megatron logprob parity for one (model, layout, dtype, device, variant) case.

Parent-side `run_parity` validates everything first (model, layout, variant, batch split), then one
call on the world loads the model through the bridge under the layout, computes Megatron logprobs
(forward-only schedule, vocab-parallel) and, once per model/dtype/device, the HF reference on the
same device. The comparison, its tolerances and the report rows are computed in the parent.

A bf16 case whose arithmetic cannot be reproduced by the reference (the approximate regime:
Transformer Engine's kernels, TP > 2, a plain reference) cannot see a 1% bug in bf16 noise
(~1e-2): no statistic over the tokens separated the fine controls from the correct model there
(CPU, tiny-qwen3, 1790 tokens: mean signed |d| 1.8e-4 correct, 7.8e-5 scaled-norm, 6.2e-4
wrong-rope-base; std 0.0129, 0.0159, 0.0139). So such a case also checks *what the bf16 model
holds* exactly (`fp32_eval`): its whole state (every parameter and buffer, as loaded and as any
variant left it) is copied into an fp32 model of the same spec and layout, whose logprobs are held
to the fp32 bounds against HF in fp32 on the bf16-rounded weights. Rows say which comparison they
are (`extra.evaluated_in`: "bf16" or "fp32"); the bf16 arithmetic itself keeps its approximate bounds.
The fp32 model is built by the same code as the bf16 one, so a variant that changes how the model
routes (its configuration, not its state: `harness.parity.variants.ROUTING`) is applied to it too.
"""
from __future__ import annotations

import dataclasses
import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.data.rl_batch import RLBatch, standard_parity_batch
from harness.bridge.norms import resolve_norm_precision
from harness.bridge.specs import resolve as resolve_spec
from harness.logprobs.megatron import CP_PACKINGS
from harness.parallel.layout import (Layout, LayoutError, check_backend, parse_layout, resolve, sliding_window,
                                     validate)
from harness.parallel.state import run_in_layout
from harness.parity.metrics import compare_logprobs, top1_agreement
from harness.parity.tolerances import CheckResult, check, fp32_regime, regime
from harness.tolerance import separation
from harness.parity.variants import FEEDING, FORCED_PACKING, ROUTING, apply_variant, check_variant
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
    fp32_eval: bool | None = None  # also evaluate the bf16 model's state in fp32 (module docstring);
    # None: where the bf16 arithmetic is in the approximate regime
    dispatcher: str | None = None  # a MoE model's token dispatcher (harness.bridge.load.DISPATCHERS); None: the bridge's
    cp_comm_type: str | None = None  # context parallelism's exchange (CP_COMM_TYPES); None: megatron-core's (p2p)
    fp64_reference: bool = False  # also HF in float64 on the same weights: every fp32 comparison again against it,
    # where only Megatron's fp32 rounding is left (evaluated_in "fp32-vs-fp64"; HF's own fp32 rounding beside it)


REFERENCES = ("arranged", "plain")
# megatron-core's TransformerConfig.cp_comm_type values ("a2a+p2p" needs cp >= 4: the layout's
# hierarchical CP groups, Layout.hierarchical_cp_sizes).
CP_COMM_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")


@dataclass
class ParityResult:
    case: ParityCase
    layout: Layout
    device: str
    regime: str  # "exact", "approximate" or "approximate-moe" (harness.parity.tolerances.regime)
    norm_precision: str  # Megatron's RMSNorm rounding, resolved ("hf" or "fused")
    metrics: dict[str, float]
    checks: list[CheckResult]  # the bf16/fp32 arithmetic's, then the fp32 evaluation's (if any)
    rows: list[Row] = field(default_factory=list)
    spec: str = "local"  # the layer spec the Megatron model was built with
    evaluated_in: list[str] = field(default_factory=list)  # per check: the dtype its logprobs were computed in

    @property
    def passed(self) -> bool:
        return all(ok for *_, ok in self.checks)

    @property
    def separation(self) -> float:
        """How far the worst metric is past its bound (harness.tolerance.separation)."""
        return separation(self.checks)

    def summary(self) -> str:
        label = {self.case.dtype: "", "fp32-vs-fp64": "vs-fp64 "}
        parts = [f"{label.get(e, 'fp32-eval ')}{m}={v:.3g} ({'ok' if ok else 'FAIL'} vs {t.limit:g})"
                 for (m, v, t, ok), e in zip(self.checks, self.evaluated_in)]
        what = f"{self.case.model} {self.layout} {self.case.dtype} {self.device} {self.spec} ({self.regime})"
        if self.case.packing != "right":
            what += f" packing={self.case.packing}"
        if self.case.variant:
            what += f" variant={self.case.variant}"
        noise = ""
        if "noise_ratio" in self.metrics:  # bf16_noise: each engine's bf16 against fp32 on the same weights
            noise = (f"; bf16 vs fp32 mean |d|: megatron {self.metrics['noise_megatron_mean_abs']:.3g}, "
                     f"hf {self.metrics['noise_hf_mean_abs']:.3g} (ratio {self.metrics['noise_ratio']:.3g})")
        if "fp64_noise_ratio" in self.metrics:  # the fp32 comparisons' float64 reference
            noise += (f"; fp32 vs HF fp64 mean |d|: megatron {self.metrics['fp64_noise_megatron_mean_abs']:.3g}, "
                      f"hf {self.metrics['fp64_noise_hf_mean_abs']:.3g} (ratio {self.metrics['fp64_noise_ratio']:.3g})")
        return f"{what}: " + ", ".join(parts) + noise


def default_micro_batches(layout: Layout) -> int:
    """2 per pipeline stage (the schedule needs >= PP of them), 1 without PP."""
    return 2 * layout.pp if layout.pp > 1 else 1


def _micro_batches(case: ParityCase, layout: Layout, rows_per_dp: int) -> int:
    wanted = case.micro_batches or default_micro_batches(layout)
    layout.check_micro_batches(wanted)
    if rows_per_dp % wanted:
        raise ValueError(f"{rows_per_dp} rows per data-parallel rank do not split into {wanted} micro-batches")
    return wanted


# ----------------------------------------------------------------------------- rank-side
def _hf_reference(path: str, dtype: torch.dtype, batch: RLBatch, arranged_tp: int | None,
                  rows_per_forward: int | None, expert_tp: int | None = None,
                  compute: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF logprobs and top-1: arranged to round like Megatron at TP `arranged_tp` (the experts' at
    `expert_tp`), one forward per `rows_per_forward` rows as Megatron's micro-batches; or plain
    eager HF when None. `compute`: compute in that dtype on the weights rounded to `dtype` (the
    fp32 evaluation of a bf16 model)."""
    from harness.launch import context
    from harness.logprobs.arithmetic import arrange_like_megatron
    from harness.logprobs.hf import hf_token_outputs, hf_unpadded_token_outputs
    from harness.models import build_hf_model

    model = build_hf_model(path, dtype=dtype)
    if compute is not None:
        model = model.to(compute)
    model = model.to(context().device)
    if arranged_tp is not None:
        arrange_like_megatron(model, tp=arranged_tp, expert_tp=expert_tp)
    device_batch = batch.to(context().device)
    with torch.no_grad():
        if compute == torch.float64:  # its padded rows would be NaN (hf_unpadded_token_outputs)
            logprobs, top1 = hf_unpadded_token_outputs(model, device_batch)
        else:
            logprobs, top1 = hf_token_outputs(model, device_batch, micro_batch_size=rows_per_forward)
    del model
    return logprobs.cpu(), top1.cpu()


def _rank_parity(layout: Layout, path: str, dtype: torch.dtype, batch: RLBatch, micro_batches: int,
                 variant: str | None, packing: str, norm_precision: str, want_hf: bool,
                 arranged: tuple[int, int] | None, fp32_eval: bool, dispatcher: str | None = None,
                 cp_comm_type: str | None = None, fp64: bool = False):
    import torch.distributed as dist

    from harness.bridge import load_megatron_model
    from harness.logprobs.megatron import megatron_logprobs

    overrides = {**({"moe_token_dispatcher_type": dispatcher} if dispatcher else {}),
                 **({"cp_comm_type": cp_comm_type} if cp_comm_type else {})} or None
    models = load_megatron_model(path, dtype=dtype, sequence_parallel=layout.sequence_parallel,
                                 norm_precision=norm_precision, config_overrides=overrides)
    apply_variant(variant, models)
    feeding = variant if variant in FEEDING else None
    with torch.no_grad():
        result = megatron_logprobs(models, batch, micro_batches=micro_batches, packing=packing, variant=feeding)
    evaluated = None
    if fp32_eval:
        # TE has no fp32 attention under context parallelism: the fp32 evaluation runs the same
        # state with CP folded into DP (CP ranks hold whole, identical weights, like DP ranks).
        with _folded(layout):
            shadow = load_megatron_model(path, dtype=torch.float32, sequence_parallel=layout.sequence_parallel,
                                         norm_precision=norm_precision,
                                         config_overrides={"moe_token_dispatcher_type": dispatcher} if dispatcher else None)
            if variant in ROUTING:  # what the code does to the bf16 model it does to this one (module docstring)
                apply_variant(variant, shadow)
            copy_state(models, shadow)
            del models
            with torch.no_grad():
                evaluated = megatron_logprobs(shadow, batch, micro_batches=micro_batches, packing=packing,
                                              variant=feeding)
            del shadow
    else:
        del models
    want_hf = want_hf and dist.get_rank() == 0
    hf = _hf_reference(path, dtype, batch, *(arranged or (None, None, None))) if want_hf else None
    hf_fp32 = (_hf_reference(path, dtype, batch, *(arranged or (None, None, None)), compute=torch.float32)
               if want_hf and fp32_eval else None)
    hf_fp64 = (_hf_reference(path, dtype, batch, *(arranged or (None, None, None)), compute=torch.float64)
               if want_hf and fp64 else None)
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return result, hf, evaluated, hf_fp32, hf_fp64


def fp32_layout(layout: Layout) -> Layout:
    """Where a layout's fp32 evaluation runs: the layout itself, or with CP folded into DP
    (Transformer Engine has no fp32 attention backend under context parallelism: its fused
    attention is fp16/bf16 only and its unfused one does not support CP)."""
    if layout.cp == 1:
        return layout
    return dataclasses.replace(layout, cp=1, dp=layout.dp * layout.cp)


@contextmanager
def _folded(layout: Layout):
    """Megatron's parallel state for `fp32_layout(layout)` (rank-side; every rank at once)."""
    if layout.cp == 1:
        yield
        return
    from harness.parallel.state import model_parallel

    with model_parallel(fp32_layout(layout), seed=None):
        yield


def copy_state(source: list[torch.nn.Module], target: list[torch.nn.Module]) -> None:
    """Everything `source`'s chunks hold into `target`'s (same spec and layout, any dtype), by name:
    every parameter and buffer, and every tensor a module keeps as a plain attribute (Megatron's
    RoPE `inv_freq` is one): the target then holds exactly what the source holds, upcast."""
    from harness.bridge import unwrap_model

    for src, dst in zip(unwrap_model(source), unwrap_model(target), strict=True):
        targets = dict(dst.named_modules())
        if set(targets) != {name for name, _ in src.named_modules()}:
            raise RuntimeError(f"the two models differ in modules: {sorted(set(targets) ^ {n for n, _ in src.named_modules()})[:8]}")
        with torch.no_grad():
            for name, module in src.named_modules():
                into = targets[name]
                for attr, tensor in vars(module).items():
                    if isinstance(tensor, torch.Tensor) and isinstance(getattr(into, attr, None), torch.Tensor):
                        setattr(into, attr, tensor.to(getattr(into, attr).dtype))  # a plain tensor attribute
                for attr, tensor in [*module._parameters.items(), *module._buffers.items()]:
                    have = getattr(into, attr, None)
                    if tensor is None or have is None:
                        if (tensor is None) != (have is None):
                            raise RuntimeError(f"{name}.{attr}: present in one model only")
                        continue
                    if have.shape != tensor.shape:
                        raise RuntimeError(f"{name}.{attr}: shape {tuple(tensor.shape)} vs {tuple(have.shape)}")
                    have.copy_(tensor)


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
    spec = resolve_spec(world.spec)  # the world's ranks build the model on it
    check_backend(layout, device, spec, case.dtype, case.packing)
    if case.packing == "thd" and sliding_window(config):
        raise LayoutError(f"packing 'thd' with sliding-window attention (sliding_window={sliding_window(config)}): "
                          "the harness feeds a windowed model rows or a block-diagonal mask ('packed')")
    if layout.cp > 1 and case.packing not in CP_PACKINGS:
        raise LayoutError(f"layout {layout.name} with packing {case.packing!r}: context parallelism feeds "
                          f"{', '.join(CP_PACKINGS)} (TE's attention splits causal rows or THD slots, not a mask)")
    if case.cp_comm_type is not None:
        if layout.cp == 1:
            raise ValueError(f"cp_comm_type {case.cp_comm_type!r} needs a context-parallel layout, got {layout.name}")
        if case.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {case.cp_comm_type!r}")
        if case.cp_comm_type == "a2a+p2p" and layout.hierarchical_cp_sizes is None:
            raise ValueError(f"cp_comm_type 'a2a+p2p' at {layout.name}: the hierarchical exchange needs cp >= 4 "
                             "(all-to-all inside pairs of CP ranks, a ring between them)")
    from harness.bridge.preflight import num_experts

    if case.dispatcher is not None and not num_experts(config):
        raise ValueError(f"{case.model} has no experts: a token dispatcher applies to MoE models only")
    check_variant(case.variant, layout, config)
    batch = batch if batch is not None else standard_parity_batch(config.vocab_size, seed=case.batch_seed)
    batch.validate(config.vocab_size)
    micro = _micro_batches(case, layout, batch.batch_size // layout.dp)

    norm_precision = resolve_norm_precision(case.norm_precision, spec)
    packing = FORCED_PACKING.get(case.variant, case.packing)
    arithmetic = regime(layout, reference=case.reference, spec=spec, norm_precision=norm_precision, packing=packing,
                        dispatcher=_dispatcher(case, config))
    # The arranged reference rounds its row-parallel sums like the layout's TP, and runs one forward
    # per Megatron micro-batch: cuBLAS picks its bf16 GEMM by shape, so a whole-batch reference
    # differs from dp2/pp2 micro-batches (H200, qwen3-0.6b-shape bf16: max |d| 0.047 vs 9.5e-7).
    # A MoE model's experts round their linear_fc2 under their own tensor parallelism (etp).
    arranged = ((layout.tp, batch.batch_size // layout.dp // micro, layout.expert_tp)
                if case.reference == "arranged" else None)
    fp32_eval = case.fp32_eval if case.fp32_eval is not None else (case.dtype == "bf16" and arithmetic != "exact")
    if fp32_eval and case.dtype != "bf16":
        raise ValueError("fp32_eval evaluates a bf16 model's state in fp32: the case must be bf16")
    if case.fp64_reference and case.dtype == "bf16" and not fp32_eval:
        raise ValueError("fp64_reference checks fp32 logprobs: a bf16 case needs its fp32 evaluation (fp32_eval)")
    if fp32_eval:  # at CP it runs with CP folded into DP (fp32_layout): its micro-batches must split too
        _micro_batches(case, fp32_layout(layout), batch.batch_size // fp32_layout(layout).dp)
    key = (str(path), case.dtype, device, _batch_key(batch), arranged)
    cached = [(hf_cache or {}).get(key), (hf_cache or {}).get(key + ("fp32",)) if fp32_eval else None,
              (hf_cache or {}).get(key + ("fp64",)) if case.fp64_reference else None]
    want_hf = (cached[0] is None or (fp32_eval and cached[1] is None)
               or (case.fp64_reference and cached[2] is None))
    results = run_in_layout(
        world, layout, _rank_parity, str(path), DTYPES[case.dtype], batch, micro, case.variant,
        packing, norm_precision, want_hf, arranged, fp32_eval, case.dispatcher, case.cp_comm_type,
        case.fp64_reference,
    )
    from harness.logprobs.megatron import assemble

    references = [cached[0] or results[0][1], cached[1] or results[0][3], cached[2] or results[0][4]]
    if hf_cache is not None:
        for suffix, reference in zip(((), ("fp32",), ("fp64",)), references):
            if reference is not None:
                hf_cache[key + suffix] = reference
    compared = [(case.dtype, arithmetic, assemble([r[0] for r in results]), references[0])]
    if fp32_eval:  # the bf16 model's state, evaluated in fp32: the fp32 bounds
        compared.append(("fp32", "exact", assemble([r[2] for r in results]), references[1]))
    metrics, checks, evaluated_in = {}, [], []
    for computed_in, regime_of, (megatron_lp, megatron_top1), (hf_lp, hf_top) in compared:
        found = compare_logprobs(hf_lp, megatron_lp, batch.response_mask)
        found["top1_agreement"] = top1_agreement(hf_top, megatron_top1, batch.response_mask)
        # fp32 at real widths sums longer rows: its own entries (tolerances.fp32_regime)
        made = check(found, computed_in, fp32_regime(config.hidden_size) if computed_in == "fp32" else regime_of)
        checks += made
        evaluated_in += [computed_in] * len(made)
        metrics.update(found if computed_in == case.dtype else {f"fp32_eval_{k}": v for k, v in found.items()})
    noise = bf16_noise(references[0], references[1], compared[0][2], batch.response_mask) if fp32_eval else {}
    metrics.update(noise)
    if case.fp64_reference:  # the fp32 comparison (the case's, or the fp32 evaluation's) against HF's float64
        _, _, megatron_fp32, hf_fp32 = compared[-1]
        assert compared[-1][0] == "fp32", compared[-1][0]
        # bf16_noise's measure one precision up: each engine's fp32 against HF's float64. Megatron's distance is
        # held to the fp32 bounds of the width: measured between two fp32 engines (each rounding), they are at
        # least as strict against a reference without rounding of its own.
        noise64 = bf16_noise(hf_fp32, references[2], megatron_fp32, batch.response_mask)
        prefix = "noise_megatron_"
        made = check({k[len(prefix):]: v for k, v in noise64.items() if k.startswith(prefix)}, "fp32",
                     fp32_regime(config.hidden_size))
        fp64 = {f"fp64_{k}": v for k, v in noise64.items()}
        checks += made
        evaluated_in += ["fp32-vs-fp64"] * len(made)
        metrics.update(fp64)  # Megatron's own rows are the checks': the rest recorded beside them
        noise.update({k: v for k, v in fp64.items() if not k.startswith("fp64_noise_megatron_")})
    result = ParityResult(case, layout, device, arithmetic, norm_precision, metrics, checks, spec=spec,
                          evaluated_in=evaluated_in)
    result.rows = _rows(result, suite, test, str(case.model)) + _noise_rows(result, noise, suite, test, str(case.model))
    return result


def bf16_noise(hf: tuple[torch.Tensor, torch.Tensor], hf_fp32: tuple[torch.Tensor, torch.Tensor],
               megatron: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """How far each engine's bf16 logprobs are from the fp32 logprobs of the same bf16-rounded
    weights: HF's own bf16 ("noise_hf_*") and Megatron's ("noise_megatron_*"), and the ratio of their
    mean |d| ("noise_ratio"). A bf16 gap between the two engines that is as large as HF's own bf16
    rounding (ratio ~1) is the model's sensitivity to bf16, which no engine avoids; a ratio well above
    1 is Megatron's bf16 path adding error of its own. Recorded for the record (claim "observed"):
    the gate stays the fp32 evaluation of the same state."""
    out: dict[str, float] = {}
    for name, (logprobs, top1) in (("hf", hf), ("megatron", megatron)):
        found = compare_logprobs(hf_fp32[0], logprobs, mask)
        out.update({f"noise_{name}_{k}": float(found[k]) for k in ("max_abs", "mean_abs", "kl_k3")})
        out[f"noise_{name}_top1_agreement"] = top1_agreement(hf_fp32[1], top1, mask)
    out["noise_ratio"] = out["noise_megatron_mean_abs"] / max(out["noise_hf_mean_abs"], 1e-30)
    return out


def _noise_rows(result: ParityResult, noise: dict[str, float], suite: str, test: str, model: str) -> list[Row]:
    def extra(metric: str) -> dict:
        return {**_extra(result), "evaluated_in": "fp32-vs-fp64" if metric.startswith("fp64_") else "bf16-vs-fp32"}

    return [Row(suite=suite, test=test, layout=result.layout.name, metric=metric, value=value, tolerance=None,
                passed=True, claim="observed", model=model, dtype=result.case.dtype, device=result.device,
                spec=result.spec, extra=extra(metric)) for metric, value in noise.items()]


def _dispatcher(case: ParityCase, config) -> str | None:
    """A MoE model's token dispatcher as the ranks will run it (the bridges' default: alltoall)."""
    from harness.bridge.preflight import num_experts

    return (case.dispatcher or "alltoall") if num_experts(config) else None


def _batch_key(batch: RLBatch) -> int:
    return hash((batch.input_ids.numpy().tobytes(), batch.attention_mask.numpy().tobytes(),
                 batch.response_mask.numpy().tobytes()))


def _extra(result: ParityResult) -> dict:
    """What every row of a parity result says about its case."""
    return {"variant": result.case.variant, "packing": result.case.packing,
            "tokens": result.metrics.get("tokens"), "regime": result.regime,
            "reference": result.case.reference, "norm_precision": result.norm_precision,
            **({"dispatcher": result.case.dispatcher} if result.case.dispatcher else {})}


def _rows(result: ParityResult, suite: str, test: str, model: str) -> list[Row]:
    extra = _extra(result)
    return [
        Row(suite=suite, test=test, layout=result.layout.name, metric=metric, value=float(value),
            tolerance=tol.limit, passed=bool(ok), claim=tol.claim, model=model, dtype=result.case.dtype,
            device=result.device, spec=result.spec,
            extra={**extra, "tolerance_kind": tol.kind, "evaluated_in": evaluated_in})
        for (metric, value, tol, ok), evaluated_in in zip(result.checks, result.evaluated_in, strict=True)
    ]
