"""Across the two stacks (megatron-core 0.16 + mbridge, megatron-core 0.19 + Megatron-Bridge): a
checkpoint written on 0.16 resumes on 0.19 exactly, even at another layout; one written on 0.19 is
refused on 0.16 with one clear error before any rank works; and the two bridges export one state as
the same HF tensors, bit for bit.

The stack pytest runs under does its part in this process, on the session's 2-rank CPU world; the
other (`--mrh-other-stack PYTHON`, skipped without it) runs harness.checkpoint.cross_stack in its
own process. The 0.16 stack writes (tp2: K steps, saved in both optimizer formats, then the
uninterrupted next step); the 0.19 stack resumes at dp2 and tp2. What was measured and why the way
back is refused: harness.checkpoint.cross_stack.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from harness.checkpoint import CheckpointError, cross_stack, manager
from harness.checkpoint.manifest import read_manifest, verify_files
from harness.checkpoint.resume_check import next_step_diffs
from harness.checkpoint.tolerances import resume_tolerance

WRITER, READER = "0.16", "0.19"  # megatron-core lines: 0.19 reads 0.16's format, not the reverse
LAYOUT = "tp2"  # where the writer trains and saves


@dataclass
class Stack:
    """One stack: this process's (`world` set: runs in process) or another's (through its Python)."""

    versions: dict[str, str]
    python: str
    world: Any = None

    @property
    def name(self) -> str:
        return f"megatron-core {self.versions['megatron_core']} + {self.versions['bridge']}"

    def save(self, out, layout: str) -> dict[str, Any]:
        if self.world is not None:
            return cross_stack.save(self.world, out, layout=layout)
        return cross_stack.run_on(self.python, "save", out, "--layout", layout).expect()

    def resume(self, out, **jobs: tuple[str, str]) -> dict[str, dict[str, Any]]:
        """NAME=(checkpoint, layout) -> each job's result (cross_stack.resume)."""
        if self.world is not None:
            return cross_stack.resume(self.world, out, jobs)["jobs"]
        specs = [f"{name}={checkpoint}@{layout}" for name, (checkpoint, layout) in jobs.items()]
        return cross_stack.run_on(self.python, "resume", out, *specs).expect()["jobs"]

    def cli(self, *args: str) -> cross_stack.Ran:
        """The cross_stack command line in a process of its own, whichever stack this is."""
        return cross_stack.run_on(self.python, *args)


@pytest.fixture(scope="module")
def stacks(other_stack_python, world_pool) -> dict[str, Stack]:
    """The two stacks by megatron-core line."""
    here = Stack(cross_stack.versions(), sys.executable, world_pool.get(cross_stack.WORLD_SIZE, "cpu"))
    other = Stack(cross_stack.run_on(other_stack_python, "versions").expect(), other_stack_python)
    by_line = {cross_stack.line(stack.versions["megatron_core"]): stack for stack in (here, other)}
    if set(by_line) != {WRITER, READER}:
        pytest.fail(f"the cross-stack checks need megatron-core {WRITER} and {READER}, one per stack; got "
                    f"{here.name} here and {other.name} at {other_stack_python}", pytrace=False)
    return by_line


@pytest.fixture(scope="module")
def written(stacks, tmp_path_factory) -> dict[str, Any]:
    """The writer's run: checkpoints per optimizer format, its HF exports at the save and one step later."""
    return stacks[WRITER].save(tmp_path_factory.mktemp("cross-stack") / "written", LAYOUT)


