"""The tolerance table of the offload round trip (harness.offload.check): exact, with evidence.

Every metric is a byte count or a count of violations, and every bound is 0: an offload frees the
bytes the component holds by its shapes (CUDA: each storage rounded up to the caching allocator's
512-byte blocks), a reload restores them, a round trip leaves the device as it found it, the
aliasing and the contents intact, the host shadows allocated once. A bound above 0 would need a
measured origin; none has been needed (the evidence below: 0 on every row of the fixed path).
"""
from __future__ import annotations

from harness.evidence import CPU_OFFLOAD, H100_OFFLOAD, cite
from harness.tolerance import Tolerance, ToleranceTable

INVARIANTS = {
    "freed_minus_theory_bytes": "an offload frees exactly what the component holds by its shapes",
    "held_after_offload_bytes": "an offloaded component holds nothing on the device",
    "restored_minus_theory_bytes": "a reload restores exactly what the offload freed",
    "noop_changed_bytes": "offloading what is offloaded, or reloading what is resident, changes nothing",
    "round_trip_residual_bytes": "after offload and reload the device holds what it held before",
    "aliasing_broken": "params stay views of param_data, main_grad of grad_data, fp32 main shards of "
                       "param_data; host shadows are storages of their own",
    "content_mismatches": "params, main params, Adam moments and steps come back bit for bit; grads as zeros",
    "shadow_reallocations": "one host shadow per storage, allocated once and reused",
    "peak_host_over_shadow_bytes": "host memory never holds two shadows of one storage",
}
# The fixed path's figures of each committed run that has them (0 violations, 0 bytes off).
_EVIDENCE = {metric: {CPU_OFFLOAD: 0.0, H100_OFFLOAD: 0.0} for metric in INVARIANTS}

TABLE = ToleranceTable("offload", tuple(
    Tolerance(metric, dtype, 0.0, rationale=f"exact: {why}",
              evidence=cite((("metric", metric), ("dtype", dtype), ("extra.variant", None)),
                            _EVIDENCE[metric]))
    for dtype in ("fp32", "bf16") for metric, why in INVARIANTS.items()))


def offload_tolerance(metric: str, dtype: str):
    return TABLE.get(metric, dtype)
