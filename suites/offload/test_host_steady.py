"""Host memory is steady across offload cycles: one host shadow per storage, the same objects
every cycle, allocated once (verl PR 6193 re-pinned on every offload: 2x peak host memory), and
never the device storage itself (on the CPU tier `t.cpu()` is `t`)."""
from __future__ import annotations

import pytest

from harness.checkpoint.resume_check import train_batch
from harness.offload.check import CONFIG, MODEL, aliasing

CYCLES = 5


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_host_shadows_are_allocated_once_and_reused(policy, device, dtype, report):
    from suites.checkpoint.conftest import layout_for

    layout = layout_for(device)
    worker = policy(layout, MODEL, **CONFIG, dtype=dtype)
    worker.step(train_batch(0))
    seen = []
    for cycle in range(CYCLES):
        worker.offload()
        worker.reload()
        seen.append([{c: (a[c]["shadow_ids"], a[c]["shadow_allocations"]) for c in ("params", "optimizer")}
                     | {"host": a["host_bytes"], "peak": a["peak_host_bytes"]} for a in worker.offload_accounting()])
    for rank, first in enumerate(seen[0]):
        report.add("host_bytes_growth", seen[-1][rank]["host"] - first["host"], tolerance=0,
                   passed=seen[-1][rank] == first, claim="exact", layout=layout, dtype=dtype, rank=rank, cycles=CYCLES,
                   host_bytes=first["host"], peak_host_bytes=seen[-1][rank]["peak"])
        assert first["host"] > 0 and first["peak"] == first["host"]
        assert all(c[0] and c[1] == len(c[0]) for k, c in first.items() if k in ("params", "optimizer"))
    assert all(s == seen[0] for s in seen), "shadows changed across cycles"
    assert worker.apply(aliasing) == [[]] * len(seen[0])
    worker.step(train_batch(1))
