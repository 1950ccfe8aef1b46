"""`mrh bench sync`: a CPU run prints one JSON line whose byte count is the model's exported tensors'
(with every figure positive); bad input exits 2 before any rank or engine starts. The CPU figures are
memcpy and pickling speeds: the GPU run's (reports/gpu/) are the ones the goal is about."""
from __future__ import annotations

import json

import pytest
import torch

from harness.bridge.backends import current
from harness.cli import main as mrh

FIELDS = {"model", "layout", "device", "world_size", "dtype", "engine", "bucket_bytes", "repeats", "bytes", "copy",
          "copy_gbps", "goal_of_copy", "transports", "not_measured", "machine", "versions", "load_path_asked"}
# where the time goes (added keys; export_s and load_s were there before)
SPLIT = ("export_s", "export_walk_s", "export_copy_s", "export_pack_s", "export_round_trip_s", "load_s")
TRANSPORT_FIELDS = {"transport", "placement", "engine_options", "engine_start_s", "bytes", "buckets", "tensors",
                    "max_bucket_bytes", "seconds", "gbps", "samples_s", "warmup_s", "of_copy", *SPLIT, "updates",
                    "load_path"}


def _exported_bytes(model: str, dtype: torch.dtype) -> int:
    """What one full update must move: the HF checkpoint's tensors (gate/up travel fused, same bytes)."""
    from harness.models import build_hf_model
    from harness.models.zoo import checkpoint_state_dict

    hf = build_hf_model(model, dtype=dtype)
    state = checkpoint_state_dict(hf)
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")  # sent once, as embed_tokens
    return sum(t.numel() * t.element_size() for t in state.values())


