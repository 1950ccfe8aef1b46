"""The committed trajectory of the RL loop (dp2, tiny-qwen3, seed 0, 3 iterations, CPU): what the
"same seed, same trajectory, bit for bit, on any machine" claim is checked against.

It holds on any x86-64 machine under the harness's pinned CPU arithmetic (`--mrh-cpu-isa avx2`, the
default: harness.backends.cpu_arithmetic) with the same library versions (CI installs exactly
ci/constraints/harness-cpu.txt). Recorded on an AMD EPYC with AVX-512 (avx2 pin), it equals the
committed CPU baseline that another machine made, bit for bit. Another torch, megatron-core, mbridge
or transformers may round differently: the test then says so and skips, it does not pass.

Refresh (only with a change that explains it): `.venv/bin/python -m suites.rl.golden`.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

PATH = Path(__file__).with_name("golden") / "dp2-tiny-qwen3-seed0.json"
LAYOUT, MODEL, ITERATIONS = "dp2", "tiny-qwen3", 3
VERSIONED = ("torch", "megatron-core", "mbridge", "transformers")


def versions() -> dict[str, str | None]:
    from harness.report.fingerprint import environment_fingerprint

    fingerprint = environment_fingerprint()
    return {name: fingerprint[name] for name in VERSIONED}


def trajectory(history) -> list[dict]:
    """Every metric and every sampled token of each iteration (no wall times; no field the loop left
    unset, e.g. the routing agreement of a run without routing replay)."""
    return [{k: v for k, v in asdict(h).items() if k != "seconds" and v is not None} for h in history]


def load() -> dict:
    return json.loads(PATH.read_text())


def _record() -> None:
    from harness.backends import cpu_arithmetic
    from harness.launch.pool import WorldPool
    from harness.parallel.state import as_layout
    from harness.rl.loop import LoopConfig, RLLoop

    isa = cpu_arithmetic.pin()
    pool = WorldPool()
    try:
        with RLLoop(pool.get(2, "cpu"), as_layout(LAYOUT), MODEL, LoopConfig(iterations=ITERATIONS)) as loop:
            history = loop.run()
    finally:
        pool.close()
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(json.dumps({"layout": LAYOUT, "model": MODEL, "cpu_isa": isa, "versions": versions(),
                                "iterations": trajectory(history)}, indent=1) + "\n")
    print(f"wrote {PATH}")


if __name__ == "__main__":
    _record()
