"""Reproduce a catalog entry: run its check on the variant and on the fixed path, side by side.

    repro = reproduce("scaled-norm", layout="tp2", dtype="bf16", runner=runner)
    repro.reproduced   # the variant fails its check by >= SENSITIVITY_MARGIN
    repro.fix_holds    # the fixed path passes the same check
    repro.separating   # the metric that separates them, with both values

The checks: logprob parity vs HF for bridge/logprobs variants (harness.parity.runner), training vs
the single-process ground truth for training variants (harness.training.invariance), resume vs the
uninterrupted run for checkpoint variants (harness.checkpoint.resume_check). suites/sensitivity
runs every entry through here in fp32 and bf16 at several layouts; `mrh repro ID` runs one.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from harness.report import Row
from harness.tolerance import SENSITIVITY_MARGIN, CheckResult
from harness.variants.catalog import Variant, VariantError, get

DTYPES = ("fp32", "bf16")


@dataclass
class Runner:
    """Where the runs happen: `world_for(size, env=None)` gives a live world of that many ranks on
    the device (`env`: one of its own, for a variant that needs its ranks started so),
    `make_policy(layout, model, **config)` a PolicyHandle (the `policy` fixture, or
    `Runner.from_pool`'s), `workdir` holds checkpoints, `hf_cache` HF reference logprobs."""

    device: str
    world_for: Callable[[int], Any]
    make_policy: Callable[..., Any]
    workdir: Path
    hf_cache: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)  # what a check makes once per run (e.g. a reference)
    spec: str = "local"  # the layer spec of its worlds (a crash trial's job starts a world of its own)
    engine: str | None = None  # weight-sync, routing-replay: the rollout engine, if not the entry's own (e.g. "vllm")
    engine_options: dict = field(default_factory=dict)  # weight-sync: the engine's (e.g. transport="broadcast")

    @classmethod
    def from_pool(cls, pool, device: str, workdir: Path) -> "Runner":
        from harness.parallel.state import as_layout
        from harness.training.handles import PolicyHandle

        def make_policy(layout, model, **config):
            return PolicyHandle(pool.get(as_layout(layout).world_size, device), layout, model, **config)

        return cls(device, lambda size, env=None: pool.get(size, device, env=env), make_policy, Path(workdir),
                   spec=pool.spec.get(device, "local"))


@dataclass
class Run:
    """One run of a check: on the variant or on the fixed path."""

    passed: bool
    checks: list[CheckResult]
    summary: str
    rows: list[Row]

    @property
    def worst(self) -> CheckResult | None:
        return max(self.checks, key=lambda c: c.margin, default=None)

    @property
    def separation(self) -> float:
        worst = self.worst
        return worst.margin if worst else 0.0


@dataclass
class Repro:
    variant: Variant
    layout: str
    dtype: str
    device: str
    buggy: Run
    fixed: Run

    @property
    def reproduced(self) -> bool:
        return not self.buggy.passed and self.buggy.separation >= SENSITIVITY_MARGIN

    @property
    def fix_holds(self) -> bool:
        return self.fixed.passed

    @property
    def separating(self) -> tuple[str, float, float | None, CheckResult] | None:
        """(metric, variant's value, fixed path's value, the variant's check) for the metric by which
        the variant fails most (in units of its bound)."""
        worst = self.buggy.worst
        if worst is None:
            return None
        fixed = {c.metric: c.value for c in self.fixed.checks}.get(worst.metric)
        return worst.metric, worst.value, fixed, worst

    def separation_row(self) -> Row:
        ok = self.buggy.separation >= SENSITIVITY_MARGIN
        worst = self.buggy.worst
        return Row(suite="", test="", layout=self.layout, metric="separation", value=self.buggy.separation,
                   tolerance=SENSITIVITY_MARGIN, passed=ok, claim="control", dtype=self.dtype, device=self.device,
                   extra={"variant": self.variant.id, "worst_metric": worst.metric if worst else None,
                          "tolerance_kind": "min", "fix_holds": self.fix_holds})

    def rows(self) -> list[Row]:
        """The variant's figures (observed: its claim is the separation row's, a control), the fixed
        path's (their own claims: it must pass), and the separation."""
        buggy = [dataclasses.replace(row, claim="observed") for row in self.buggy.rows]
        return buggy + self.fixed.rows + [self.separation_row()]


