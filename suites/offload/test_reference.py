"""The frozen reference worker offloads its params alone: exact bytes, logprobs bit for bit the
same after the reload, one host shadow per storage however many cycles."""
from __future__ import annotations

import pytest
import torch

from harness.offload import OffloadedError
from harness.offload.check import MODEL, reference_batch
from harness.pytest_plugin.worlds import skip_invalid_layout

CYCLES = 3


# 4 ranks on the CPU tier nightly: the batch's rows follow the layout (harness.offload.check.reference_batch),
# as on 4 GPUs.
@pytest.mark.layouts(cpu=["tp2", "pp2"] + [pytest.param(name, marks=pytest.mark.nightly)
                                           for name in ("dp4", "pp2vpp2dp2")], cuda="all")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reference_round_trip_is_exact_and_logprobs_unchanged(reference, device, layout, dtype, report):
    with skip_invalid_layout():  # pp4vpp2 (8 virtual stages) on a 4-layer model
        ref = reference(layout, MODEL, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    batch = reference_batch(ref.layout)
    before = ref.logprobs(batch)
    first = None
    for cycle in range(CYCLES):
        for rank, (off,) in enumerate(ref.offload()):
            report.add("freed_minus_theory_bytes", off["measured_bytes"] - off["theory_device_bytes"], tolerance=0,
                       passed=off["measured_bytes"] == off["theory_device_bytes"], claim="exact", layout=layout, dtype=dtype,
                       rank=rank, component="params", cycle=cycle, theory_bytes=off["theory_bytes"],
                       host_shadow_bytes=off["host_shadow_bytes"], pinned=off["pinned"], worker="reference")
            assert off["theory_bytes"] > 0 and off["measured_bytes"] == off["theory_device_bytes"] and off["held_bytes"] == 0
        with pytest.raises(OffloadedError, match="reference logprobs needs the params"):
            ref.logprobs(batch)
        for rank, (back,) in enumerate(ref.reload()):
            assert back["measured_bytes"] == back["theory_device_bytes"], (rank, back)
        accounts = [(a["params"]["shadow_ids"], a["params"]["shadow_allocations"], a["host_bytes"])
                    for a in ref.offload_accounting()]
        first = first or accounts
        assert accounts == first, "host shadows reallocated across cycles"
        assert all(allocs == len(ids) for ids, allocs, _ in accounts)
    assert torch.equal(ref.logprobs(batch), before)
