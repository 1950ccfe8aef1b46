"""Damaged, foreign or incomplete checkpoints are one clear error before any work, and neither the
policy nor anything on disk is overwritten."""
from __future__ import annotations

import pytest
import torch

from harness.checkpoint import CheckpointError, read_manifest
from harness.checkpoint.manifest import MANIFEST
from harness.checkpoint.resume_check import CONFIG, MODEL, train_batch


@pytest.fixture
def saved(policy, device, tmp_path):
    """(a trained tp2 policy's checkpoint dir, a fresh tp2 policy to load it into, its state)."""
    source = policy("tp2", MODEL, **CONFIG)
    source.step(train_batch(0))
    source.save(tmp_path / "ckpt")
    target = policy("tp2", MODEL, **CONFIG)
    return tmp_path / "ckpt", target, target.hf_state_dict()


def _unchanged(target, before) -> bool:
    after = target.hf_state_dict()
    return target.position()["steps_done"] == 0 and all(torch.equal(before[n], after[n]) for n in before)


def _shard(directory):
    return sorted(directory.glob("*.distcp"))[0]


@pytest.mark.parametrize("damage, message", [
    ("truncate", "truncated"), ("corrupt", "corrupt"), ("remove-shard", "missing"),
    ("remove-manifest", "not a complete checkpoint"), ("garble-manifest", "unreadable manifest"),
])
def test_damaged_checkpoint_is_one_clear_error_and_changes_nothing(saved, damage, message):
    directory, target, before = saved
    shard = _shard(directory)
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "corrupt":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
        shard.write_bytes(bytes(data))
    elif damage == "remove-shard":
        shard.unlink()
    elif damage == "remove-manifest":
        (directory / MANIFEST).unlink()
    else:
        (directory / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=message):
        target.load(directory)
    assert _unchanged(target, before)


def test_checkpoint_of_another_model_is_refused(policy, device, saved):
    directory, _, _ = saved
    other = policy("tp2", "tiny-llama", **CONFIG)
    before = other.hf_state_dict()
    with pytest.raises(CheckpointError, match="another model"):
        other.load(directory)
    assert _unchanged(other, before)


def test_saving_over_an_existing_directory_is_refused(saved):
    directory, target, _ = saved
    files = {p.name: p.read_bytes() for p in directory.iterdir()}
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        target.save(directory)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == files


def test_restoring_rng_at_another_layout_is_refused(policy, device, saved):
    directory, _, _ = saved
    other = policy("pp2", MODEL, **CONFIG)
    with pytest.raises(CheckpointError, match="RNG states are per rank"):
        other.load(directory, load_rng=True)


def test_a_failed_save_leaves_no_directory(policy, device, tmp_path):
    """Each checkpoint directory is complete or absent: a save that dies on the ranks leaves
    neither the target nor its hidden partial directory."""
    doomed = policy("tp2", MODEL, **CONFIG)
    from harness.parallel.state import run_in_layout
    from harness.training.handles import _drop

    run_in_layout(doomed.world, doomed.layout, _drop, doomed.key, seed=None)  # ranks lose the worker
    with pytest.raises(RuntimeError, match="not on this rank"):
        doomed.save(tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_manifest_records_what_was_saved(saved):
    directory, _, _ = saved
    manifest = read_manifest(directory)
    assert (manifest.layout, manifest.world_size, manifest.steps_done, manifest.consumed_samples) == ("tp2", 2, 1, 8)
    assert manifest.optimizer_format == "fully_reshardable"
    assert set(manifest.files) == {p.name for p in directory.iterdir() if p.name != MANIFEST}


def test_the_model_fingerprint_tells_rope_scaling_and_base_apart():
    """A checkpoint records the whole RoPE configuration: under transformers 5 a top-level
    rope_theta is absent, so a tiny-llama checkpoint would otherwise pass as a tiny-llama3 one."""
    from harness.checkpoint.manifest import model_fingerprint
    from harness.models import load_hf_config

    plain, scaled = (model_fingerprint(load_hf_config(m)) for m in ("tiny-llama", "tiny-llama3"))
    assert plain["rope"]["rope_theta"] == 10000.0 and plain["rope"]["rope_type"] == "default"
    assert scaled["rope"]["rope_type"] == "llama3" and plain != scaled
    assert {k: v for k, v in plain.items() if k != "rope"} == {k: v for k, v in scaled.items() if k != "rope"}


def test_a_checkpoint_of_the_other_layer_spec_is_refused(saved, device, spec, world_pool):
    """TE fuses each layer norm into the linear layer after it, so a dist checkpoint of one spec
    does not load into the other: one clear error before any rank works, nothing changed. Where
    TE is installed (CUDA) the other spec's policy is real; elsewhere the manifest says te."""
    from harness.bridge import specs
    from harness.training.handles import PolicyHandle

    directory, target, before = saved
    if device == "cuda" and specs.installed():
        other = PolicyHandle(world_pool.get(2, device, "local" if spec == "te" else "te"), "tp2", MODEL, **CONFIG)
        before = other.hf_state_dict()
        target = other
    else:
        manifest = read_manifest(directory)
        (directory / MANIFEST).write_text(manifest.to_json().replace('"spec": "local"', '"spec": "te"'))
    with pytest.raises(CheckpointError, match=r"saved from a \w+-spec policy, loading into a \w+-spec one"):
        target.load(directory)
    assert _unchanged(target, before)
