"""One way to run micro-batches through Megatron's pipeline schedules (rank-side).

`run_schedule` is the only caller of `get_forward_backward_func()` for the harness's models: the
forward-only logprob pass (`harness.logprobs.megatron`) and the policy's training step
(`harness.training.policy`) differ only in what each micro-batch's loss function does with the
last stage's logits. It works under any layout (TP/PP/VPP/DP/SP), 1F1B and interleaved.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from harness.logprobs.micro_batches import MicroBatch, shift_to_tokens
from harness.logprobs.vocab_parallel import vocab_parallel_logprobs

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

    def forward_step(data_iterator, model) -> tuple[Any, Callable]:
        index = next(data_iterator)
        micro = micros[index]
        tokens = micro.tokens.to(device)
        # Positions 0..s-1: Megatron's RoPE ignores position_ids (hence right padding or packing).
        positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
        mask = None if micro.attention_mask is None else micro.attention_mask.to(device)
        if micro.cu_seqlens is not None:  # thd: the sequence boundaries go to TE's attention
            return model(tokens, positions, mask, packed_seq_params=_thd_params(micro, device)), \
                loss_for(index, micro, tokens)
        return model(tokens, positions, mask), loss_for(index, micro, tokens)

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
                   true_vocab: int) -> torch.Tensor:
    """float32 [b, s] logprobs of the micro-batch's tokens in its rows' layout (on the CPU,
    differentiable): vocab-parallel, never gathering the full logits."""
    per_position = vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], true_vocab).float()
    return micro.unmap(shift_to_tokens(per_position.cpu(), 0.0))
