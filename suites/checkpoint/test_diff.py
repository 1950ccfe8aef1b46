"""The plain-tensor checkpoint diff: resharded checkpoints of one state diff equal, a trained one
does not, and bad input is one clear error (`mrh ckpt diff` exits 0 / 1 / 2).

The first tests check the comparison on synthetic tensors (no world); the last two build real
checkpoints with the policy worker on the persistent 2-rank world.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from harness.checkpoint.diff import (CheckpointError, compare_tensor, diff_checkpoints, diff_state,
                                     load_full_tensors)
from harness.cli import main as mrh

MRH = [shutil.which("mrh") or f"{sys.executable} -m harness.cli"][0].split()


def _state(**tensors):
    base = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    base.update(tensors)
    return {k: v for k, v in base.items() if v is not None}


# ----------------------------------------------------------------------------- comparison, no world
def test_identical_state_is_equal_and_gives_one_passing_summary_row():
    a = _state(nan=torch.tensor([float("nan"), float("inf"), 1.0]))
    result = diff_state(a, {k: v.clone() for k, v in a.items()}, {"position": {"steps_done": 3}},
                        {"position": {"steps_done": 3}})
    assert result.ok and result.equal == 3, result.summary()  # NaN and inf in the same places are equal
    assert result.to_rows() == [{"metric": "tensors_mismatched", "value": 0.0, "tolerance": 0.0, "passed": True, "claim": "exact",
                                 "n_equal": 3, "n_mismatched": 0, "n_missing": 0, "n_extra": 0, "n_common": 0}]


def test_missing_extra_and_mismatched_tensors_are_each_reported():
    a = _state(gone=torch.zeros(2))
    b = _state(w=a["w"] + torch.tensor([[0.0, 0.0, 0.5], [0.0, 0.0, 0.0]]), b=torch.ones(4), new=torch.zeros(1),
               gone=None)
    result = diff_state(a, b)
    assert not result.ok
    assert result.missing == ["gone"] and result.extra == ["new"] and result.equal == 0
    assert result.mismatched["w"] == {"max_abs": 0.5, "shape_a": [2, 3], "shape_b": [2, 3],
                                      "dtype_a": "float32", "dtype_b": "float32"}
    assert result.mismatched["b"]["max_abs"] is None and result.mismatched["b"]["shape_b"] == [4]
    # Shape mismatches (no |Δ|) lead the largest-first listing; the rows carry them as inf.
    assert [key for key, _ in result.largest()] == ["b", "w"]
    rows = result.to_rows()
    assert [(r["metric"], r.get("key"), r["value"]) for r in rows] == [
        ("max_abs_diff", "b", math.inf), ("max_abs_diff", "w", 0.5), ("tensors_mismatched", None, 4.0)]
    assert not any(r["passed"] for r in rows)


def test_tolerances_dtype_and_prefix_filters():
    a = {"model.w": torch.ones(3), "optimizer.m": torch.ones(3)}
    b = {"model.w": torch.ones(3) + 1e-6, "optimizer.m": torch.ones(3, dtype=torch.float64)}
    exact = diff_state(a, b)
    assert set(exact.mismatched) == {"model.w", "optimizer.m"}
    assert exact.mismatched["model.w"]["max_abs"] == pytest.approx(1e-6, rel=0.1)
    # Same values in another dtype: |Δ| = 0 but still a difference, whatever the tolerance.
    assert exact.mismatched["optimizer.m"]["max_abs"] == 0.0
    assert compare_tensor(a["optimizer.m"], b["optimizer.m"], atol=1.0) is not None
    loose = diff_state(a, b, atol=1e-5)
    assert list(loose.mismatched) == ["optimizer.m"] and loose.equal == 1
    assert diff_state(a, b, rtol=1e-5).mismatched.keys() == {"optimizer.m"}
    assert diff_state(a, b, exclude=["optimizer."], atol=1e-5).ok
    assert diff_state(a, b, include=["optimizer."]).equal == 0 and "model.w" not in exact.missing


def test_common_state_is_compared_value_by_value():
    common_a = {"scheduler": {"num_steps": 2, "max_lr": 1e-3}, "position": {"steps_done": 2},
                "optimizer": {"param_groups": [{"step": 2.0}]}}
    common_b = {"scheduler": {"num_steps": 3, "max_lr": 1e-3}, "position": {},
                "optimizer": {"param_groups": [{"step": 2.0}]}}
    result = diff_state({}, {}, common_a, common_b)
    assert result.common == {"scheduler.num_steps": (2, 3), "position.steps_done": (2, "<absent>")}
    assert not result.ok and result.to_rows()[-1]["n_common"] == 2
    assert diff_state({}, {}, common_a, common_b, exclude=["scheduler.", "position."]).ok


def test_bad_paths_are_one_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_full_tensors(tmp_path / "absent")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="not a dist checkpoint"):
        load_full_tensors(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        diff_checkpoints(tmp_path / "notes.txt", tmp_path)
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    (fake / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable"):
        load_full_tensors(fake)
    (fake / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(CheckpointError, match="only torch_dist"):
        load_full_tensors(fake)


def test_cli_exits_2_with_one_line_on_bad_input(tmp_path, capsys):
    assert mrh(["ckpt", "diff", str(tmp_path / "absent"), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mrh ckpt diff: ") and "no such checkpoint directory" in err and err.count("\n") == 1
    assert mrh(["ckpt", "diff", str(tmp_path), str(tmp_path)]) == 2
    assert "not a dist checkpoint" in capsys.readouterr().err
    # The installed entry point maps the same status onto the process exit code.
    done = subprocess.run([*MRH, "ckpt", "diff", str(tmp_path), str(tmp_path / "absent")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not a dist checkpoint" in done.stderr, done.stderr


# ------------------------------------------------------------------------------- real checkpoints
def _batch():
    from harness.models import TINY_VOCAB_SIZE
    from harness.training import make_rl_train_batch

    return make_rl_train_batch(TINY_VOCAB_SIZE, batch_size=4, seed=3, prompt_lengths=[3, 6, 2, 8],
                               response_lengths=[9, 5, 12, 4])


def _save(handle, directory, optimizer_format="fully_reshardable"):
    handle.save(directory, optimizer_format=optimizer_format)
    return directory


def test_resharded_checkpoint_diffs_equal_and_a_trained_one_does_not(policy, device, tmp_path, capsys, report):
    p = policy("tp2", "tiny-qwen3", micro_batches=2)
    p.step(_batch())
    tp2 = _save(p, tmp_path / "tp2")
    q = policy("pp2", "tiny-qwen3", micro_batches=2)
    q.load(tp2)
    pp2 = _save(q, tmp_path / "pp2")

    tensors = load_full_tensors(tp2)
    assert "embedding.word_embeddings.weight" in tensors
    assert any(k.startswith("optimizer.state.exp_avg.") for k in tensors), sorted(tensors)
    assert diff_checkpoints(tp2, tp2).ok
    same = diff_checkpoints(tp2, pp2)
    assert same.ok and same.equal == len(tensors), same.summary()  # exact: rtol = atol = 0
    assert "rng_state" in same.objects_a and "rng_state" in same.objects_b  # listed, not compared
    for row in same.to_rows():
        report.add(**row, layout="tp2->pp2", model="tiny-qwen3", dtype="fp32")
    assert mrh(["ckpt", "diff", str(tp2), str(pp2)]) == 0
    assert "EQUAL" in capsys.readouterr().out

    q.step(_batch())
    trained = _save(q, tmp_path / "pp2-trained")
    moved = diff_checkpoints(pp2, trained)
    assert not moved.ok and not moved.missing and not moved.extra
    assert "embedding.word_embeddings.weight" in moved.mismatched
    assert all(info["max_abs"] > 0 for info in moved.mismatched.values())
    assert moved.common["position.steps_done"] == (1, 2)
    capsys.readouterr()  # drop rank output echoed so far: only the command's JSON must remain
    assert mrh(["ckpt", "diff", str(pp2), str(trained), "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert printed["ok"] is False and set(printed["mismatched"]) == set(moved.mismatched)
    assert mrh(["ckpt", "diff", str(pp2), str(trained), "--show", "3"]) == 1
    table = capsys.readouterr().out
    assert "DIFFERENT" in table and f"... {len(moved.mismatched) - 3} more" in table


def test_optimizer_formats_differ_in_keys_not_in_model_tensors(policy, device, tmp_path):
    """dp_reshardable stores layout-specific flat buffers instead of per-parameter state: the diff
    reports those as missing / extra keys while every model tensor still compares equal."""
    p = policy("tp2", "tiny-qwen3", micro_batches=2)
    p.step(_batch())
    full = _save(p, tmp_path / "full")
    flat = _save(p, tmp_path / "flat", "dp_reshardable")
    result = diff_checkpoints(full, flat)
    assert result.missing and all(k.startswith("optimizer.state.") for k in result.missing)
    assert result.extra and all(k.startswith("optimizer.distributed.") for k in result.extra)
    assert not result.mismatched
    assert result.common["content_metadata.distrib_optim_sharding_type"] == ("fully_reshardable", "dp_reshardable")
    assert diff_checkpoints(full, flat, exclude=["optimizer.", "content_metadata."]).ok

    # A damaged copy is one clear error, never a silent partial tensor.
    broken = shutil.copytree(full, tmp_path / "broken")
    shard = sorted(broken.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="shard data unreadable"):
        diff_checkpoints(full, broken)
    (broken / "common.pt").write_bytes(b"junk")
    shutil.copy(full / shard.name, shard)
    with pytest.raises(CheckpointError, match="common.pt: unreadable"):
        diff_checkpoints(full, broken)


def test_vocab_padding_rows_are_not_model_state():
    """TP4 pads a 251-row vocab to 512 rows, TP2 to 256: with the true vocab size the diff compares
    the real rows only, and still sees a difference inside them."""
    small, large = torch.randn(256, 4), torch.randn(512, 4)
    large[:251] = small[:251]
    assert not diff_state({"emb": small}, {"emb": large}).ok  # shapes differ: not comparable
    trimmed = diff_state({"emb": small}, {"emb": large}, vocab_size=251)
    assert trimmed.ok and trimmed.vocab_trimmed == ["emb"]
    large[10, 0] += 1.0
    assert diff_state({"emb": small}, {"emb": large}, vocab_size=251).mismatched["emb"]["max_abs"] == pytest.approx(1.0)
