"""Each offload frees exactly what it offloaded and each reload restores it, on every rank, for
every component alone and all together; the aliasing and the contents survive; memory after the
round trip equals memory before (harness.offload.check). CPU: storage bytes, exact. CUDA:
`memory_allocated` deltas, exact up to the allocator's 512-byte blocks (theory is rounded per
storage). Every byte figure is a report row: component, layout, dtype, theory, measured, host
shadow bytes, pinned."""
from __future__ import annotations

import pytest

from harness.offload.check import MODEL, config_for, residual, round_trip
from harness.pytest_plugin.worlds import skip_invalid_layout

DTYPES = ("fp32", "bf16")


def _checked(result, report, **fields):
    report.extend(result.rows(**fields))
    assert result.passed, result.summary()
    moved = [r for r in result.byte_rows if r.extra["op"] == "offload" and r.extra["phase"].startswith("all")]
    assert moved and all(r.extra["theory_bytes"] > 0 for r in moved), "nothing was offloaded"


@pytest.mark.layouts(cpu=["dp2", "tp2", "pp2"], cuda="all")
@pytest.mark.parametrize("dtype", DTYPES)
def test_offload_frees_and_reload_restores_exactly(policy, device, layout, dtype, report):
    with skip_invalid_layout():  # pp4vpp2 (8 virtual stages) on a 4-layer model
        result = round_trip(policy, layout, dtype, device=device)
    _checked(result, report)


@pytest.mark.layouts(cpu=["pp2"], cuda=["pp2"])
def test_tied_embeddings_under_pipeline_parallelism(policy, device, layout, report):
    """A tied model under PP: the last stage's output layer is a copy of the embedding of its own."""
    _checked(round_trip(policy, layout, "bf16", device=device, model="tiny-qwen3-tied"), report,
             model="tiny-qwen3-tied")


@pytest.mark.layouts(cpu=["dp2"], cuda="all")
def test_a_full_offload_leaves_only_what_no_component_owns(policy, device, layout, report):
    """After offloading everything and clearing the caches no component owns (RoPE, Megatron's
    global buffer, cuBLAS workspaces), no component holds a byte; on CUDA every byte still
    allocated is a live tensor the census names (the residual, itemised, is a report row)."""
    from harness.checkpoint.resume_check import train_batch

    with skip_invalid_layout():  # pp4vpp2 (8 virtual stages) on a 4-layer model
        worker = policy(layout, MODEL, **config_for(layout))
    worker.step(train_batch(0))
    worker.offload()
    for rank, found in enumerate(worker.apply(residual)):
        assert found["held"] == {"params": 0, "grads": 0, "optimizer": 0}, f"rank {rank}: {found['held']}"
        if worker.world.spec == "te":  # TE's cuBLAS workspaces are freed too (32 MiB each on Hopper; verl #6952's class)
            report.add("te_workspaces_held", found["te_workspaces"], tolerance=0, passed=found["te_workspaces"] == 0,
                       claim="exact", layout=layout, rank=rank)
            assert found["te_workspaces"] == 0, f"rank {rank}: TE still holds {found['te_workspaces']} workspaces"
        if device == "cuda":
            unexplained = found["allocated_bytes"] - found["census_bytes"]
            report.add("residual_unexplained_bytes", unexplained, tolerance=0, passed=unexplained == 0, claim="exact",
                       layout=layout, rank=rank, allocated_bytes=found["allocated_bytes"],
                       census_bytes=found["census_bytes"], tensors=found["tensors"], largest=found["largest"])
            assert unexplained == 0, f"rank {rank}: {found}"
    worker.reload()
    worker.step(train_batch(1))  # and it trains on