@pytest.fixture(scope="module")
def resumed(stacks, written, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The reader's resumes of the writer's checkpoints: at another layout, at the same one, and the
    dp_reshardable checkpoint (same TP/PP only)."""
    checkpoints = written["checkpoints"]
    return stacks[READER].resume(tmp_path_factory.mktemp("cross-stack") / "resumed",
                                 **{"fully_reshardable@dp2": (checkpoints["fully_reshardable"], "dp2"),
                                    "fully_reshardable@tp2": (checkpoints["fully_reshardable"], LAYOUT),
                                    "dp_reshardable@tp2": (checkpoints["dp_reshardable"], LAYOUT)})


def _direction(stacks) -> str:
    return f"{stacks[WRITER].versions['megatron_core']}->{stacks[READER].versions['megatron_core']}"


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not torch.equal, or that only one side has."""
    return sorted(set(a) ^ set(b)) + sorted(n for n in set(a) & set(b) if not torch.equal(a[n], b[n]))


def test_a_checkpoint_of_megatron_core_016_loaded_on_019_at_another_layout_resaves_as_the_same_checkpoint(
        stacks, written, resumed, report):
    """Every tensor (model and optimizer state) and the common state that 0.19 loaded at dp2,
    written out again without a step, equals the tp2 checkpoint of 0.16 (the `mrh ckpt diff`
    comparison, made on 0.19: it reads both formats). At tp2 the next step below is the
    uninterrupted one bit for bit."""
    layout = "dp2"
    job = resumed[f"fully_reshardable@{layout}"]
    assert job["position"] == written["position"]
    diff = job["resave_diff"]
    differing = len(diff["mismatched"]) + len(diff["missing"]) + len(diff["extra"]) + len(diff["common"])
    report.add("tensors_differing", differing, tolerance=0, passed=diff["ok"], claim="exact",
               layout=f"{LAYOUT}->{layout}", direction=_direction(stacks), optimizer_format="fully_reshardable",
               n_equal=diff["equal"])
    assert diff["ok"], {k: diff[k] for k in ("missing", "extra", "mismatched", "common")}
    assert diff["equal"] > 0


@pytest.mark.parametrize("layout", ["dp2", LAYOUT])
def test_training_resumed_on_019_continues_as_the_uninterrupted_016_run(stacks, written, resumed, layout, report):
    """The next step on 0.19 after the load is the step 0.16 took without stopping: bit for bit at
    the same layout (the two stacks' arithmetic is the same: measured, not assumed), within the
    training tolerance table at another."""
    job = resumed[f"fully_reshardable@{layout}"]
    same_layout = layout == LAYOUT
    assert job["rng_restored"] == same_layout  # per-rank RNG states cross the stacks at one layout
    diffs = next_step_diffs(job["next_step"], written["next_step"], cross_stack.read_hf(job["after"]),
                            cross_stack.read_hf(written["after"]))
    failures = []
    for metric, (value, what) in diffs.items():
        bound = resume_tolerance(metric, "fp32", same_layout=same_layout)
        report.add(metric, value, tolerance=bound.limit, passed=bound.passes(value), claim=bound.claim,
                   layout=f"{LAYOUT}->{layout}", direction=_direction(stacks), optimizer_format="fully_reshardable")
        if not bound.passes(value):
            failures.append(what)
    assert job["next_step"]["lr"] == written["next_step"]["lr"]
    assert not failures, failures


def test_a_dp_reshardable_checkpoint_of_016_resumes_on_019_as_the_uninterrupted_016_run(stacks, written, resumed,
                                                                                       report):
    """Its flat buffers carry uninitialized padding, so two saves of one state differ there: the
    loaded weights, the next step and the weights after it are compared instead, bit for bit with
    the 0.16 run that did not stop (the weights after the step catch a wrong torch-Adam step, which
    loss and grad norm do not: `dp-reshardable-step-reset`, harness.compat.megatron_core)."""
    on_reader = resumed["dp_reshardable@tp2"]
    assert on_reader["position"] == written["position"]
    loaded = _differing(cross_stack.read_hf(on_reader["loaded"]), cross_stack.read_hf(written["saved"]))
    after = _differing(cross_stack.read_hf(on_reader["after"]), cross_stack.read_hf(written["after"]))
    for metric, names in (("loaded_tensors_differing", loaded), ("tensors_differing_after_next_step", after)):
        report.add(metric, len(names), tolerance=0, passed=not names, claim="exact", layout=f"{LAYOUT}->{LAYOUT}",
                   direction=_direction(stacks), optimizer_format="dp_reshardable")
    assert not loaded, loaded
    assert on_reader["next_step"] == written["next_step"]
    assert not after, after


def test_a_checkpoint_of_megatron_core_019_is_refused_on_016_before_any_rank_works(stacks, resumed, tmp_path,
                                                                                   report):
    """0.19 writes the common state into its torch_dist files and no common.pt, which 0.16 reads
    the common state from: without the refusal every 0.16 rank failed inside the load. The command
    line refuses it with exit 2 and one line naming both versions; the policy it built is as it
    was, nothing is written, and the checkpoint is untouched."""
    checkpoint = resumed["fully_reshardable@dp2"]["resaved"]  # what 0.19 wrote
    assert "common.pt" not in read_manifest(checkpoint).files
    ran = stacks[WRITER].cli("resume", tmp_path / "out", f"back={checkpoint}@{LAYOUT}")
    job = ran.expect(2)["jobs"]["back"]
    written_by, here = stacks[READER].versions["megatron_core"], stacks[WRITER].versions["megatron_core"]
    (error,) = [text for text in ran.stderr.splitlines() if text.startswith("cross_stack")]
    report.add("refused_load_changed_state", float(not job["state_unchanged"]), tolerance=0,
               passed=job["state_unchanged"], claim="exact", layout=f"dp2->{LAYOUT}",
               direction=f"{written_by}->{here}", optimizer_format="fully_reshardable")
    assert f"megatron-core {written_by}" in error and f"megatron-core {here}" in error and "common.pt" in error
    assert job["refused"] in error
    assert job["state_unchanged"]
    assert not job["wrote"] and not (tmp_path / "out" / "back").exists()
    verify_files(checkpoint, read_manifest(checkpoint))  # every file as the 0.19 save wrote it


@pytest.mark.parametrize("layout", ["dp2", LAYOUT])
def test_mbridge_and_megatron_bridge_export_one_state_as_the_same_hf_tensors(stacks, written, resumed, layout,
                                                                              report):
    """The state 0.16 saved after training, exported by mbridge there, and the same state loaded on
    0.19 (equal to it: the re-save diff above), exported by Megatron-Bridge: every tensor name
    and value identical, fp32."""
    bridges = {line: stacks[line].versions["bridge"] for line in (WRITER, READER)}
    assert bridges == {WRITER: "mbridge", READER: "megatron-bridge"}
    exported = cross_stack.read_hf(written["saved"])
    other = cross_stack.read_hf(resumed[f"fully_reshardable@{layout}"]["loaded"])
    differing = _differing(exported, other)
    report.add("hf_tensors_differing", len(differing), tolerance=0, passed=not differing, claim="exact",
               layout=f"{LAYOUT}->{layout}", direction=_direction(stacks), n_tensors=len(exported),
               bridges="mbridge->megatron-bridge")
    assert {t.dtype for t in exported.values()} == {torch.float32}
    assert not differing, differing
    assert len(exported) > 0


@pytest.mark.parametrize("here, files, refused", [
    ("0.16.1", ["__0_0.distcp", ".metadata", "metadata.json"], True),  # 0.19's layout on 0.16
    ("0.16.1", ["__0_0.distcp", ".metadata", "metadata.json", "common.pt"], False),  # 0.16's own
    ("0.19.2", ["__0_0.distcp", ".metadata", "metadata.json"], False),  # 0.19 reads its own format
    ("0.19.2", ["__0_0.distcp", ".metadata", "metadata.json", "common.pt"], False),  # and 0.16's
])
def test_the_refusal_follows_where_the_common_state_is_and_who_reads_it(monkeypatch, here, files, refused):
    """The rule behind the refusal above, on either stack without the other: a checkpoint without
    common.pt is refused exactly where megatron-core reads the common state only from there."""
    from harness.checkpoint.manifest import Manifest

    written_by = "0.19.2" if "common.pt" not in files else "0.16.1"
    manifest = Manifest(model="m", model_config={}, layout="tp2", world_size=2, dtype="fp32",
                        optimizer_format="fully_reshardable", steps_done=2, consumed_samples=16,
                        megatron_core=written_by, files={name: {"size": 1, "sha256": ""} for name in files})
    monkeypatch.setattr(manager, "_megatron_version", lambda: here)
    if not refused:
        manager.check_format_readable("ckpt", manifest)
        return
    with pytest.raises(CheckpointError, match=rf"megatron-core {written_by}.*megatron-core {here} here.*common\.pt"):
        manager.check_format_readable("ckpt", manifest)
