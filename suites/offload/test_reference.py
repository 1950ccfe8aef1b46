"""The frozen reference worker offloads its params alone: exact bytes, logprobs bit for bit the
same after the reload, one host shadow per storage however many cycles."""
from __future__ import annotations

import pytest
import torch

from harness.models import TINY_VOCAB_SIZE
from harness.training import make_rl_train_batch
from harness.offload import OffloadedError
from harness.offload.check import MODEL

CYCLES = 3


@pytest.mark.layouts(cpu=["tp2", "pp2"], cuda="all")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reference_round_trip_is_exact_and_logprobs_unchanged(reference, device, layout, dtype, report):
    ref = reference(layout, MODEL, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    batch = make_rl_train_batch(TINY_VOCAB_SIZE, batch_size=2, seed=3, prompt_lengths=[3, 6],
                                response_lengths=[9, 5]).batch
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
