"""Offload of a Mixture-of-Experts policy is accounted to the byte, the experts' buffers included.

At ep >= 2 megatron-core keeps the experts' params and grads in the DDP's `expert_parallel_buffers`,
beside its `buffers`, and their Adam state in a second optimizer. The round trip of
harness.offload.check at dp2ep2 (each component alone, then everything twice: freed and restored
bytes against theory on every rank, contents bit for bit, aliasing, host shadows allocated once)
must hold with them, and theory must count them: an offload that walks `buffers` only (verl PR 1766,
the catalog's `expert-buffers-left`) fails it by exactly the expert buffers' bytes. The variant and
its fixed path run in CI through suites/sensitivity (fp32); these run nightly, in both dtypes.
"""
from __future__ import annotations

import pytest

from harness.offload.check import round_trip

MODEL = "tiny-qwen3-moe"


def expert_buffer_bytes(worker) -> dict[str, int]:
    """Rank function: the bytes of this rank's dense and expert-parallel DDP buffers (params and
    grads), and of its expert optimizer's state, by shapes."""
    dense = expert = 0
    for model in worker.models:
        dense += sum(b.numel * (b.param_dtype.itemsize + b.grad_dtype.itemsize) for b in model.buffers)
        expert += sum(b.numel * (b.param_dtype.itemsize + b.grad_dtype.itemsize) for b in model.expert_parallel_buffers)
    return {"dense": dense, "expert": expert, "optimizers": len(getattr(worker.optimizer, "chained_optimizers", [1]))}


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["dp2ep2"], cuda=["dp2ep2"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_offload_accounts_for_the_expert_buffers(policy, device, layout, dtype, report):
    from harness.checkpoint.resume_check import train_batch
    from harness.offload.check import CONFIG

    handle = policy(layout, MODEL, **CONFIG, dtype=dtype)
    handle.step(train_batch(0))
    sizes = handle.apply(expert_buffer_bytes)
    assert all(s["expert"] > 0 and s["optimizers"] == 2 for s in sizes), sizes  # what there is to count
    result = round_trip(policy, layout, dtype, device=device, policy=handle, model=MODEL)
    report.extend(result.rows(model=MODEL))
    assert result.passed, result.summary()
    # Theory counts the expert buffers: each rank's params + grads offloaded in "all" equal dense + expert.
    for rank, s in enumerate(sizes):
        moved = sum(r.extra["theory_bytes"] for r in result.byte_rows if r.extra["rank"] == rank
                    and r.extra["op"] == "offload" and r.extra["phase"] == "all-cycle0"
                    and r.extra["component"] in ("params", "grads"))
        assert moved == s["dense"] + s["expert"], (rank, moved, s)

    missed = round_trip(policy, layout, dtype, device=device, variant="expert-buffers-left", model=MODEL)
    report.extend(missed.rows(model=MODEL))
    assert not missed.passed
    left = max(c.value for c in missed.checks if c.metric == "held_after_offload_bytes")
    expert_params = max(s["expert"] for s in sizes)  # params + grads; a component alone leaves its part
    assert 0 < left <= expert_params, (left, sizes)
