"""Resume invariance: what a resumed policy does next is what the uninterrupted run did.

The check the checkpoint suite makes for layout pairs, and the one suites/sensitivity and
`mrh repro` run on the checkpoint variants of the catalog. A source policy trains K_STEPS steps,
saves, and takes one more step without stopping; a policy resumed from the save (at the same or
another layout) takes the same step. Compared, with `harness.checkpoint.tolerances`:

- at the same layout, bit for bit (loss, grad norm, every weight): the same arithmetic on the same
  state, with deterministic kernels, and with dropout on only if the RNG streams were restored;
- at another layout, within the training tolerance table (the same math in another order);
- a load that cannot restore the checkpoint must change nothing: the harness refuses it before
  any rank touches its state (a load that fails inside Megatron is not undone);
- a load that fails for any other reason fails the check (`load_failed`): nothing resumed, so
  nothing can pass (found on the TE spec, where every same-layout resume raised KeyError: 'step'
  from the harness's own torch-Adam workaround, and the check said "resumed exactly").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from harness.checkpoint.tolerances import resume_tolerance
from harness.report import Row
from harness.tolerance import CheckResult, Judged

MODEL = "tiny-qwen3-kv4"  # 4 KV heads: every layout of 4 GPUs (TP4 included) is valid
CONFIG = dict(lr=1e-3, weight_decay=0.01, clip_grad=1.0, eps=1e-6, micro_batches=2,
              loss_kwargs=dict(kl_coef=0.05, clip_eps_high=0.28))
K_STEPS = 2


def train_batch(step: int):
    """The global batch of a step: the same whatever the layout (8 rows: 2 micro-batches at dp4)."""
    from harness.models import TINY_VOCAB_SIZE
    from harness.training import make_rl_train_batch

    return make_rl_train_batch(TINY_VOCAB_SIZE, batch_size=8, seed=100 + step,
                               prompt_lengths=[5, 3, 7, 1, 10, 2, 12, 4],
                               response_lengths=[19, 9, 10, 23, 4, 13, 1, 16])


@dataclass
class Uninterrupted:
    """A saved source and what it did next without stopping: the step and the weights after it."""

    layout: str
    config: dict[str, Any]
    directory: Path
    next_step: dict[str, Any]
    next_state: dict[str, torch.Tensor]
    manifest: Any
    model: str = MODEL


def train_and_save(make_policy: Callable, layout: str, directory: str | Path, *,
                   optimizer_format: str = "fully_reshardable", model: str = MODEL,
                   **config: Any) -> Uninterrupted:
    """K_STEPS steps of `model` at `layout`, saved to `directory`, then the next step without
    stopping. `make_policy(layout, model, **config)` builds a PolicyHandle (the `policy` fixture does)."""
    config = {**CONFIG, **config}
    source = make_policy(layout, model, **config)
    source.steps([train_batch(i) for i in range(K_STEPS)])
    manifest = source.save(directory, optimizer_format=optimizer_format)
    next_step = source.step(train_batch(K_STEPS))
    uninterrupted = Uninterrupted(layout, config, Path(directory), next_step, source.hf_state_dict(), manifest,
                                model)
    source.close()
    return uninterrupted


@dataclass
class ResumeResult(Judged):
    pair: str
    dtype: str
    device: str
    variant: str | None
    same_layout: bool
    checks: list[CheckResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    load_error: str | None = None  # what the load raised, if it did
    load: dict[str, Any] = field(default_factory=dict)  # load_checkpoint's info when it loaded
    model: str = MODEL

    def rows(self, **fields: Any) -> list[Row]:
        regime = "same-layout" if self.same_layout else "other-layout"
        return self.check_rows(self.pair, self.model, **fields, variant=self.variant, regime=regime)

    def summary(self) -> str:
        what = f"{self.pair} {self.dtype}" + (f" variant={self.variant}" if self.variant else "")
        status = "; ".join(self.failures) if self.failures else "resumed exactly as uninterrupted"
        if self.load_error:
            status += f" (load raised {self.load_error})"
        return f"{what}: {status}"


def _check(result: ResumeResult, metric: str, value: float, what: str) -> None:
    bound = resume_tolerance(metric, result.dtype, same_layout=result.same_layout)
    result.judge(metric, value, bound, f"{what}: {value:.3g} (bound {bound.kind} {bound.limit:g})")


def resume_and_compare(make_policy: Callable, source: Uninterrupted, target_layout: str, *,
                       variant: str | None = None, load_rng: bool | None = None,
                       after_load: Callable[[Any], None] | None = None) -> ResumeResult:
    """Resume `source` at `target_layout` (loading with `variant`, if any) and compare its next step
    with the uninterrupted one's. `after_load(handle)` runs between the load and the step (e.g. to
    re-save the loaded state, or to disturb the process's RNG)."""
    target = make_policy(target_layout, source.model, **source.config)
    result = ResumeResult(f"{source.layout}->{target_layout}", source.config.get("dtype", "fp32"),
                          target.world.device, variant, same_layout=str(target.layout) == source.layout,
                          model=source.model)
    before = state_digests(target.hf_state_dict())  # digests, not a copy: the load's own host need is large
    try:
        result.load = target.load(source.directory, variant=variant, load_rng=load_rng)
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        from harness.checkpoint.errors import CheckpointError

        result.load_error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        try:
            after = target.hf_state_dict()
        except Exception as unreadable:  # the load took the world down (a rank died or hung): its error is the story
            exc.add_note(f"after the failed load the policy could not be read: {type(unreadable).__name__}: "
                         f"{' '.join(str(unreadable).split())[:300]}")
            raise exc
        after = state_digests(after)
        changed = [n for n in before if before[n] != after.get(n)]
        _check(result, "tensors_changed_by_failed_load", len(changed), f"a failed load changed {changed}")
        refused = isinstance(exc, CheckpointError)  # the harness's own refusal, before any rank worked
        _check(result, "load_failed", 0 if refused else 1,
               f"the load failed: {result.load_error}" + ("" if refused else "\n" + _remote_traceback(exc)))
        return result
    if after_load is not None:
        after_load(target)
    got = target.step(train_batch(K_STEPS))
    want = source.next_step
    for metric, (value, what) in next_step_diffs(got, want, target.hf_state_dict(), source.next_state).items():
        _check(result, metric, value, what)
    if abs(got["lr"] - want["lr"]) > 1e-12 * abs(want["lr"]):
        result.failures.append(f"next lr: resumed {got['lr']} vs uninterrupted {want['lr']}")
    return result


