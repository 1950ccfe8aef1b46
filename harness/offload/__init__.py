"""Offload and reload of a resident worker's state (params, grads, optimizer), with exact
accounting: harness.offload.manager. `mrh bench offload` times it (harness.bench.offload);
suites/offload checks it; the offload variants of the catalog are known bugs it can be made to
have (`OffloadManager(variant=...)`, `PolicyHandle(..., offload_variant=...)`)."""
from harness.offload.inventory import POLICY, REFERENCE
from harness.offload.manager import IMPLEMENTED, OffloadedError, OffloadManager, OffloadRefused

__all__ = ["IMPLEMENTED", "POLICY", "REFERENCE", "OffloadManager", "OffloadRefused", "OffloadedError"]
