"""Training invariance: a Megatron policy's steps equal the single-process ground truth's.

The check the training suite makes under every layout and the one `mrh repro` runs for the training
variants of the catalog: `STEPS` steps of tiny-qwen3 on the same global batches (on-policy old
logprobs, perturbed so both clipping branches occur), then per step the loss and pre-clip grad norm
(relative to max(|truth|, 1)) and, after the steps, every weight (max |diff|), each against the
training tolerance table. Catches unscaled or double-averaged gradients (micro-batch count, DP
averaging), a missing finalize_model_grads (DP all-reduce, TP-partial norm grads, tied embeddings
under PP), and a wrong optimizer or parameter grouping.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.report import Row
from harness.tolerance import CheckResult, separation
from harness.training.tolerances import training_tolerance

MODEL = "tiny-qwen3"
PROMPTS = [5, 3, 7, 1, 10, 2, 12, 4]
RESPONSES = [19, 9, 10, 23, 4, 13, 1, 16]
STEPS = 2
# Adam eps 1e-6, not 1e-8: Adam's update lr * m / (sqrt(v) + eps) is ill-conditioned for the few
# elements whose gradient is ~eps (1e4x below the median): there, fp32 reduction-order noise from
# TP-split matmuls (relative ~1e-3 on a cancelling 1e-8 gradient) moves the update by up to ~2e-5
# at eps 1e-8 (measured at TP2: 2.3e-5 on 1 element of 8192, loss and grad norm within 1.3e-6).
# eps 1e-6 bounds that sensitivity (d update / d g <= lr / eps) without changing anything else.
OPTIM = dict(lr=1e-3, weight_decay=0.01, clip_grad=1.0, eps=1e-6)
LOSS = dict(kl_coef=0.05, clip_eps_high=0.28, aggregation="token-mean")
# The same loss with the ratio clip out of reach. Step 2 of the ground truth clips 71 of tiny-qwen3-moe's 95
# loss tokens, so in bf16 a ratio rounded across the clip boundary moves the grad norm by that token's whole
# share (CPU, bf16: one token, 3-5%); without the clip a step's bf16 error is rounding alone.
UNCLIPPED = dict(LOSS, clip_eps=1e9, clip_eps_high=1e9)


def policy_config(*, micro_batches: int = 2, dtype: str = "fp32", variant: str | None = None,
                  loss: dict[str, Any] = LOSS, layout=None, lr: float = OPTIM["lr"]) -> dict[str, Any]:
    """The PolicyConfig fields the ground truth trains with (`loss`: LOSS, or UNCLIPPED). With a `layout`,
    the least multiple of `micro_batches` its schedule takes (Layout.fitted_micro_batches: pp4vpp2 refused
    2, 2026-11-27); the comparison holds at any count, the loss being normalised by the global batch's
    tokens (suites/training/test_policy.py: 1 and 4 against the ground truth's 2)."""
    if layout is not None:
        from harness.parallel.state import as_layout

        micro_batches = as_layout(layout).fitted_micro_batches(micro_batches)
    return dict(OPTIM, lr=lr, micro_batches=micro_batches, loss_kwargs=dict(loss), variant=variant, dtype=dtype)


def ground_truth(model: str = MODEL, loss: dict[str, Any] | None = None, lr: float = OPTIM["lr"],
                 weights: str = "fp32"):
    """(batches, ground-truth step results, HF state dict after the steps) with the loss `loss`
    (LOSS by default), learning rate `lr` and forward weights `weights` (fp32, or bf16 as a bf16
    policy's: harness.training.ground_truth, "Weights"): once per process and arguments."""
    return _ground_truth(model, _loss_key(loss), lr, weights)[:3]


def ground_truth_moved(model: str = MODEL, loss: dict[str, Any] | None = None, lr: float = OPTIM["lr"],
                       weights: str = "fp32") -> float:
    """The largest |change| of any ground-truth weight over its steps (from its start: rounded to bf16 for
    weights="bf16"): a comparison within a bound far below it shows that the policy's steps moved its
    weights too (else equality proves nothing)."""
    return _ground_truth(model, _loss_key(loss), lr, weights)[3]


def _loss_key(loss: dict[str, Any] | None) -> tuple:
    return tuple(sorted((LOSS if loss is None else loss).items()))


def train_batch(model: str = MODEL):
    """The ground truth's global batch (a row per PROMPTS entry) before its on-policy old logprobs."""
    from harness.models import load_hf_config
    from harness.training.rl_data import make_rl_train_batch

    # the config alone: resolving a zoo name would write its checkpoint (17.8 GB for gpt-oss-shape) for a number
    vocab = load_hf_config(model).vocab_size
    return make_rl_train_batch(vocab, batch_size=len(PROMPTS), seed=0, prompt_lengths=PROMPTS,
                               response_lengths=RESPONSES)


@functools.lru_cache(maxsize=4)
def _ground_truth(model: str, loss: tuple, lr: float, weights: str = "fp32"):
    from harness.logprobs import hf_logprobs
    from harness.models import build_hf_model
    from harness.models.zoo import checkpoint_state_dict
    from harness.training.ground_truth import WEIGHTS, GroundTruthTrainer, round_weights

    hf = build_hf_model(model, dtype=torch.float32, seed=0)
    tb = train_batch(model)
    # On-policy old logprobs, perturbed so that both clipping branches occur in step 2.
    with torch.no_grad():
        tb = tb.with_old_logprobs(hf_logprobs(hf, tb.batch) + 0.02 * tb.advantages.sign())
    # bf16 weights: each step also records HF's own bf16 loss of its state (ground_truth, "HF's own bf16")
    trainer = GroundTruthTrainer(hf, **dict(OPTIM, lr=lr), weights=weights, bf16_yardstick=weights == "bf16",
                                 **dict(loss))
    results = [trainer.step(tb, micro_batches=2) for _ in range(STEPS)]
    # The host holds the model, its gradients and Adam's state (16 bytes a parameter: 50 GB for the
    # 3.1 B-parameter qwen3-30b-a3b-shape); free the last two before the copies below.
    del trainer
    hf.zero_grad(set_to_none=True)
    state = checkpoint_state_dict(hf)  # the names the policy exports
    start = build_hf_model(model, dtype=torch.float32, seed=0)  # drawn again rather than held during the steps
    if WEIGHTS[weights] is not None:
        round_weights(start.parameters(), WEIGHTS[weights])  # where the trainer started
    moved = max((param.detach() - start.get_parameter(name)).abs().max().item() for name, param in hf.named_parameters())
    return [tb] * STEPS, results, state, moved


@functools.lru_cache(maxsize=4)
def ground_truth_routes(model: str, step: int) -> torch.Tensor:
    """[B, S, L, K]: the experts the ground truth's routers pick for the batch of step `step` (0-based)
    at the weights the steps before it left (PAD at pads), e.g. the routes of its second step's forward."""
    from harness.logprobs import hf_logprobs
    from harness.models import build_hf_model
    from harness.rollout.routing import RoutingRecorder
    from harness.training.ground_truth import GroundTruthTrainer

    batches, _, _ = ground_truth(model)
    hf = build_hf_model(model, dtype=torch.float32, seed=0)
    trainer = GroundTruthTrainer(hf, **OPTIM, **LOSS)
    for tb in batches[:step]:
        trainer.step(tb, micro_batches=2)
    batch = batches[step].batch
    with torch.no_grad(), RoutingRecorder(hf) as recorder:
        hf_logprobs(hf, batch)
    return recorder.routes(batch.batch_size, batch.attention_mask.bool())


@dataclass
class InvarianceResult:
    layout: str
    dtype: str
    device: str
    variant: str | None
    checks: list[tuple[int | None, CheckResult]] = field(default_factory=list)  # (step, check)
    observed: list[tuple[int, str, float]] = field(default_factory=list)  # (step, metric, value): no bound
    failures: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    worst_tensor: str = ""

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def separation(self) -> float:
        return separation(c for _, c in self.checks)

    def rows(self, model: str, **fields: Any) -> list[Row]:
        rows = []
        for step, check in self.checks:
            extra = dict(fields, variant=self.variant, tolerance_kind=check.tolerance.kind)
            if step is not None:
                extra["step"] = step
            else:
                extra["tensor"] = self.worst_tensor
            if check.tolerance.rationale.startswith(HF_BF16_BOUND):
                extra["bound_from"] = "hf-bf16"
            rows.append(Row(suite="", test="", layout=self.layout, metric=check.metric, value=check.value,
                            tolerance=check.tolerance.limit, passed=check.passed, claim=check.claim, model=model,
                            dtype=self.dtype, device=self.device, extra=extra))
        for step, metric, value in self.observed:
            rows.append(Row(suite="", test="", layout=self.layout, metric=metric, value=value, tolerance=None,
                            passed=True, claim="observed", model=model, dtype=self.dtype, device=self.device,
                            extra=dict(fields, variant=self.variant, step=step)))
        return rows

    def summary(self) -> str:
        worst = max((c for _, c in self.checks), key=lambda c: c.margin, default=None)
        what = f"{self.layout} {self.dtype}" + (f" variant={self.variant}" if self.variant else "")
        status = "; ".join(self.failures) if self.failures else "matches the ground truth"
        tail = f" (worst: {worst.metric}={worst.value:.3g} vs {worst.tolerance.limit:g})" if worst else ""
        return f"{what}: {status}{tail}"


def _check(metric: str, value: float, dtype: str) -> CheckResult:
    bound = training_tolerance(metric, dtype)
    return CheckResult.judge(metric, value, bound)


# The rationale of a loss bound widened to HF's own bf16 gap (compare_to_ground_truth, loss_within_hf_bf16).
HF_BF16_BOUND = "HF's own bf16 on this state"


def _loss_bound(dtype: str, want: dict[str, Any], within_hf_bf16: bool):
    """The loss bound of a step: the table's, or (within_hf_bf16) the larger of it and how far HF's own bf16
    forward of the step's state is from the ground truth's loss (its `hf_bf16_loss`)."""
    import dataclasses

    bound = training_tolerance("loss_rel_diff", dtype)
    if not within_hf_bf16:
        return bound
    gap = abs(want["hf_bf16_loss"] - want["loss"]) / max(abs(want["loss"]), 1.0)
    if gap <= bound.limit:
        return bound
    return dataclasses.replace(bound, limit=gap, evidence=(), rationale=(
        f"{HF_BF16_BOUND} (hf_bf16_loss_rel_diff {gap:.3g}), past the table's {bound.limit:g}: Megatron's bf16 no "
        "farther from the ground truth than the reference implementation's own bf16"))


def compare_to_ground_truth(policy, *, model: str = MODEL, truth_weights: str = "fp32",
                            loss_within_hf_bf16: bool = False) -> InvarianceResult:
    """Train `policy` (a PolicyHandle made with `policy_config(...)`) for STEPS steps on the
    ground truth's batches and compare; the handle's config says dtype, micro-batches, variant.
    `truth_weights`: the ground truth's forward weights (ground_truth's `weights`); with "bf16" each step's
    `hf_bf16_loss_rel_diff` (HF's own bf16 forward of the step's state against the ground truth's loss) is
    recorded, and `loss_within_hf_bf16` holds the loss to the larger of the table's bound and that gap (where
    HF's bf16 is the noisy side: suites/models/test_shapes.py, NOISY_HF_BF16). The grad norm and the weights
    keep the table's bounds."""
    if loss_within_hf_bf16 and truth_weights != "bf16":
        raise ValueError("loss_within_hf_bf16 needs truth_weights='bf16' (HF's bf16 runs on the rounded weights)")
    batches, expected, ref_state = ground_truth(model, policy.config.get("loss_kwargs"),
                                             policy.config.get("lr", OPTIM["lr"]), truth_weights)
    dtype = policy.config.get("dtype", "fp32")
    result = InvarianceResult(str(policy.layout), dtype, policy.world.device, policy.config.get("variant"))
    result.steps = policy.steps(batches)
    state = policy.hf_state_dict()
    micro_batches = policy.config.get("micro_batches", 1)
    for i, (got, want) in enumerate(zip(result.steps, expected)):
        # The per-micro-batch losses are the pieces of the global loss, one per (dp rank, index).
        if len(got["micro_batches"]) != micro_batches * policy.layout.dp:
            result.failures.append(f"step {i}: {len(got['micro_batches'])} micro-batch stats")
        if "hf_bf16_loss" in want:
            result.observed.append((i, "hf_bf16_loss_rel_diff",
                                    abs(want["hf_bf16_loss"] - want["loss"]) / max(abs(want["loss"]), 1.0)))
        for key in ("loss", "grad_norm"):
            # Relative to max(|value|, 1): the surrogate is a mean of +-ratio * A terms with
            # |A| ~ N(0, 1), which cancel to ~0.01, so a plain relative diff would amplify fp32
            # noise ~100x (TP2 step 2: |diff| 1.7e-7 on a loss of 0.0122).
            value = abs(got[key] - want[key]) / max(abs(want[key]), 1.0)
            check = CheckResult.judge(f"{key}_rel_diff", value, _loss_bound(dtype, want, loss_within_hf_bf16)) \
                if key == "loss" else _check(f"{key}_rel_diff", value, dtype)
            result.checks.append((i, check))
            if not check.passed:
                # A token whose ratio crossed the clip boundary (bf16 rounding) moves the grad norm by
                # its whole share: the clip fractions say whether that happened.
                result.failures.append(f"step {i} {key}: megatron {got[key]!r} vs ground truth {want[key]!r} "
                                       f"(clip fraction {got.get('clip_fraction', float('nan')):.4f} vs "
                                       f"{want['clip_fraction']:.4f})")
        if abs(got["lr"] - want["lr"]) > 1e-12 * abs(want["lr"]):
            result.failures.append(f"step {i} lr: {got['lr']} vs {want['lr']}")
    if "lm_head.weight" not in state and torch.equal(ref_state["lm_head.weight"], ref_state["model.embed_tokens.weight"]):
        # Tied: HF's state dict lists the shared tensor twice, the export (like the checkpoint) once.
        ref_state = {n: t for n, t in ref_state.items() if n != "lm_head.weight"}
    differing = sorted(set(ref_state) ^ set(state))
    if differing:
        raise AssertionError(f"state dict keys differ: {differing}")
    worst = 0.0
    for name, want in ref_state.items():
        diff = (state[name].float() - want.float()).abs().max().item()
        if diff > worst:
            result.worst_tensor, worst = name, diff
    check = _check("param_max_abs_diff", worst, dtype)
    result.checks.append((None, check))
    if not check.passed:
        result.failures.append(f"params: max |diff| {worst:.3g} at {result.worst_tensor}")
    check = _check("replica_max_abs_diff", policy.call("replica_divergence")[0], dtype)
    result.checks.append((None, check))
    if not check.passed:
        result.failures.append(f"replicated parameters drifted apart across ranks by {check.value:.3g}")
    return result
