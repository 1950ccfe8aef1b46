"""`mrh loop`: bad input is one line and exit 2 before any rank starts; a run prints each
iteration and writes its report (JSON, CSV, plot, summary)."""
from __future__ import annotations

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


def test_an_existing_report_is_never_overwritten(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["loop", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "nothing is overwritten" in capsys.readouterr().err and (tmp_path / "keep.txt").read_text() == "mine"


def test_a_run_prints_each_iteration_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["loop", "--device", "cpu", "--layout", "dp2", "--iterations", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("token_mult_prob_error") == 2 and "reward" in printed
    data = json.loads((out / "iterations.json").read_text())
    assert [it["iteration"] for it in data["iterations"]] == [0, 1] and data["layout"] == "dp2"
    assert (out / "loop.png").stat().st_size > 1000 and (out / "iterations.csv").read_text().count("\n") == 3
    assert "| 1 |" in (out / "summary.md").read_text()


def test_rank_output_goes_to_the_run_log_and_leaves_the_progress_lines_alone(tmp_path):
    """The ranks' warnings (Megatron's, torch's) land in <out>/ranks.log; the terminal gets the
    iteration lines back to back and one pointer line per distinct warning, after the run."""
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


@pytest.mark.nightly  # ~45 s on the CI machine; the loop on vLLM itself runs in CI (test_loop.py)
def test_a_run_on_vllm_writes_its_engine_in_the_report(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["loop", "--device", "cpu", "--layout", "dp2", "--iterations", "2", "--engine", "vllm",
                 "--model", "tiny-qwen3-hd32", "--out", str(out)]) == 0
    data = json.loads((out / "iterations.json").read_text())
    assert data["config"]["engine"] == "vllm" and len(data["iterations"]) == 2
    assert "vllm engine" in (out / "summary.md").read_text()
