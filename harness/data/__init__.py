"""RL batches for the parity checks: the batch type, seeded generators, and THD packing.

Pure tensor code, safe in the pytest parent process. Hypothesis strategies live in
`harness.data.strategies` (imported explicitly, so hypothesis stays a test-only import).
"""
from harness.data.packing import PackedBatch, pack, unpack
from harness.data.rl_batch import (
    STANDARD_SEQ_LEN,
    RLBatch,
    make_rl_batch,
    standard_parity_batch,
)

__all__ = [
    "STANDARD_SEQ_LEN", "PackedBatch", "RLBatch", "make_rl_batch", "pack", "standard_parity_batch",
    "unpack",
]