# ----------------------------------------------------------------------------------- the checks
def _parity(variant: Variant, layout: str, dtype: str, runner: Runner) -> tuple[Run, Run]:
    from harness.parallel.layout import parse_layout
    from harness.parity.runner import ParityCase, run_parity

    size = parse_layout(layout).world_size

    def run(variant_id):
        world = runner.world_for(size, env=dict(variant.world_env)) if variant_id else runner.world_for(size)
        result = run_parity(world, ParityCase(variant.model, layout, dtype, variant=variant_id, **dict(variant.options)),
                            hf_cache=runner.hf_cache, suite="sensitivity")
        return Run(result.passed, list(result.checks), result.summary(), result.rows)

    return run(variant.id), run(None)


def _training(variant: Variant, layout: str, dtype: str, runner: Runner) -> tuple[Run, Run]:
    from harness.training.invariance import compare_to_ground_truth, policy_config

    def run(variant_id):
        policy = runner.make_policy(layout, variant.model, **policy_config(dtype=dtype, variant=variant_id))
        try:
            result = compare_to_ground_truth(policy, model=variant.model)
        finally:
            policy.close()
        return Run(result.passed, [c for _, c in result.checks], result.summary(), result.rows(variant.model))

    return run(variant.id), run(None)


def _checkpoint(variant: Variant, layout: str, dtype: str, runner: Runner) -> tuple[Run, Run]:
    from harness.checkpoint.resume_check import resume_and_compare, train_and_save

    source, target = _pair(layout)
    directory = runner.workdir / f"{variant.id}-{source}-{dtype}-{runner.device}"
    src = train_and_save(runner.make_policy, source, directory, dtype=dtype, deterministic=True,
                         **dict(variant.options))

    def run(variant_id):
        result = resume_and_compare(runner.make_policy, src, target, variant=variant_id)
        return Run(result.passed, result.checks, result.summary(), result.rows())

    return run(variant.id), run(None)


def _crash_safety(variant: Variant, layout: str, dtype: str, runner: Runner) -> tuple[Run, Run]:
    """A crash trial of the variant's job (harness.checkpoint.crash) killed at its fault point,
    beside the same trial on the fixed path; overlapping-async-saves has a check of its own."""
    import uuid

    from harness.checkpoint.crash import CrashConfig, cached_trial
    from harness.checkpoint.resume_check import MODEL

    options = dict(variant.options)
    if options["crash"] is None:
        from harness.checkpoint.overlap import overlapping_saves

        def overlap(variant_id):
            result = overlapping_saves(runner.make_policy, layout, runner.workdir / f"overlap-{uuid.uuid4().hex[:8]}",
                                       dtype=dtype, variant=variant_id)
            return Run(result.passed, result.checks, result.summary(), result.rows())

        return overlap(variant.id), overlap(None)
    config = CrashConfig(options["async_save"], options["keep"], layout=layout, device=runner.device, dtype=dtype,
                         spec=runner.spec)
    made = []

    def resident():  # the policy both resumes load into, made only if a trial is not cached
        if not made:
            made.append(runner.make_policy(layout, MODEL, **config.policy_config))
        return made[0]

    def run(variant_id):
        verdict = cached_trial(runner.cache, dataclasses.replace(config, variant=variant_id), runner.workdir,
                               runner.make_policy, resident=resident, point=options["crash"])
        return Run(verdict.passed, verdict.checks, verdict.summary(), verdict.rows(point=options["crash"]))

    return run(variant.id), run(None)


def _offload(variant: Variant, layout: str, dtype: str, runner: Runner) -> tuple[Run, Run]:
    """The offload round trip (harness.offload.check) with the variant, beside the fixed path."""
    from harness.offload.check import round_trip

    def run(variant_id):
        result = round_trip(runner.make_policy, layout, dtype, variant=variant_id, device=runner.device,
                            model=_model(variant))
        return Run(result.passed, result.checks, result.summary(), result.rows())

    return run(variant.id), run(None)


