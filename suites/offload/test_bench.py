"""`mrh bench offload`: bad input is exit 2 before any rank starts; a CPU run prints one JSON line
with every figure (the CPU figures are memcpy speeds: the GPU run's are the ones that count)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

MRH = [shutil.which("mrh") or f"{sys.executable} -m harness.cli"][0].split()


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*MRH, "bench", "offload", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("kwargs, message", [
    (dict(cycles=0), "--cycles must be an integer >= 1"),
    (dict(layout="tp3"), "tp=3 does not divide"),
    (dict(dtype="fp16"), "unknown dtype"),
    (dict(model="no-such-model"), "no-such-model"),
])
def test_bad_input_is_refused_before_any_work(kwargs, message):
    from harness.bench.ckpt import BadInput
    from harness.bench.offload import run

    with pytest.raises(BadInput, match=message):
        run(**{"model": "tiny-qwen3-kv4", "device": "cpu", **kwargs})


def test_bad_input_is_exit_2():
    done = _bench("--cycles", "0")
    assert done.returncode == 2 and "--cycles must be an integer >= 1" in done.stderr and not done.stdout


def test_cpu_run_prints_every_figure():
    done = _bench("--device", "cpu", "--cycles", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert set(result["bandwidth"]) == {"pinned_d2h_GiBps", "pinned_h2d_GiBps", "pageable_d2h_GiBps",
                                        "pageable_h2d_GiBps"}
    for component in ("params", "optimizer"):
        figures = result["components"][component]
        assert figures["copied_bytes"] == figures["bytes"] > 0 and figures["offload_s"] > 0
        assert 0 < figures["fraction_of_pinned"] and (figures["fraction_of_pinned"] >= 0.8 or figures["reason"])
    assert result["components"]["grads"]["copied_bytes"] == 0
