"""The frozen reference (or old-policy) worker: forward-only logprobs, no gradients, no optimizer.

Rank-side. RL computes old logprobs (for the PPO ratio) and reference logprobs (for the KL term)
with exactly the forward the parity suite checks against HF: `harness.logprobs.megatron`.
"""
from __future__ import annotations

import torch

from harness.data.rl_batch import RLBatch
from harness.logprobs.megatron import RankLogprobs, megatron_logprobs
from harness.parallel.state import DEFAULT_SEED
from harness.training.rng import RNGStreams


class ReferenceWorker:
    """This rank's share of a frozen Megatron model loaded through the bridge; `rng` holds its own
    RNG streams, as `PolicyWorker`'s (a frozen forward draws none, but building may)."""

    def __init__(self, path, *, dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                 seed: int = DEFAULT_SEED):
        from harness.bridge import load_megatron_model
        from harness.launch import context
        from harness.offload import OffloadManager

        self.rng = RNGStreams.seeded(seed)
        with self.rng.active():
            self.models = load_megatron_model(path, dtype=dtype, sequence_parallel=sequence_parallel)
        for model in self.models:
            model.eval()
            model.requires_grad_(False)  # frozen: a reference model must never receive updates
        self.offloader = OffloadManager(self, context().device)  # params only

    @torch.no_grad()
    def logprobs(self, batch: RLBatch, micro_batches: int = 1, temperature: float = 1.0) -> RankLogprobs:
        self.offloader.require("params", what="reference logprobs")
        return megatron_logprobs(self.models, batch, micro_batches=micro_batches, temperature=temperature)

    def offload(self, components) -> list[dict]:
        return self.offloader.offload(tuple(components))

    def reload(self, components) -> list[dict]:
        return self.offloader.reload(tuple(components))

    def offload_accounting(self) -> dict:
        return self.offloader.accounting()


def reference_logprobs(layout, path, batch: RLBatch, micro_batches: int = 1,
                       dtype: torch.dtype = torch.float32) -> RankLogprobs:
    """Rank function for `run_in_layout`; combine the ranks' results with
    `harness.logprobs.megatron.assemble`."""
    return ReferenceWorker(path, dtype=dtype, sequence_parallel=layout.sequence_parallel).logprobs(
        batch, micro_batches)