def test_cpu_run_prints_one_json_line_of_the_models_bytes(tmp_path, capsys):
    out = tmp_path / "bench-sync.json"
    code = mrh(["bench", "sync", "--device", "cpu", "--model", "tiny-qwen3", "--layout", "tp1", "--engine", "hf",
                "--transports", "host", "--repeats", "1", "--bucket-mb", "0.0625", "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr[-4000:]
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout  # the table and progress go to stderr
    result = json.loads(lines[0])
    assert json.loads(out.read_text()) == result
    assert FIELDS <= set(result), sorted(FIELDS - set(result))
    assert (result["model"], result["layout"], result["device"], result["world_size"], result["dtype"],
            result["engine"], result["repeats"], result["bucket_bytes"]) == \
        ("tiny-qwen3", "tp1", "cpu", 1, "bf16", "hf", 1, 64 << 10)
    assert set(result["transports"]) == {"host"}
    host = result["transports"]["host"]
    assert TRANSPORT_FIELDS <= set(host), sorted(TRANSPORT_FIELDS - set(host))
    assert host["bytes"] == result["bytes"] == result["copy"]["bytes"] == _exported_bytes("tiny-qwen3", torch.bfloat16)
    assert host["buckets"] > 1 and host["max_bucket_bytes"] <= 64 << 10
    assert host["seconds"] > 0 and host["gbps"] > 0 and len(host["samples_s"]) == 1
    assert host["gbps"] == pytest.approx(host["bytes"] / host["seconds"] / 1e9, rel=1e-2)
    assert result["copy_gbps"] > 0 and result["copy"]["kind"] == "host memcpy"
    assert host["of_copy"] == pytest.approx(host["gbps"] / result["copy_gbps"], rel=1e-2)
    assert host["placement"] == "colocated" and "copy_peer" not in result
    assert "the hf engine takes buckets through the host only" in result["not_measured"]["broadcast"]
    assert result["machine"]["device_name"] and result["versions"]["torch"] and result["bridge"] == current()
    assert "transport" in stderr and "of copy" in stderr and "separate placement not measured" in stderr
    # the split: each part >= 0, the export's parts add up to it, the HF engine has no load path
    assert len(host["updates"]) == 1 and host["load_path"] is None and result["load_path_asked"] is None
    update = host["updates"][0]
    assert update["seconds"] == host["samples_s"][0] and all(update[key] == host[key] >= 0 for key in SPLIT)
    parts = sum(update[key] for key in ("export_walk_s", "export_copy_s", "export_pack_s", "export_round_trip_s"))
    assert parts == pytest.approx(update["export_s"], rel=1e-3)
    assert update["export_walk_s"] > 0 and update["export_copy_s"] > 0 and update["export_round_trip_s"] > 0
    assert update["export_s"] + update["load_s"] <= update["seconds"]
    assert "walk" in stderr and "copy+pack" in stderr and "round trips" in stderr and "load path" in stderr
    assert "bound an update at 50%" in stderr


def test_a_failing_transport_is_recorded_and_exits_1(monkeypatch, capsys):
    from harness.bench import sync

    def broken(*args, **kwargs):
        raise RuntimeError("the engine did not start")

    monkeypatch.setattr(sync, "_open", broken)
    code = mrh(["bench", "sync", "--device", "cpu", "--model", "tiny-qwen3", "--engine", "hf", "--repeats", "1"])
    stdout, stderr = capsys.readouterr()
    assert code == 1, stderr[-4000:]
    result = json.loads(stdout)
    assert result["transports"]["host"]["error"] == "RuntimeError: the engine did not start"
    assert result["bytes"] == _exported_bytes("tiny-qwen3", torch.bfloat16) and result["copy_gbps"] > 0
    assert "host failed: RuntimeError: the engine did not start" in stderr


@pytest.mark.parametrize("argv, message", [
    (["--transports", "nccl"], "the separate placement's is 'broadcast'"),
    (["--transports", "rdma"], "unknown transport 'rdma'; choose from host, cuda-ipc, broadcast"),
    (["--transports", "broadcast"], "transport 'broadcast' needs --engine vllm"),
    (["--transports", "host,host"], "names a transport twice"),
    (["--transports", "cuda-ipc"], "transport 'cuda-ipc' needs --device cuda"),
    (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["--layout", "tp3"], "tp=3 does not divide"),
    (["--dtype", "fp16"], "unknown dtype 'fp16'"),
    (["--engine", "sglang"], "unknown engine 'sglang'"),
    (["--repeats", "0"], "--repeats must be an integer >= 1"),
    (["--bucket-mb", "0"], "--bucket-mb must be a number > 0"),
    (["--load-path", "in-place"], "load_path (how an engine loads an update) is the vLLM engine's, not the hf engine's"),
])
def test_bad_input_exits_2_before_anything_starts(monkeypatch, capsys, argv, message):
    from harness.launch import World

    def no_start(self):
        raise AssertionError("a rank was started for bad input")

    monkeypatch.setattr(World, "start", no_start)
    assert mrh(["bench", "sync", "--device", "cpu", "--model", "tiny-qwen3", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("mrh bench sync: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_cuda_requests_the_machine_cannot_serve_exit_2(monkeypatch, capsys, tmp_path):
    from harness.bench import sync

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mrh(["bench", "sync", "--device", "cuda"]) == 2
    assert "--device cuda: no GPU is visible" in capsys.readouterr().err
    monkeypatch.setattr(sync, "_gpu_count", lambda: 1)
    monkeypatch.setattr("harness.bench.ckpt._gpu_count", lambda: 1)
    assert mrh(["bench", "sync", "--device", "cuda", "--engine", "hf", "--transports", "cuda-ipc"]) == 2
    assert "transport 'cuda-ipc' needs --engine vllm" in capsys.readouterr().err
    assert mrh(["bench", "sync", "--device", "cuda", "--transports", "broadcast"]) == 2
    assert "transport 'broadcast' on cuda puts the engine on a GPU of its own: layout tp1 takes 1, 1 visible" \
        in capsys.readouterr().err
    existing = tmp_path / "taken.json"
    existing.write_text("{}")
    assert mrh(["bench", "sync", "--device", "cpu", "--out", str(existing)]) == 2
    assert "exists: nothing is overwritten" in capsys.readouterr().err


def test_defaults_follow_the_device(monkeypatch):
    from harness.bench import sync
    from harness.rollout.sync import DEFAULT_BUCKET_BYTES

    monkeypatch.setattr(sync, "_check_vllm", lambda model, device: None)  # no vLLM start, no environment needed
    cpu = sync.check_input(device="cpu")
    assert (cpu["model"], cpu["layout"].name, cpu["dtype"], cpu["engine"], cpu["transports"], cpu["bucket_bytes"],
            cpu["repeats"]) == ("qwen3-0.6b-shape", "tp1", "bf16", "hf", ["host"], DEFAULT_BUCKET_BYTES, 3)
    monkeypatch.setattr(sync, "_gpu_count", lambda: 1)
    monkeypatch.setattr("harness.bench.ckpt._gpu_count", lambda: 1)
    cuda = sync.check_input(device="cuda")
    assert (cuda["engine"], cuda["transports"], cuda["engine_gpu"]) == ("vllm", ["cuda-ipc", "host"], None)
    assert "needs a GPU of its own beside the layout's 1: 1 visible" in cuda["not_measured"]["broadcast"]
    assert sync.check_input(device="cuda", engine="hf")["transports"] == ["host"]
    monkeypatch.setattr(sync, "_gpu_count", lambda: 2)  # a GPU left for the separate engine: the last one
    monkeypatch.setattr("harness.bench.ckpt._gpu_count", lambda: 2)
    two = sync.check_input(device="cuda")
    assert (two["transports"], two["engine_gpu"], two["not_measured"]) == (["cuda-ipc", "host", "broadcast"], 1, {})
    assert sync.check_input(device="cpu", engine="vllm", transports="broadcast")["engine_gpu"] is None  # gloo
    assert cpu["load_path"] is None and sync.check_input(device="cpu", engine="vllm", load_path="reload")["load_path"] \
        == "reload"
    assert sync.check_input(device="cuda", load_path="in-place")["load_path"] == "in-place"


@pytest.mark.parametrize("request_, message", [
    (dict(engine="hf", load_path="reload"),
     "load_path (how an engine loads an update) is the vLLM engine's, not the hf engine's"),
    (dict(engine="vllm", load_path="in-place"), "load_path='in-place' needs device='cuda'"),
    (dict(engine="vllm", load_path="fast"), "load_path must be one of ('reload', 'in-place')"),
])
def test_a_load_path_the_engine_cannot_take_is_bad_input(monkeypatch, request_, message):
    from harness.bench import sync
    from harness.bench.ckpt import BadInput

    monkeypatch.setattr(sync, "_check_vllm", lambda model, device: None)
    with pytest.raises(BadInput) as refused:
        sync.check_input(device="cpu", **request_)
    assert message in str(refused.value)
