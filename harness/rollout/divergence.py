"""The exact tier's first-divergence report (issue 35, item 4): where, layer by layer, vLLM's forward
first stops agreeing with Megatron's on the same weights and the same tokens, named as an op.

    report = divergence_report(policy, engine, tokens)          # syncs the policy's weights first
    report.first          # "layers.1.down", or None when every point agrees
    report.first_op       # "layer 1: down projection GEMM (down_proj / linear_fc2)"
    print(report.table()) # max |d| per point, in forward order
    report.rows(...)      # the same as report rows

Both sides run one prefill of one token sequence: Megatron at tp1 in its rank process (forward hooks
on the policy's own model, through the policy's logprob path), vLLM in its engine's process (hooks
registered there, through `generate` with prompt logprobs). The canonical points, and how each
side's tensors are brought to one layout (Megatron's per-GQA-group QKV reordered to [q | k | v], its
batch dimension dropped), are harness.rollout.capture. Points are compared in forward order:

- `mode="exact"`: a point diverges when its tensors are not equal element for element (the exact
  tier's claim: bit-identical logprobs, vLLM's batch-invariant mode against Megatron's kernels);
- `mode="bounded"`: a point diverges when max |d| exceeds `bound` (a harness.tolerance.Tolerance;
  the CPU tier's fp32 bound: harness.rollout.tolerances.EXACT_TIER).

The first diverging point is the report's answer: the op whose output it is (`capture.op_of`). A
point the comparison expects that one side did not capture is an error naming the point and the
side (DivergenceError), never a skipped row. The expected points are Megatron's (its layer spec
decides them: TE fuses two RMSNorms into the next linear layer, capture.FUSED_NORM_KINDS); points
only vLLM has are listed in `unmatched`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from harness.rollout.capture import CaptureError, op_of
from harness.tolerance import Tolerance

MODES = ("exact", "bounded")
METRIC = "divergence_max_abs"
EXACT = {dtype: Tolerance(METRIC, dtype, 0.0, rationale="the exact tier: every point bit for bit")
         for dtype in ("fp32", "bf16")}


class DivergenceError(ValueError):
    """The two captures cannot be compared: a point missing on one side, or shapes that differ."""


@dataclass
class PointDiff:
    point: str
    max_abs: float
    equal: bool  # element for element, after casting both to float64 (dtypes recorded apart)
    scale: float  # max |reference| at the point: what max_abs is relative to
    dtypes: tuple[str, str]
    shape: tuple[int, ...]
    passed: bool

    @property
    def op(self) -> str:
        return op_of(self.point)


@dataclass
class DivergenceReport:
    mode: str
    bound: Tolerance
    sides: tuple[str, str]
    diffs: list[PointDiff]
    unmatched: list[str] = field(default_factory=list)  # points only the second side captured
    captured: tuple[dict, dict] = field(default_factory=lambda: ({}, {}), repr=False)  # what was compared

    @property
    def first(self) -> str | None:
        """The first point (forward order) whose tensors diverge; None when all agree."""
        return next((d.point for d in self.diffs if not d.passed), None)

    @property
    def first_op(self) -> str | None:
        return op_of(self.first) if self.first else None

    @property
    def first_index(self) -> int:
        return next((i for i, d in enumerate(self.diffs) if not d.passed), -1)

    @property
    def identical(self) -> bool:
        """Every point bit for bit, whatever the mode."""
        return all(d.equal for d in self.diffs)

    def diff(self, point: str) -> PointDiff:
        return next(d for d in self.diffs if d.point == point)

    def table(self) -> str:
        """Markdown: every point's max |d| (and the reference's scale), the first divergence marked."""
        first = self.first
        limit = "equal" if self.mode == "exact" else f"<= {self.bound.limit:g}"
        lines = [f"{self.sides[0]} vs {self.sides[1]}, {self.mode} ({limit}): first divergence "
                 f"{first or 'none'}" + (f" ({self.first_op})" if first else ""), "",
                 "| point | max abs diff | max abs ref | equal | pass |", "|---|---|---|---|---|"]
        for d in self.diffs:
            mark = " **first**" if d.point == first else ""
            lines.append(f"| {d.point}{mark} | {d.max_abs:.3g} | {d.scale:.3g} | {d.equal} | {d.passed} |")
        if self.unmatched:
            lines.append(f"\nonly {self.sides[1]}: {', '.join(self.unmatched)}")
        return "\n".join(lines)

    def rows(self, layout: str, model: str, *, dtype: str, device: str = "", claim: str | None = None,
             **extra: Any) -> list:
        """One report row per point (metric divergence_max_abs, the point and its op in `extra`), then
        one for the first divergence (metric first_divergence_index: its place in forward order, -1
        when none; observed). `claim`: the points' claim (default: the bound's; the exact tier's GPU
        rows, not yet measured, pass "observed")."""
        from harness.report.rows import Row

        claim = claim or self.bound.claim
        rows = [Row(suite="", test="", layout=layout, metric=METRIC, value=d.max_abs, tolerance=self.bound.limit,
                    passed=d.passed, claim=claim, model=model, dtype=dtype, device=device,
                    extra=dict(extra, point=d.point, op=d.op, mode=self.mode, equal=d.equal,
                               tolerance_kind=self.bound.kind))
                for d in self.diffs]
        rows.append(Row(suite="", test="", layout=layout, metric="first_divergence_index", value=float(self.first_index),
                        tolerance=None, passed=True, claim="observed", model=model, dtype=dtype, device=device,
                        extra=dict(extra, point=self.first, op=self.first_op, mode=self.mode, points=len(self.diffs))))
        return rows


def compare(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor], expected: Sequence[str], *,
            mode: str = "bounded", bound: Tolerance | None = None,
            sides: tuple[str, str] = ("megatron", "vllm")) -> DivergenceReport:
    """Every point of `expected`, in order, `reference` against `other` (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for side, captured in zip(sides, (reference, other)):
        missing = [p for p in expected if p not in captured]
        if missing:
            raise DivergenceError(f"point {missing[0]} ({op_of(missing[0])}) was not captured on the {side} side"
                                  + (f" (nor {len(missing) - 1} more: {', '.join(missing[1:4])}...)"
                                     if len(missing) > 1 else ""))
    unknown = [p for p in reference if p not in expected]
    if unknown:
        raise DivergenceError(f"the {sides[0]} side captured points the comparison does not expect: {unknown[:4]}")
    if mode == "bounded" and bound is None:
        raise ValueError("mode 'bounded' needs a bound (harness.rollout.tolerances.EXACT_TIER)")
    if bound is None:
        bound = EXACT["fp32"]
    diffs = []
    for point in expected:
        a, b = reference[point], other[point]
        if a.shape != b.shape:
            raise DivergenceError(f"point {point} ({op_of(point)}): {sides[0]} {tuple(a.shape)}, "
                                  f"{sides[1]} {tuple(b.shape)}")
        a64, b64 = a.double(), b.double()
        delta = (a64 - b64).abs()
        max_abs = float(delta.max()) if delta.numel() else 0.0
        if bool(torch.isnan(delta).any()):
            max_abs = math.nan
        equal = bool(torch.equal(a64, b64))
        passed = equal if mode == "exact" else bound.passes(max_abs)
        diffs.append(PointDiff(point, max_abs, equal, float(a64.abs().max()) if a64.numel() else 0.0,
                               (_dtype(a), _dtype(b)), tuple(a.shape), passed))
    return DivergenceReport(mode, bound, sides, diffs, unmatched=[p for p in other if p not in expected],
                            captured=(reference, other))


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------ orchestration
def divergence_report(policy, engine, tokens: Sequence[int], *, mode: str = "bounded",
                      bound: Tolerance | None = None, sync: bool = True, check_weights: bool = True
                      ) -> DivergenceReport:
    """Sync the policy's weights into `engine` (`sync`), check every engine tensor equals the policy's
    export (`check_weights`: the report is about the arithmetic, not the weights), capture one
    prefill of `tokens` on both sides and compare them. The policy runs at tp1 on one rank."""
    from harness.rollout.sync import engine_weight_diffs, sync_weights

    if sync:
        sync_weights(policy, engine)
    if check_weights:
        diffs = engine_weight_diffs(engine.weights(), policy.hf_state_dict())
        bad = diffs["missing"] + diffs["extra"] + diffs["unequal"]
        if bad:
            raise DivergenceError(f"the engine's weights are not the policy's ({len(bad)} tensors: {bad[:3]}): "
                                  "sync first")
    megatron = capture_policy(policy, tokens)
    vllm = engine.capture(list(map(int, tokens)))
    return compare(megatron["points"], vllm, megatron["expected"], mode=mode, bound=bound)


def capture_policy(policy, tokens: Sequence[int]) -> dict[str, Any]:
    """One prefill of `tokens` through the policy's model with hooks at every canonical point:
    {"points": {point: tensor}, "expected": [points in forward order], "spec": ...}."""
    layout = policy.layout
    if policy.world.size != 1 or layout.tp != 1 or layout.pp != 1:
        raise ValueError(f"the divergence report captures a tp1 policy on a one-rank world, got {layout} on "
                         f"{policy.world.size} ranks (one rank must hold every layer and the whole vocabulary)")
    return policy.apply(_capture_rank, list(map(int, tokens)))[0]


def _capture_rank(worker, tokens: list[int]) -> dict[str, Any]:
    from harness.bridge import bridge_info, unwrap_model
    from harness.data.rl_batch import RLBatch
    from harness.rollout import capture

    model = unwrap_model(list(worker.models))[0]
    if getattr(model.config, "num_moe_experts", None):
        raise ValueError("the divergence report covers dense models (a MoE layer has no single MLP to hook)")
    info = bridge_info(worker.models)
    if len(tokens) < 3 or min(tokens) < 0 or max(tokens) >= info.vocab_size:
        raise ValueError(f"capture at least 3 token ids in [0, {info.vocab_size}), got {tokens}")
    ids = torch.tensor([tokens], dtype=torch.long)
    mask = torch.ones_like(ids, dtype=torch.bool)
    response = mask.clone()
    response[:, 0] = False
    recorder, layers, qk_norm, fused_norms = capture.megatron_recorder(model)
    try:
        result = worker.logprobs(RLBatch(ids, mask, response))
    finally:
        recorder.close()
    try:
        points = capture.megatron_points(recorder, len(tokens), layers, model.config, qk_norm, fused_norms,
                                         info.vocab_size, result.logprobs[0])
    except CaptureError as error:
        raise DivergenceError(f"the megatron side: {error}") from None
    return {"points": points, "expected": capture.points(layers, qk_norm=qk_norm, fused_norms=fused_norms),
            "spec": info.spec}
