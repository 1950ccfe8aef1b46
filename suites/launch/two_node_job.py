"""The two-node job of test_two_nodes.py, run in its own process (it owns a Ray cluster):
a head and a second node on this machine (ray.cluster_utils.Cluster, each its own raylet), a
2-rank RayWorld spread over them, then parity at tp2 and a checkpoint saved at tp2 and resumed at
pp2, both across the nodes. Writes what it found as JSON to argv[1]."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

INNER = textwrap.dedent("""
    import pytest
    import ray

    @pytest.mark.world_size(2)
    def test_attached(world):
        assert world.launcher == "ray" and len([n for n in ray.nodes() if n["Alive"]]) == 2
        assert world.run(sum, [1, 2]) == [3, 3]
""")


def main(out: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from harness.checkpoint.resume_check import resume_and_compare, train_and_save
    from harness.launch.ray_world import RayWorld
    from harness.parity.runner import ParityCase, run_parity
    from harness.training.handles import PolicyHandle

    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    cluster.add_node(num_cpus=2, resources={"second": 1})
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    found = {"cluster_nodes": len([n for n in ray.nodes() if n["Alive"]])}
    world = RayWorld(2, "cpu", placement="STRICT_SPREAD", timeout=300, echo_output=False)
    try:
        world.start()
        found["rank_nodes"] = [n["node_id"] for n in world.nodes]
        found["start_s"] = round(time.monotonic() - started, 1)
        parity = run_parity(world, ParityCase("tiny-qwen3", "tp2"), suite="launch", test="two-nodes")
        found["parity"] = {"passed": parity.passed, "summary": parity.summary(),
                           "rows": [r.__dict__ for r in parity.rows]}

        def make_policy(layout, model, **config):
            return PolicyHandle(world, layout, model, **config)

        with tempfile.TemporaryDirectory(prefix="mrh-two-nodes-") as tmp:
            source = train_and_save(make_policy, "tp2", f"{tmp}/ckpt")
            result = resume_and_compare(make_policy, source, "pp2")
        found["resume"] = {"passed": result.passed, "summary": result.summary(),
                           "rows": [r.__dict__ for r in result.rows(suite="launch", test="two-nodes")]}
        world.close()
        found["attached"] = _attached_session(cluster.address)
        found["nodes_after_attached_session"] = len([n for n in ray.nodes() if n["Alive"]])
    finally:
        world.close()
        ray.shutdown()
        cluster.shutdown()
    found["wall_s"] = round(time.monotonic() - started, 1)
    with open(out, "w") as f:
        json.dump(found, f, default=str)


def _attached_session(address: str) -> dict:
    """A pytest session with --mrh-ray-address: it must run on this cluster, not start its own."""
    with tempfile.TemporaryDirectory(prefix="mrh-attached-") as tmp:
        with open(os.path.join(tmp, "test_attached.py"), "w") as f:
            f.write(INNER)
        done = subprocess.run([sys.executable, "-m", "pytest", "test_attached.py", "-q", "-p", "no:cacheprovider",
                               "--mrh-devices=cpu", "--mrh-launcher=ray", f"--mrh-ray-address={address}",
                               f"--mrh-report-dir={tmp}/runs"], cwd=tmp, capture_output=True, text=True, timeout=600)
    return {"returncode": done.returncode, "output": done.stdout[-3000:] + done.stderr[-2000:]}


if __name__ == "__main__":
    main(sys.argv[1])
