"""Is each megatron-core workaround (harness.compat.megatron_core) still needed on the installed
megatron-core? Each test takes megatron-core's own path for one workaround (`compat.trial`: the
others applied, on a throwaway policy) and sees whether its bug shows:

- never-stepped-adam: a never-stepped policy loads a checkpoint;
- fully-reshardable-step-keyerror: a policy loads a fully_reshardable optimizer state;
- shared-adam-step: after a load, do parameters share one Adam `step` tensor?
- dp-reshardable-grad-copy: a policy loads a dp_reshardable optimizer state;
- dp-reshardable-step-reset: a never-stepped policy loads a dp_reshardable optimizer state saved
  after one step: is every parameter's Adam `step` 1 (the checkpoint's) or still 0 (its own)?
- experts-at-ep1-etp-ne-tp (a model-build workaround, nightly): a MoE policy built at tp2etp1-sp
  (every expert whole on both ranks) takes one step: do the two ranks' experts differ?

The bug must show on every version the workaround is verified (applied) on and must not on every
version it is marked not needed on; a version in neither list fails with what was seen, to be
recorded there (torch Adam only: with TE installed megatron-core uses TE's FusedAdam, which none of
these concern)."""
from __future__ import annotations

import pytest

from harness.checkpoint.resume_check import CONFIG, MODEL, train_batch
from harness.compat import megatron_core as compat

BY_NAME = {w.name: w for w in compat.WORKAROUNDS}
FORMAT = {"dp-reshardable-grad-copy": "dp_reshardable", "dp-reshardable-step-reset": "dp_reshardable"}
# The bugs seen on a never-stepped target: the others' targets take one step first (only the bug's
# path differs); dp-reshardable-step-reset's would then have the checkpoint's step already.
UNSTEPPED = ("never-stepped-adam", "dp-reshardable-step-reset")


def _save(worker, directory: str, optimizer_format: str) -> None:
    with compat.trial():  # every workaround applied, on any version: the source is not under test
        worker.save_checkpoint(directory, optimizer_format=optimizer_format)


def _bug_shows(worker, name: str, directory: str, optimizer_format: str) -> str | None:
    """Rank-side: what megatron-core's own path does here (None: nothing wrong)."""
    if not compat.uses_torch_adam(worker.optimizer):
        return "n/a: not torch Adam"
    with compat.trial(BY_NAME[name]):
        try:
            worker.load_checkpoint(directory, optimizer_format=optimizer_format)
        except Exception as exc:  # noqa: BLE001 - the bug, as megatron-core raises it
            return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    steps = [s["step"] for o in compat._torch_adams(worker.optimizer) for s in o.state.values() if "step" in s]
    if name == "shared-adam-step":
        if len({id(t) for t in steps}) < len(steps):
            return f"{len(steps)} parameters share {len({id(t) for t in steps})} step tensor(s)"
    if name == "dp-reshardable-step-reset":
        values = sorted({float(t) for t in steps})
        if values != [float(worker.steps_done)]:
            return f"Adam steps {values} after loading a checkpoint saved after {worker.steps_done} step(s)"
    return None


# The workarounds of model building, each with its own test (below; te-grouped-experts-unmarked: its bugs
# show with TE's grouped experts, reproduced on the local spec by suites/moe/test_te_experts.py, which
# shows megatron-core 0.16.1's own path dropping them and 0.19.2 not needing it); the others are
# checkpoint loads'.
BUILD = ("experts-at-ep1-etp-ne-tp", "te-grouped-experts-unmarked")


@pytest.mark.parametrize("name", sorted(set(BY_NAME) - set(BUILD)))
def test_a_workaround_is_applied_exactly_where_its_bug_shows(policy, device, tmp_path, report, name):
    fmt = FORMAT.get(name, "fully_reshardable")
    source = policy("dp2", MODEL, **CONFIG)
    source.step(train_batch(0))
    source.apply(_save, str(tmp_path), fmt)
    source.close()
    target = policy("dp2", MODEL, **CONFIG)
    if name not in UNSTEPPED:
        target.step(train_batch(0))  # a stepped optimizer: only this bug's path differs
    seen = target.apply(_bug_shows, name, str(tmp_path), fmt)
    if any(s and s.startswith("n/a") for s in seen):
        pytest.skip(f"{name}: {seen[0]}")
    version, workaround = compat.mcore_version(), BY_NAME[name]
    shows = all(seen)
    report.add("upstream_bug_shows", int(shows), tolerance=int(version in workaround.verified_on),
               passed=True, claim="exact", layout="dp2", workaround=name, megatron_core=version, seen=seen[0])
    _assert_measured(name, any(seen) if version in workaround.not_needed_on else shows, seen)


def _assert_measured(name: str, shows: bool, seen: str) -> None:
    version, workaround = compat.mcore_version(), BY_NAME[name]
    if version in workaround.verified_on:
        assert shows, f"{name}: applied on megatron-core {version}, but its bug does not show there: {seen}"
    elif version in workaround.not_needed_on:
        assert not shows, f"{name}: marked not needed on megatron-core {version}, but: {seen}"
    else:
        pytest.fail(f"{name} on megatron-core {version} is unmeasured: megatron-core's own path gives {seen}; "
                    "add the version to verified_on (bug shows) or not_needed_on (it does not)")


_stock: list = []  # rank-side: the open `compat.trial` of a policy being built on megatron-core's own path


def _begin_stock_path(name: str) -> None:
    _stock.append(compat.trial(BY_NAME[name]))
    _stock[-1].__enter__()


def _end_stock_path() -> None:
    while _stock:
        _stock.pop().__exit__(None, None, None)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp2etp1-sp"])
def test_experts_at_ep1_with_etp_below_tp_is_applied_exactly_where_its_bug_shows(world, policy, device, layout,
                                                                               report):
    """Megatron-LM #5916's uncommon case: built on megatron-core's own path, are the experts left dense
    parameters at ep 1 with etp != tp, so that their replicas on the two TP ranks diverge in a step?"""
    from harness.training.invariance import policy_config
    from suites.moe.test_training import MODEL as MOE_MODEL, replica_divergence

    name = "experts-at-ep1-etp-ne-tp"
    world.run(_begin_stock_path, name)
    try:
        worker = policy(layout, MOE_MODEL, **policy_config())
    finally:
        world.run(_end_stock_path)
    assert worker.world is world, "the policy was built on another world than the one on the stock path"
    diff, marked = replica_divergence(worker)
    shows = diff > 0
    seen = f"expert replicas differ by {diff:g} after one step; {sum(marked)} of {len(marked)} expert params marked"
    report.add("upstream_bug_shows", int(shows), tolerance=int(compat.mcore_version() in BY_NAME[name].verified_on),
               passed=True, claim="exact", layout=layout, workaround=name, megatron_core=compat.mcore_version(),
               seen=seen)
    report.add("expert_replica_max_abs_diff_stock", diff, tolerance=None, passed=True, claim="observed",
               layout=layout, workaround=name, megatron_core=compat.mcore_version())
    _assert_measured(name, shows, seen)