def _weight_sync(variant: Variant, layout: str, dtype: str, runner: Runner) -> tuple[Run, Run]:
    """A training step, a sync into the variant's engine (HF or vLLM), the engine against the policy
    (harness.rollout.check), with the variant and on the fixed path."""
    from harness.rollout.check import sync_check
    from harness.rollout.vllm_engine import VLLM_TWINS

    engine = runner.engine or variant.engine
    model = VLLM_TWINS.get(variant.model, variant.model) if engine == "vllm" else variant.model

    def run(variant_id):
        result = sync_check(runner.make_policy, layout, dtype, variant=variant_id, device=runner.device,
                            model=model, engine=engine, engine_options=dict(runner.engine_options) or None)
        return Run(result.passed, result.checks, result.summary(), result.rows())

    return run(variant.id), run(None)


def _fp8(variant: Variant, layout: str, dtype: str, runner: Runner) -> tuple[Run, Run]:
    """FP8 vs bf16 logprobs of the same weights (harness.parity.fp8), with the variant and without."""
    from harness.parallel.layout import parse_layout
    from harness.parity.fp8 import Fp8Case, run_fp8

    world = runner.world_for(parse_layout(layout).world_size)

    def run(variant_id):
        result = run_fp8(world, Fp8Case(variant.model, layout, dict(variant.options)["recipe"], variant=variant_id),
                         suite="sensitivity")
        return Run(result.passed, list(result.checks), result.summary(), result.rows)

    return run(variant.id), run(None)


def _routing_replay(variant: Variant, layout: str, dtype: str, runner: Runner) -> tuple[Run, Run]:
    """The engine's routes replayed by a fresh policy (harness.training.replay_check): the trainer's
    routing against the engine's (HF's, or vLLM's with `runner.engine`), the router grads under a
    drifted replay; variant and fixed path."""
    from harness.training.replay_check import replay_check

    def run(variant_id):
        result = replay_check(runner.make_policy, layout, dtype, variant=variant_id, device=runner.device,
                              model=variant.model, engine=runner.engine or "hf")
        return Run(result.passed, result.checks, result.summary(), result.rows())

    return run(variant.id), run(None)


_CHECKS: dict[str, Callable[[Variant, str, str, Runner], tuple[Run, Run]]] = {
    "bridge": _parity, "logprobs": _parity, "precision": _parity, "training": _training, "checkpoint": _checkpoint,
    "rotation": _crash_safety, "offload": _offload, "weight-sync": _weight_sync, "fp8": _fp8,
    "routing-replay": _routing_replay,
}


def _pair(layout: str) -> tuple[str, str]:
    source, sep, target = layout.partition("->")
    if not sep or not source or not target:
        raise VariantError(f"a checkpoint variant runs on a layout pair 'source->target', got {layout!r}")
    return source, target


def preflight(variant_id: str, layout: str | None, dtype: str, world_size_limit: int | None = None,
              device: str | None = None) -> tuple[Variant, str]:
    """(entry, layout) after checking everything a repro needs, before any rank starts: the id,
    the dtype, the layout(s) against the model and the variant. Raises VariantError."""
    from harness.models import load_hf_config
    from harness.parallel.layout import LayoutError, parse_layout, resolve, validate

    variant = get(variant_id)
    if dtype not in DTYPES:
        raise VariantError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype not in variant.dtypes:
        raise VariantError(f"variant {variant.id!r} shows in {', '.join(variant.dtypes)} only, not {dtype}")
    if device is not None and device not in variant.devices:
        raise VariantError(f"variant {variant.id!r} shows on {', '.join(variant.devices)} only, not {device}")
    why_not_here = variant.why_not_here(device, dtype) if device is not None else None
    if why_not_here:
        raise VariantError(f"variant {variant.id!r} cannot show here: {why_not_here}")
    layout = layout or variant.default_layout
    config = load_hf_config(_model(variant))
    from harness.bridge.backends import current
    from harness.bridge.preflight import bridge_converts

    if not bridge_converts(config):
        raise VariantError(f"variant {variant.id!r} shows on {_model(variant)}, which the {current()} bridge "
                           "does not convert")
    names = _pair(layout) if variant.component == "checkpoint" else (layout,)
    if variant.pair_requires is not None:
        why_not = variant.pair_requires(*(parse_layout(name) for name in names))
        if why_not:
            raise VariantError(f"variant {variant.id!r} does not apply to {layout}: {why_not}")
    for name in names:
        try:
            parsed = parse_layout(name)
            resolved = resolve(parsed, parsed.world_size)
            validate(resolved, parsed.world_size, config)
        except LayoutError as exc:
            raise VariantError(f"layout {name!r}: {' '.join(str(exc).split())}") from None
        if world_size_limit is not None and parsed.world_size > world_size_limit:
            raise VariantError(f"layout {name!r} needs {parsed.world_size} ranks; at most {world_size_limit} here")
        why_not = variant.why_not(resolved, config)
        if why_not:
            raise VariantError(f"variant {variant.id!r} does not apply to layout {name}: {why_not}")
    return variant, layout


