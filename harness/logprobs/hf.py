"""The HF reference: per-token logprobs and top-1 predictions of an HF causal LM on an RLBatch.

Convention (see `harness.data.rl_batch`): ``logprobs[b, t] = log p(input_ids[b, t] | real tokens
of row b before t)``, 0.0 where `RLBatch.logprob_mask()` is False. The forward gets the batch's
attention_mask *and* position_ids, so a left-padded row sees positions 0, 1, ... exactly as if it
were unpadded; padding must not change a row's logprobs.
"""
from __future__ import annotations

import torch
from torch import nn

from harness.data.rl_batch import RLBatch


def shifted_token_outputs(logits: torch.Tensor, input_ids: torch.Tensor,
                          valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn next-token logits into per-token (logprob, top-1) aligned with input_ids.

    logits[b, t] is the prediction for column t+1 (a causal LM's output, already shifted by the
    caller's layout: padded rows, or a [1, T] packed row). valid[b, t] says column t has a real
    predecessor at t-1 (`RLBatch.logprob_mask()`). Returns float32 logprobs (0 where not valid)
    and int64 top-1 ids (-1 where not valid).

    log_softmax runs in float32 whatever the logits' dtype (bf16 logits are upcast first; float64 ones
    stay float64), one row at a time so at most one row of float32 logits exists at once.
    """
    batch, seq = input_ids.shape
    wide = torch.promote_types(logits.dtype, torch.float32)  # float64 logits (a float64 reference) stay float64
    logprobs = torch.zeros((batch, seq), dtype=wide, device=logits.device)
    top1 = torch.full((batch, seq), -1, dtype=torch.int64, device=logits.device)
    for row in range(batch):
        scores = logits[row, :-1].to(wide)
        targets = input_ids[row, 1:].to(logits.device)
        lse = torch.logsumexp(scores, dim=-1)
        logprobs[row, 1:] = scores.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        top1[row, 1:] = scores.argmax(dim=-1)
    valid = valid.to(logits.device)
    # torch.where, not a multiply: a NaN/inf at an undefined position must not survive as NaN.
    return (torch.where(valid, logprobs, torch.zeros_like(logprobs)),
            torch.where(valid, top1, torch.full_like(top1, -1)))


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def hf_token_outputs(model: nn.Module, batch: RLBatch, *,
                     micro_batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs float32 [B, S], top1 int64 [B, S]) from one forward per micro-batch.

    Results are on the batch's device. micro_batch_size bounds the logits held at once (default:
    the whole batch); it must divide the batch size so that micro-batches match `RLBatch.split`.
    """
    batch.validate(getattr(getattr(model, "config", None), "vocab_size", None))
    parts = 1 if micro_batch_size is None else _num_parts(batch.batch_size, micro_batch_size)
    device = _model_device(model)
    logprobs, top1 = [], []
    for part in batch.split(parts):
        part = part.to(device)
        logits = model(input_ids=part.input_ids, attention_mask=part.attention_mask.long(),
                       position_ids=part.position_ids(), use_cache=False).logits
        lp, ids = shifted_token_outputs(logits, part.input_ids, part.logprob_mask())
        del logits
        logprobs.append(lp.to(batch.input_ids.device))
        top1.append(ids.to(batch.input_ids.device))
    return torch.cat(logprobs), torch.cat(top1)


def hf_unpadded_token_outputs(model: nn.Module, batch: RLBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """As hf_token_outputs, one row at a time on its real tokens only (no attention mask), in the model's
    dtype. For the float64 reference: HF's float64 mask is -inf, so a padded position's fully masked query
    row is NaN, which the next layer's attention multiplies by its 0 probability into every row (tiny-qwen3
    in float64: 2112 NaN hidden values after layer 1, none in float32)."""
    batch.validate(getattr(getattr(model, "config", None), "vocab_size", None))
    device = _model_device(model)
    logprobs = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    top1 = torch.full(batch.input_ids.shape, -1, dtype=torch.int64)
    valid = batch.logprob_mask()
    for row in range(batch.batch_size):
        real = batch.attention_mask[row].nonzero().flatten()
        if len(real) == 0:
            continue
        first, last = int(real[0]), int(real[-1]) + 1
        if len(real) != last - first:
            raise ValueError(f"row {row}: its real tokens are not contiguous")
        ids = batch.input_ids[row:row + 1, first:last].to(device)
        logits = model(input_ids=ids, position_ids=torch.arange(last - first, device=device)[None],
                       use_cache=False).logits
        lp, ids_top = shifted_token_outputs(logits, ids, valid[row:row + 1, first:last])
        logprobs[row, first:last], top1[row, first:last] = lp[0].double().cpu(), ids_top[0].cpu()
    return logprobs.to(batch.input_ids.device), top1.to(batch.input_ids.device)


def _num_parts(batch_size: int, micro_batch_size: int) -> int:
    if micro_batch_size < 1 or batch_size % micro_batch_size:
        raise ValueError(f"micro_batch_size {micro_batch_size} must divide the batch size "
                         f"{batch_size}")
    return batch_size // micro_batch_size


def hf_logprobs(model: nn.Module, batch: RLBatch, *,
                micro_batch_size: int | None = None) -> torch.Tensor:
    """float32 [B, S] logprobs of the batch's tokens under the HF model (the parity reference)."""
    return hf_token_outputs(model, batch, micro_batch_size=micro_batch_size)[0]


def hf_top1(model: nn.Module, batch: RLBatch, *,
            micro_batch_size: int | None = None) -> torch.Tensor:
    """int64 [B, S]: the argmax prediction for column t (made at t-1); -1 where undefined."""
    return hf_token_outputs(model, batch, micro_batch_size=micro_batch_size)[1]
