"""MoE cases that a lent GPU showed failing through a bug of a pinned upstream version, not of the
harness: marked strict xfail exactly there, so the test still runs and must fail, and fails the run
the day the bug is gone (an upgrade, or a workaround in harness.compat). Both were seen on 2x H200,
stack A, TE spec (reports/gpu/2026-11-26-h200x2-moe/); stack B and the local spec pass the same
tests. The mechanisms are read from the code of the versions named."""
from __future__ import annotations

import pytest

# megatron-core 0.16.1: get_main_grads_for_grad_norm drops a param as a tensor-parallel duplicate
# unless its rank in the *dense* TP group is 0 or it is marked tensor_model_parallel. TE's grouped
# experts (TEGroupedLinear, explicit expert communication) are not marked, so on TP rank 1 the
# experts' grads leave the grad norm; each TP rank then clips by its own norm and the replicated
# weights drift apart. 0.19.2 filters expert params over the expert-TP group.
GRAD_NORM_5916 = ("Megatron-LM #5916 on megatron-core 0.16.1 with TE's grouped experts: the grad norm leaves "
                  "out the experts of tensor-parallel ranks > 0 (4.45 vs 4.57 at tp2ep2etp1-sp) and the "
                  "replicas drift (1.04); fixed in 0.19.2")
# mbridge 0.15.1 gathers a weight over TP only when it is marked tensor_model_parallel; TE's grouped
# experts split over etp 2 are not, so its export yields one rank's half (16 of 32 rows).
EXPORT_TE_EXPERTS_ETP = ("mbridge 0.15.1 exports TE's grouped experts split over etp 2 as one rank's shard "
                         "(16 of 32 rows): they are not marked tensor_model_parallel; Megatron-Bridge 0.6.2 passes")


def expect_on_016_te(request: pytest.FixtureRequest, spec: str, tp: int, reason: str) -> None:
    """Strict xfail for a case on megatron-core 0.16 (stack A) with TE's spec and tensor parallelism."""
    from harness.bridge.versions import mcore_version

    if spec == "te" and tp > 1 and mcore_version().startswith("0.16."):
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
