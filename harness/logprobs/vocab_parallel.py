"""Per-token logprobs and top-1 from vocab-parallel logits, without gathering the full vocabulary.

Each tensor-parallel rank holds logits for a contiguous slice of the (padded) vocabulary. The
log-partition function needs only the max and the sum of exponentials across ranks, and the target
logit lives on exactly one rank, so a few [batch, seq] all-reduces replace a [batch, seq, vocab]
gather. Columns past the true vocabulary (Megatron pads it to a multiple of 128*TP) are masked out:
their zero logits would otherwise add exp(0) terms to every token's partition function.
"""
from __future__ import annotations

import torch

# Large but finite: -inf would turn 0 * -inf into NaN in the backward of a training loss.
_MASKED_LOGIT = -1.0e9


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()


def _tp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size()


def mask_vocab_padding(logits: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """float32 logits with this rank's padded vocabulary columns masked out."""
    _, rank = _tp()
    local = logits.shape[-1]
    columns = torch.arange(rank * local, (rank + 1) * local, device=logits.device)
    logits = logits.float()
    if columns[-1] < true_vocab:
        return logits
    return logits.masked_fill(columns >= true_vocab, _MASKED_LOGIT)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """log p(target) for vocab-parallel `logits` [..., V/TP] and `targets` [...] (differentiable).

    Megatron's own vocab-parallel cross entropy does the cross-rank reductions and the autograd. With
    megatron-core's batch-invariant kernels on, at tp 1: `log_softmax`, which they replace by a kernel of
    a fixed reduction order. The cross entropy's max and sum are plain torch reductions, whose CUDA order
    follows the row count (suspected of the one-ulp residue at 4 rows, 4x H100 run
    reports/gpu/2026-11-27-h100x4-vllm).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from harness.backends import batch_invariant

    masked = mask_vocab_padding(logits, true_vocab)
    if batch_invariant.active() and _tp_size() == 1:
        return torch.log_softmax(masked, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if masked.data_ptr() == logits.data_ptr():
        # Megatron's forward subtracts the max from its input in place: never hand it the caller's
        # logits (a later top-1 over them would compare shifted values across TP ranks).
        masked = masked.clone()
    return -vocab_parallel_cross_entropy(masked.contiguous(), targets.contiguous())


@torch.no_grad()
def vocab_parallel_top1(logits: torch.Tensor, true_vocab: int) -> torch.Tensor:
    """The argmax token id over the whole vocabulary for vocab-parallel `logits` [..., V/TP]."""
    import torch.distributed as dist

    group, rank = _tp()
    masked = mask_vocab_padding(logits, true_vocab)
    local_max, local_arg = masked.max(dim=-1)
    global_arg = local_arg + rank * masked.shape[-1]
    size = dist.get_world_size(group)
    maxes = [torch.empty_like(local_max) for _ in range(size)]
    args = [torch.empty_like(global_arg) for _ in range(size)]
    dist.all_gather(maxes, local_max.contiguous(), group=group)
    dist.all_gather(args, global_arg.contiguous(), group=group)
    # Ties go to the lowest vocabulary index, as torch.argmax over the full row would.
    winner = torch.stack(maxes).argmax(dim=0, keepdim=True)
    return torch.stack(args).gather(0, winner).squeeze(0)
