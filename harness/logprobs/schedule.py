"""One way to run micro-batches through Megatron's pipeline schedules (rank-side).

`run_schedule` is the only caller of `get_forward_backward_func()` for the harness's models: the
forward-only logprob pass (`harness.logprobs.megatron`) and the policy's training step
(`harness.training.policy`) differ only in what each micro-batch's loss function does with the
last stage's logits. It works under any layout (TP/PP/VPP/CP/DP/SP), 1F1B and interleaved; under context parallelism
each CP rank is fed its chunks of every sequence (`harness.logprobs.context_parallel`).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from harness.logprobs.context_parallel import cp_group, gather_positions, labels_for
from harness.logprobs.micro_batches import MicroBatch, shift_to_tokens
from harness.logprobs.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_top1

# loss_for(index, micro, tokens on the device) -> the micro-batch's loss function, which the last
# pipeline stage calls with its logits: logits -> (loss, reported dict), as Megatron expects.
LossFor = Callable[[int, MicroBatch, torch.Tensor], Callable[[torch.Tensor], tuple[torch.Tensor, dict]]]


def run_schedule(models: list[torch.nn.Module], micros: list[MicroBatch], loss_for: LossFor, *,
                 forward_only: bool) -> None:
    """Feed `micros` (in order) through this rank's model chunks with Megatron's schedule for the
    current layout; backward too unless `forward_only` (gradients land in the DDP buffers)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from harness.launch import context

    device = context().device

    cp, cp_rank, _ = cp_group()

    def forward_step(data_iterator, model) -> tuple[Any, Callable]:
        index = next(data_iterator)
        micro = micros[index]
        tokens = micro.tokens.to(device)
        # Positions 0..s-1: Megatron's RoPE ignores position_ids (hence right padding or packing).
        positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
        fed, fed_positions = tokens, positions
        if cp > 1:  # this CP rank's two chunks of every sequence (harness.logprobs.context_parallel)
            mine = micro.cp_positions(cp, cp_rank).to(device)
            fed, fed_positions = tokens[:, mine], positions[:, mine]
        mask = None if micro.attention_mask is None else micro.attention_mask.to(device)
        if micro.cu_seqlens is not None:  # thd: the sequence boundaries go to TE's attention
            return model(fed, fed_positions, mask, packed_seq_params=_thd_params(micro, device)), \
                loss_for(index, micro, tokens)
        return model(fed, fed_positions, mask), loss_for(index, micro, tokens)

    chunks = list(models)
    order = list(range(len(micros)))
    # One iterator per virtual pipeline chunk: each chunk walks the micro-batches once.
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(order) for _ in chunks] if len(chunks) > 1 else iter(order),
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micros), seq_length=micros[0].tokens.shape[1],
        micro_batch_size=micros[0].tokens.shape[0], forward_only=forward_only,
    )


def _thd_params(micro: MicroBatch, device):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = micro.cu_seqlens.to(device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=micro.max_seqlen,
                           max_seqlen_kv=micro.max_seqlen)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, micro: MicroBatch,
                   true_vocab: int, variant: str | None = None) -> torch.Tensor:
    """float32 [b, s] logprobs of the micro-batch's tokens in its rows' layout (on the CPU,
    differentiable): vocab-parallel, never gathering the full logits. Under context parallelism
    `logits` are this CP rank's positions; the labels are rolled on the whole sequence first and the
    logprobs come back from every CP rank in sequence order (harness.logprobs.context_parallel).
    `variant`: a CP variant of the catalog (`cp-labels-rolled-after-split`, `cp-chunks-contiguous`)."""
    cp, cp_rank, _ = cp_group()
    if cp == 1:
        per_position = vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], true_vocab).float()
        return micro.unmap(shift_to_tokens(per_position.cpu(), 0.0))
    length = tokens.shape[1]
    mine = micro.cp_positions(cp, cp_rank).to(tokens.device)
    if variant == "cp-labels-rolled-after-split":  # verl PR 4250: rolled inside the rank's chunks
        labels = labels_for(tokens[:, mine], fill=0)
    else:
        labels = labels_for(tokens, fill=0)[:, mine]
    local = vocab_parallel_logprobs(logits, labels, true_vocab).float()
    full = gather_positions(local, length, micro.cu_seqlens, variant)
    return micro.unmap(shift_to_tokens(full[:, :-1].cpu(), 0.0))


@torch.no_grad()
def token_top1(logits: torch.Tensor, micro: MicroBatch, true_vocab: int) -> torch.Tensor:
    """[b, s] int64 top-1 prediction for each token (made at the position before; -1 at column 0)
    in the micro-batch's rows' layout, gathered over CP like `token_logprobs`."""
    cp, _, _ = cp_group()
    if cp == 1:
        top1 = vocab_parallel_top1(logits[:, :-1], true_vocab)
    else:
        top1 = gather_positions(vocab_parallel_top1(logits, true_vocab), micro.tokens.shape[1],
                                micro.cu_seqlens)[:, :-1]
    return micro.unmap(shift_to_tokens(top1.cpu(), -1))
