"""Two Ray nodes on one machine (a head and a second raylet, ray.cluster_utils.Cluster): a 2-rank
world whose ranks land on different nodes passes parity (tp2) and resumes a checkpoint saved at tp2
at pp2, across them; a pytest session attached to that cluster with --mrh-ray-address runs on it and
leaves it running. Its own process: it owns its Ray cluster (suites/launch/two_node_job.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# nightly: ~45 s on the CI machine (a Ray cluster of two raylets, a world over it, an attached session);
# CI's Ray coverage is the Ray slice (RAY_SLICE in the Makefile), the same launcher on one node.
@pytest.mark.nightly
def test_a_world_spread_over_two_nodes_passes_parity_and_resumes(tmp_path, report):
    out = tmp_path / "found.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    job = subprocess.run([sys.executable, str(ROOT / "suites/launch/two_node_job.py"), str(out)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    found = json.loads(out.read_text())
    assert found["cluster_nodes"] == 2
    assert len(set(found["rank_nodes"])) == 2, found["rank_nodes"]  # one rank per node
    for part in ("parity", "resume"):
        for row in found[part]["rows"]:
            report.add(row["metric"], row["value"], tolerance=row["tolerance"], passed=row["passed"], claim=row["claim"],
                       layout=row["layout"], model=row["model"], dtype=row["dtype"], device=row["device"],
                       launcher="ray", nodes=2, **{k: v for k, v in (row.get("extra") or {}).items()
                                                   if k not in ("launcher", "nodes")})
        assert found[part]["passed"], found[part]["summary"]
    assert found["attached"]["returncode"] == 0, found["attached"]["output"]
    assert found["nodes_after_attached_session"] == 2  # attaching never stops the cluster