def state_digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's bytes (with its dtype and shape), by name: what a failed load must leave
    unchanged, bit for bit, held in a few bytes a tensor. A copy of the state would stay in the driver's
    host memory through the load, whose own host need is several times the state's at real shapes
    (a fully_reshardable load adds ~23-25 bytes a parameter in the rank on the CPU tier:
    reports/cpu/2026-12-08-resume-memory)."""
    import hashlib

    def digest(tensor: torch.Tensor, chunk: int = 2**26) -> str:
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        sha = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        for start in range(0, flat.numel(), chunk):  # 64 MiB at a time: no second copy of a large tensor
            sha.update(flat[start:start + chunk].numpy())
        return sha.hexdigest()

    return {name: digest(tensor) for name, tensor in state.items()}


def assert_dp_reshardable_refused(make_policy: Callable, source_layout: str, target_layout: str,
                                  directory: str | Path, model: str = MODEL) -> None:
    """A dp_reshardable optimizer (flat buffers of one layout) saved at `source_layout` and loaded at
    `target_layout`: refused with one clear error, the target's weights and position untouched."""
    from harness.checkpoint import CheckpointError

    if not Path(directory).exists():
        source = make_policy(source_layout, model, **CONFIG)
        source.step(train_batch(0))
        source.save(directory, optimizer_format="dp_reshardable")
    target = make_policy(target_layout, model, **CONFIG)
    before = target.hf_state_dict()
    try:
        target.load(directory)
    except CheckpointError as exc:
        assert "dp_reshardable" in str(exc), exc
    else:
        raise AssertionError(f"a dp_reshardable checkpoint of {source_layout} loaded at {target_layout}")
    after = target.hf_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert target.position()["steps_done"] == 0


def _remote_traceback(exc: BaseException) -> str:
    """The rank's traceback of an exception a world call re-raised (its tail)."""
    cause = exc.__cause__
    return str(cause)[-2500:] if cause is not None else ""


def next_step_diffs(got: dict[str, Any], want: dict[str, Any], state: dict[str, torch.Tensor],
                    want_state: dict[str, torch.Tensor]) -> dict[str, tuple[float, str]]:
    """A resumed step against the uninterrupted one: metric -> (value, what it is), for
    loss_rel_diff, grad_norm_rel_diff and param_max_abs_diff (the weights after the step)."""
    diffs = {}
    for key in ("loss", "grad_norm"):
        rel = abs(got[key] - want[key]) / max(abs(want[key]), 1.0)
        diffs[f"{key}_rel_diff"] = (rel, f"next {key}: resumed {got[key]!r} vs uninterrupted {want[key]!r}")
    worst = max((state[n].float() - t.float()).abs().max().item() for n, t in want_state.items())
    diffs["param_max_abs_diff"] = (worst, f"weights after the next step: max |diff| {worst:g}")
    return diffs
