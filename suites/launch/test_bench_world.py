"""`mrh bench world --launcher ray`: one JSON line of positive figures beside the process launcher's
(world start, layout switch, a fresh torchrun launch). Its own process: it starts its own Ray."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.nightly  # ~33 s on the CI machine (a Ray start and a fresh torchrun launch)
def test_bench_world_on_ray_prints_one_json_line_of_positive_figures():
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "harness.cli", "bench", "world", "--launcher", "ray",
                           "--repeats", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    figures = json.loads(lines[0])
    assert figures["launcher"] == "ray" and figures["ranks"] == 2
    for key in ("ray_init_s", "world_start_s", "layout_switch_s", "fresh_launch_s"):
        assert figures[key] > 0, (key, figures)
