"""`mrh parity` end to end: passes on the default model, exits 1 on a shipped wrong variant, and
rejects bad input with one clear error before starting any rank.

The passing run takes two layouts of one world size; CI's exit-1 run is the bf16 norm scale of issue 11
(swapped-gate-up, the fp32 control, runs nightly: its check at tp2 in fp32 is
suites/sensitivity/test_variants.py's in CI). In CI both run `mrh parity`'s main in process on the
session's worlds (cli_on_session_worlds: the same command code, output and exit code, without a fresh
world's ~17 s); the real console script runs in test_preflight's exit-2 case, and the nightly exit-1 run
below launches `mrh` itself."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

MRH = [shutil.which("mrh") or f"{sys.executable} -m harness.cli"][0].split()


def _mrh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MRH, "parity", *args], capture_output=True, text=True, timeout=600)


def _mrh_in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """`mrh parity ARGS` through harness.cli.main in this process (its worlds: the session's)."""
    from harness.cli import main

    capsys.readouterr()  # what earlier output the capture holds is not the command's
    code = main(["parity", *args])
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["mrh", "parity", *args], code, captured.out, captured.err)


def test_parity_passes_for_the_default_model_and_prints_json_rows(cli_on_session_worlds, capsys):
    done = _mrh_in_process(capsys, "--model", "tiny-qwen3", "--layouts", "tp2,pp2", "--device", "cpu", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout)
    assert {r["layout"] for r in rows} == {"tp2", "pp2"} and all(r["passed"] for r in rows)
    assert max(r["value"] for r in rows if r["metric"] == "max_abs") <= 1e-5
    assert "[1/2]" in done.stderr and "[2/2]" in done.stderr, "progress lines expected on stderr"


@pytest.mark.nightly
def test_parity_exits_1_on_a_negative_control():
    done = _mrh("--layouts", "tp2", "--variant", "swapped-gate-up")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "FAIL" in done.stdout


def test_a_one_percent_norm_scale_fails_bf16_parity(cli_on_session_worlds, capsys):
    """Issue 11's report: this exited 0 when HF and Megatron rounded their norms differently."""
    done = _mrh_in_process(capsys, "--layouts", "tp2", "--dtype", "bf16", "--variant", "scaled-norm")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "exact" in done.stdout and "FAIL" in done.stdout


def test_an_approximate_bf16_run_lists_its_noise_rows_as_observed(cli_on_session_worlds, capsys):
    """The approximate regime's fp32 evaluation brings each engine's bf16 distance to fp32 (bf16_noise): rows
    with no bound, printed as observed, which the exit code does not count."""
    done = _mrh_in_process(capsys, "--layouts", "tp2", "--dtype", "bf16", "--reference", "plain",
                           "--norm-precision", "fused")
    assert done.returncode == 0, done.stderr[-3000:]
    noise = [line for line in done.stdout.splitlines() if "noise_" in line]
    assert len(noise) == 9 and all(line.endswith("observed") for line in noise), done.stdout


@pytest.mark.parametrize("args, message", [
    (["--layouts", "tp3"], "tp=3 does not divide num_attention_heads=4"),
    (["--model", "/no/such/model"], "not a zoo name"),
    (["--layouts", "tp2", "--variant", "unsynced-tied-embedding"], "needs a tied-embedding model"),
    (["--variant", "nope"], "unknown variant"),
    (["--variant", "no-finalize-grads"], "is a training variant"),
    (["--norm-precision", "sloppy"], "invalid choice"),
    (["--layouts", "tp2", "--variant", "dropped-rope-scaling"], "needs a model with Llama-3 RoPE scaling"),
    (["--model", "tiny-gemma3", "--packing", "thd"], "--packing thd with sliding-window attention"),
    (["--model", "tiny-gemma3", "--layouts", "cp2"], "with sliding-window attention"),
    # Context parallelism (issue 36): its options need a cp layout.
    (["--layouts", "tp2", "--cp-comm-type", "a2a"], "needs a context-parallel layout"),
])
def test_bad_input_is_one_clear_error_with_exit_2(args, message, capsys):
    """In process (the end-to-end runs above launch `mrh`): the exit code and the message."""
    from harness.cli import main

    try:
        code = main(["parity", *args])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "[1/" not in err, "no layout may start before the input is validated"