_DEFAULT_MODEL = next(f.default for f in dataclasses.fields(Variant) if f.name == "model")


def _model(variant: Variant) -> str:
    if variant.component == "checkpoint":
        from harness.checkpoint.resume_check import MODEL

        return MODEL
    if variant.component == "offload":  # the round trip's model, unless the entry names its own (MoE)
        from harness.offload.check import MODEL

        return variant.model if variant.model != _DEFAULT_MODEL else MODEL
    return variant.model


def reproduce(variant_id: str, *, layout: str | None = None, dtype: str = "bf16", runner: Runner) -> Repro:
    """Run the entry's check on the variant and on the fixed path (see the module docstring)."""
    variant, layout = preflight(variant_id, layout, dtype, device=runner.device)
    buggy, fixed = _CHECKS[variant.component](variant, layout, dtype, runner)
    return Repro(variant, layout, dtype, runner.device, buggy, fixed)


def describe(repro: Repro) -> str:
    """The repro as a person reads it: both runs and the metric that separates them."""
    v = repro.variant
    lines = [f"{v.id} ({v.component}, {v.kind}) at {repro.layout}, {repro.dtype}, {repro.device}",
             f"  wrong:    {v.description}", f"  symptom:  {v.symptom}",
             f"  upstream: {v.upstream or '-'}", *([f"  versions: {v.versions()}"] if v.versions() else []),
             f"  check:    {v.caught_by}",
             f"  variant:  {'PASS' if repro.buggy.passed else 'FAIL'}  {repro.buggy.summary}",
             f"  fixed:    {'PASS' if repro.fixed.passed else 'FAIL'}  {repro.fixed.summary}"]
    separating = repro.separating
    if separating:
        metric, value, fixed, check = separating
        bound = f"{'<=' if check.tolerance.kind == 'max' else '>='} {check.tolerance.limit:g}"
        margin = "inf (an exact bound)" if math.isinf(check.margin) else f"{check.margin:.3g}"
        fixed_text = "-" if fixed is None else f"{fixed:.4g}"
        lines.append(f"  separating metric: {metric}: variant {value:.4g}, fixed {fixed_text} "
                     f"(bound {bound}); the variant is {margin}x past it (needs >= {SENSITIVITY_MARGIN:g})")
    verdict = ("REPRODUCED: the variant fails its check by the margin and the fixed path passes"
               if repro.reproduced and repro.fix_holds else
               "NOT REPRODUCED: " + "; ".join(
                   ([] if repro.reproduced else ["the variant does not fail by the margin"]) +
                   ([] if repro.fix_holds else ["the fixed path fails its check"])))
    return "\n".join(lines + [verdict])


def as_dict(repro: Repro) -> dict[str, Any]:
    metric, value, fixed, _ = repro.separating or (None, None, None, None)
    return {"id": repro.variant.id, "layout": repro.layout, "dtype": repro.dtype, "device": repro.device,
            "reproduced": repro.reproduced, "fix_holds": repro.fix_holds,
            "separation": repro.buggy.separation, "separating_metric": metric,
            "variant_value": value, "fixed_value": fixed,
            "variant": {"passed": repro.buggy.passed, "summary": repro.buggy.summary},
            "fixed": {"passed": repro.fixed.passed, "summary": repro.fixed.summary}}


def catalog_rows() -> list[dict[str, Any]]:
    from harness.variants.catalog import CATALOG

    keep = ("id", "component", "kind", "description", "symptom", "caught_by", "upstream", "default_layout",
            "model")
    return [{**{k: v for k, v in dataclasses.asdict(entry).items() if k in keep}, "versions": entry.versions()}
            for entry in CATALOG.values()]
