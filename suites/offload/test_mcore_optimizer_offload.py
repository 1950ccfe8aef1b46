"""megatron-core 0.16.1's own `MegatronOptimizer.offload_to_cpu` / `restore_from_cpu`
(optimizer.py:344-380), measured rather than read: the catalog's `mcore-optimizer-offload`.

On CUDA with an fp32 model the DistributedOptimizer's main shards are views of the DDP param buffer
(distrib_optimizer.py:421). `p.data = p.data.cpu()` rebinds them: it frees none of their bytes, and
the restore allocates a second device copy that no longer aliases the buffer. The test states what
this harness measured (see reports/gpu/): the round trip leaves the device holding more than
before and the fp32 shards detached. On the CPU tier `p.is_cuda` is False: it frees nothing.
"""
from __future__ import annotations

from harness.offload.check import round_trip


def test_megatron_cores_optimizer_offload_fails_the_round_trip(policy, device, report):
    from harness.pytest_plugin.collection import gpu_count

    layout = "dp2" if device == "cpu" or gpu_count() >= 2 else "tp1"
    result = round_trip(policy, layout, "fp32", variant="mcore-optimizer-offload", device=device, cycles=1)
    report.extend(result.rows(finding="mcore-optimizer-offload"))
    value = {c.metric: c.value for c in result.checks}
    optimizer_offloads = [r.extra for r in result.byte_rows if r.extra["component"] == "optimizer"
                          and r.extra["op"] == "offload" and r.extra["phase"] == "optimizer-alone"]
    if device == "cpu":
        assert all(r["measured_bytes"] == 0 and r["theory_bytes"] > 0 for r in optimizer_offloads), optimizer_offloads
    else:
        # the fp32 shards come back as separate device tensors: memory grows, aliasing is lost
        assert value["round_trip_residual_bytes"] > 0 and value["aliasing_broken"] > 0, result.summary()
    assert not result.passed
