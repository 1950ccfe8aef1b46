"""`mrh bench ckpt`: one JSON line of sane figures on CPU; bad input exits 2 before any rank starts."""
from __future__ import annotations

import json

import pytest

from harness.cli import main as mrh

pytestmark = pytest.mark.world_size(2)

FIELDS = {"model", "layout", "device", "world_size", "dtype", "checkpoint_bytes", "saves", "caller",
          "sync_save_s", "async_blocking_s", "async_total_s", "ratio", "step_s_alone", "step_s_during_write",
          "callers", "versions", "blocking_fraction_of_sync", "blocking_breakdown_s", "writer_cpu_s"}


def test_bench_ckpt_prints_one_json_line_of_positive_figures(tmp_path, capsys):
    root = tmp_path / "ckpts"
    code = mrh(["bench", "ckpt", "--device", "cpu", "--layout", "dp2", "--saves", "1", "--dir", str(root)])
    out, err = capsys.readouterr()
    assert code == 0, err[-4000:]
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # progress goes to stderr
    result = json.loads(lines[0])
    assert FIELDS <= set(result), sorted(FIELDS - set(result))
    assert (result["model"], result["layout"], result["device"], result["world_size"], result["dtype"],
            result["saves"], result["caller"]) == ("tiny-qwen3-kv4", "dp2", "cpu", 2, "fp32", 1, "temporal")
    assert result["checkpoint_bytes"] > 1_000_000  # weights + Adam state of the tiny model
    for key in ("sync_save_s", "async_blocking_s", "async_total_s", "step_s_alone", "step_s_during_write"):
        assert 0 < result[key] < 120, (key, result[key])
    assert result["async_total_s"] >= result["async_blocking_s"]  # committed after training could continue
    assert result["ratio"] == pytest.approx(result["sync_save_s"] / result["async_blocking_s"], rel=0.02)
    assert set(result["callers"]) == {"temporal"}
    stages = result["blocking_breakdown_s"]
    assert set(stages) == {"state_dict_s", "plan_s", "stage_s"} and all(v >= 0 for v in stages.values())
    assert sum(stages.values()) <= result["async_blocking_s"] * 1.05  # parts of the blocking time
    assert result["writer_cpu_s"] > 0  # the forked writers did the writing
    assert result["versions"]["torch"] and result["versions"]["megatron_core"]
    assert "sync save" in err and "async save" in err
    assert not any(root.iterdir())  # the bench's checkpoints are gone without --keep-dir


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--layout", "tp3"], "tp=3 does not divide num_attention_heads"),
    (["--layout", "dp2q"], "cannot parse layout"),
    (["--dtype", "fp16"], "unknown dtype 'fp16'"),
    (["--saves", "0"], "--saves must be an integer >= 1"),
    (["--caller", "persistent"], "the persistent caller needs CUDA"),
    (["--caller", "both"], "the persistent caller needs CUDA"),
    (["--caller", "sideways"], "unknown caller 'sideways'"),
    (["--optimizer-format", "flat"], "unknown optimizer format 'flat'"),
])
def test_bad_input_exits_2_before_any_rank_starts(monkeypatch, capsys, argv, message):
    from harness.launch import World

    def no_start(self):
        raise AssertionError("a rank was started for bad input")

    monkeypatch.setattr(World, "start", no_start)
    assert mrh(["bench", "ckpt", "--device", "cpu", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("mrh bench ckpt: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_cuda_layout_needs_the_gpus(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mrh(["bench", "ckpt", "--device", "cuda", "--layout", "dp2"]) == 2
    assert "needs 2 GPUs, 0 visible" in capsys.readouterr().err
