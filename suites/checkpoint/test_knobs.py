"""The checkpoint knobs are data, and the save knobs change how a checkpoint is written, never what
it holds: every combination of `async_save` x `fully_parallel_save` writes the same tensors
(plain-tensor diff of the checkpoints) and resumes to the same next step, bit for bit, whichever
way it is loaded (`fully_parallel_load`). The async saves let training go on while they write: the
last one is finalized only after the next step ran, and still holds the state before that step.
"""
from __future__ import annotations

import pytest

from harness.checkpoint import CheckpointError
from harness.checkpoint.checkpointer import Checkpointer
from harness.checkpoint.diff import diff_checkpoints
from harness.checkpoint.knobs import CheckpointKnobs
from harness.checkpoint.resume_check import CONFIG, MODEL, train_batch
from suites.checkpoint.conftest import layout_for

K = 2
POLICY = {**CONFIG, "deterministic": True}  # bit-exact next steps on CUDA too


def test_every_save_combination_writes_the_same_checkpoint_and_resumes_the_same(policy, device, tmp_path, report):
    layout = layout_for(device)
    source = policy(layout, MODEL, **POLICY)
    source.steps([train_batch(i) for i in range(K)])
    combos = CheckpointKnobs.save_combinations()
    assert len(combos) == 4 and len(set(combos)) == 4
    combos.sort(key=lambda k: k.async_save)  # the sync ones first; the last async one overlaps a step
    roots = []
    for index, knobs in enumerate(combos):
        ckpt = Checkpointer(source, tmp_path / f"knobs{index}", knobs)
        ckpt.save()
        if index == len(combos) - 1:
            assert ckpt.pending  # still writing while the next step runs
            next_step = source.step(train_batch(K))
            next_state = source.hf_state_dict()
        ckpt.close()
        roots.append((knobs, ckpt.root.directory(K)))
    reference = roots[0][1]
    for index, (knobs, directory) in enumerate(roots):
        diff = diff_checkpoints(reference, directory)
        report.add("tensors_differing", len(diff.mismatched) + len(diff.missing) + len(diff.extra), tolerance=0,
                   passed=diff.ok, claim="exact", layout=layout, knobs=knobs.describe())
        assert diff.ok and diff.equal > 0, f"{knobs.describe()}: {diff.summary()}"
        target = policy(layout, MODEL, **POLICY)
        load_knobs = knobs.replace(fully_parallel_load=bool(index % 2))
        info = Checkpointer(target, directory.parent, load_knobs, sweep=False).resume()
        assert info["iteration"] == K and info["rng_restored"]
        got = target.step(train_batch(K))
        worst = max((t.float() - next_state[n].float()).abs().max().item() for n, t in target.hf_state_dict().items())
        for key in ("loss", "grad_norm"):
            assert got[key] == next_step[key], f"{load_knobs.describe()}: next {key} {got[key]!r} vs {next_step[key]!r}"
        report.add("param_max_abs_diff", worst, tolerance=0.0, passed=worst == 0.0, claim="exact", layout=layout,
                   knobs=load_knobs.describe())
        assert worst == 0.0, load_knobs.describe()
        target.close()


@pytest.mark.parametrize("bad, match", [
    (dict(keep=0), "keep must be an integer >= 1"), (dict(keep=True), "keep must be an integer"),
    (dict(async_save="yes"), "async_save must be True or False"),
    (dict(load_rng="auto"), "load_rng must be True, False or None"),
    (dict(optimizer_format="flat"), "unknown optimizer format"),
])
def test_bad_knobs_are_refused_before_any_work(bad, match):
    with pytest.raises(CheckpointError, match=match):
        CheckpointKnobs(**bad)
