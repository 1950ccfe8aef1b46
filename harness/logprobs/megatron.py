"""Megatron-side per-token logprobs: forward-only through the pipeline schedules.

Rank-side. Runs under any layout (TP/PP/VPP/CP/DP/SP) with several micro-batches, the way an RL
framework computes old/reference logprobs. How a micro-batch is fed (left padding removed, or
packed) is `harness.logprobs.micro_batches`; the schedule run is `harness.logprobs.schedule`,
shared with the policy's training step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.data.rl_batch import RLBatch
from harness.logprobs.context_parallel import length_multiple as cp_length_multiple, slot_multiple
from harness.logprobs.micro_batches import split_micro_batches
from harness.logprobs.schedule import run_schedule, token_logprobs, token_top1

# What context parallelism can feed: causal rows (right padding) or THD slots; never a mask.
CP_PACKINGS = ("right", "thd")

@dataclass
class RankLogprobs:
    """What one rank computed: only last-stage ranks hold values (None elsewhere)."""

    dp_rank: int
    tp_rank: int
    last_stage: bool
    logprobs: torch.Tensor | None  # [B/DP, S] float32, the project's logprob convention
    top1: torch.Tensor | None  # [B/DP, S] int64, prediction for token t (made at t-1); -1 undefined
    cp_rank: int = 0  # every CP rank holds the gathered values; CP rank 0's are reported


def _true_vocab(models: list[torch.nn.Module]) -> int:
    from harness.bridge import bridge_info, unwrap_model

    return bridge_info(models).vocab_size


def logprob_micro_batches(local: RLBatch, micro_batches: int, packing: str = "right", length_multiple: int = 1):
    """This data-parallel rank's rows `local` as the logprob pass feeds them in the current layout:
    sequence parallelism shards the sequence over TP ranks (lengths divide by TP), context parallelism
    splits every sequence (every thd slot) into 2 x cp chunks."""
    from megatron.core import parallel_state as ps

    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    multiple = math.lcm(tp, cp_length_multiple(cp, tp, True), length_multiple)
    return split_micro_batches(local, micro_batches, packing, multiple, slot_multiple=slot_multiple(cp))


def megatron_logprobs(
    models: list[torch.nn.Module],
    batch: RLBatch,
    *,
    micro_batches: int = 1,
    packing: str = "right",
    length_multiple: int = 1,
    temperature: float = 1.0,
    variant: str | None = None,
) -> RankLogprobs:
    """Logprobs of this rank's data-parallel share of `batch` (the global batch, same on all ranks).

    packing: "right" removes left padding (the default path); "packed" concatenates each
    micro-batch's sequences into one row with a block-diagonal causal mask (the remove-padding
    path of the local spec); "thd" packs the same way and gives TE's attention the boundaries
    (cu_seqlens, the TE spec's remove-padding path, as verl and NeMo-RL run it); "none" feeds the
    padded rows as they are (a negative control: left-padded rows then see pads and shifted positions).
    `length_multiple`: every micro-batch's length is padded on the right to a multiple of it (FP8
    GEMMs need rows in multiples of 16: harness.parity.fp8); right pads change no real token's logprob.
    `temperature`: the logits are divided by it first, as a rollout engine samples (the logprob of a
    sampled token under the distribution it was sampled from).
    `variant`: a context-parallel variant of the catalog (`harness.logprobs.schedule.token_logprobs`).
    Under context parallelism ("right" and "thd" packing only) every CP rank returns the whole
    sequences' logprobs.
    """
    from megatron.core import parallel_state as ps

    from harness.bridge import bridge_info, unwrap_model

    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    window = getattr(getattr(unwrap_model(list(models))[0], "config", None), "window_size", None)
    # gpt-oss (docs/moe.md): megatron-core's windowed attention drops the mask; Gemma 3's keeps it (KEEPS_MASK)
    if packing == "packed" and window and bridge_info(models).spec != "te" and not any(
            getattr(module, "KEEPS_MASK", False) for model in unwrap_model(list(models)) for module in model.modules()):
        raise ValueError(f"packing 'packed' with sliding-window attention (window_size {window}): megatron-core's "
                         "local softmax replaces the block-diagonal mask with its own causal window, so packed "
                         "sequences would attend to each other; feed 'right'")
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    local = batch.split(dp_size)[dp_rank]
    cp = ps.get_context_parallel_world_size()
    if cp > 1 and packing not in CP_PACKINGS:
        raise ValueError(f"packing {packing!r} under context parallelism: CP runs {CP_PACKINGS} (Transformer "
                         "Engine's attention splits causal or THD sequences, not an arbitrary mask)")
    micros = logprob_micro_batches(local, micro_batches, packing, length_multiple)
    true_vocab = _true_vocab(models)
    logprob_parts: dict[int, torch.Tensor] = {}
    top1_parts: dict[int, torch.Tensor] = {}

    def loss_for(index, micro, tokens):
        def collect(logits: torch.Tensor):
            if temperature != 1.0:
                logits = logits / temperature
            logprob_parts[index] = token_logprobs(logits, tokens, micro, true_vocab, variant)
            top1_parts[index] = token_top1(logits, micro, true_vocab)
            return torch.zeros((), device=logits.device), {}

        return collect

    run_schedule(models, micros, loss_for, forward_only=True)
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    result = RankLogprobs(dp_rank, ps.get_tensor_model_parallel_rank(), last, None, None,
                          cp_rank=ps.get_context_parallel_rank())
    if last:
        order = range(len(micros))
        valid = local.logprob_mask()
        lp = torch.cat([logprob_parts[i] for i in order])
        top = torch.cat([top1_parts[i] for i in order])
        result.logprobs = torch.where(valid, lp, torch.zeros_like(lp))
        result.top1 = torch.where(valid, top, torch.full_like(top, -1))
    return result


def assemble(results: list[RankLogprobs]) -> tuple[torch.Tensor, torch.Tensor]:
    """The global [B, S] logprobs and top-1 from every rank's results (parent-side)."""
    reporting = sorted((r for r in results if r.last_stage and r.tp_rank == 0 and r.cp_rank == 0),
                       key=lambda r: r.dp_rank)
    if not reporting or any(r.logprobs is None for r in reporting):
        raise RuntimeError("no last-stage tensor-parallel rank 0 reported logprobs")
    return torch.cat([r.logprobs for r in reporting]), torch.cat([r.top1 for r in reporting])
