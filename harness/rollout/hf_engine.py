"""The HF reference engine: plain transformers forward with a KV cache and a seeded sampler.

Runs in the driver process (CPU in CI, the first GPU on a CUDA machine). It is the engine whose
arithmetic the harness knows (eager HF, the parity suite's plain reference), so its logprobs
against the trainer's are bounded by measured tolerances (harness.rollout.tolerances).

Sampling draws on the CPU from float32 probabilities with its own `torch.Generator`: the same seed
gives the same tokens on any device as long as the probabilities agree.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Iterable, Sequence

import torch

from harness.rollout.engine import Rollouts, Sampling, bucket_plan, make_rollouts, prompt_rows, require_awake
from harness.rollout.routing import RoutingRecorder


class HFEngine:
    """`HFEngine(model, dtype=torch.float32, device="cpu")`: a zoo name or a local HF checkpoint."""

    def __init__(self, model: str | os.PathLike = "tiny-qwen3", *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> None:
        from harness.models import build_hf_model, resolve_model

        self.path = resolve_model(model)
        self.device = torch.device(device)
        self.model = build_hf_model(self.path, dtype=dtype).to(self.device)
        self.dtype = dtype
        self.asleep = False
        config = self.model.config
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.pad_id = int(config.pad_token_id if config.pad_token_id is not None else 0)
        self.vocab_size = int(config.vocab_size)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        # A MoE model holds its experts fused; weights travel under the checkpoint's per-expert names.
        self._slots = checkpoint_slots(self.model)

    # ------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling, *, routing: bool = False) -> Rollouts:
        """routing=True (a MoE model): the rollouts also carry the routers' top-k of every token fed,
        by global layer (`Rollouts.routing`, harness.rollout.routing), recorded as generated; the
        last sampled token is never fed (PAD), as in vLLM."""
        require_awake(self, "generate")
        prompt_ids, prompt_mask, index = prompt_rows(prompts, sampling.n, self.vocab_size, self.pad_id)
        generator = torch.Generator().manual_seed(sampling.seed)
        ids = prompt_ids.to(self.device)
        mask = prompt_mask.to(self.device)
        positions = (mask.long().cumsum(1) - 1).clamp(min=0)
        recorder = RoutingRecorder(self.model) if routing else nullcontext()
        with recorder:
            out = self.model(input_ids=ids, attention_mask=mask.long(), position_ids=positions, use_cache=True)
            tokens, logprobs = [], []
            for step in range(sampling.max_tokens):
                token, logprob = self._sample(out.logits[:, -1], sampling.temperature, generator)
                tokens.append(token)
                logprobs.append(logprob)
                if step + 1 == sampling.max_tokens:
                    break
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
                positions = positions[:, -1:] + 1
                out = self.model(input_ids=token.unsqueeze(1).to(self.device), attention_mask=mask.long(),
                                 position_ids=positions, past_key_values=out.past_key_values, use_cache=True)
        rollouts = make_rollouts(prompt_ids, prompt_mask, index, torch.stack(tokens, 1), torch.stack(logprobs, 1),
                                 self.pad_id)
        if routing:
            rollouts.routing = recorder.routes(len(index), rollouts.batch.attention_mask)
        return rollouts

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if temperature == 0:  # greedy: the argmax, its logprob under the plain distribution
            logprobs = torch.log_softmax(logits.float().cpu(), dim=-1)
            token = logprobs.argmax(-1)
            return token, logprobs.gather(1, token.unsqueeze(1)).squeeze(1)
        logprobs = torch.log_softmax(logits.float().cpu() / temperature, dim=-1)
        token = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)
        return token, logprobs.gather(1, token.unsqueeze(1)).squeeze(1)

    # ---------------------------------------------------------------------------- weights
    @torch.no_grad()
    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each (HF name, tensor) into the model; a fused gate_up_proj is split (gate rows
        first). Unknown names and shape mismatches raise before anything of the bucket is copied."""
        require_awake(self, "update_weights")
        if self._slots is None:
            plan = bucket_plan(bucket, {name: p.shape for name, p in self._params.items()})
            for name, tensor in plan:
                self._params[name].copy_(tensor)
            return len(plan)
        plan = bucket_plan(bucket, {name: index.shape for name, (_, index) in self._slots.items()})
        for name, tensor in plan:
            param, index = self._slots[name]
            param.view(-1)[index.to(param.device)] = tensor.to(param.device, param.dtype)
        return len(plan)

    @torch.no_grad()
    def set_lm_head_tied(self, tied: bool) -> None:
        """A tied model's lm_head: tied=False gives it a weight of its own, a copy of the embedding as it
        is now (the catalog's sync-tied-lm-head-stale, vLLM PR 51665's bug: a tied model's redundant
        checkpoint lm_head loaded as its own tensor, never re-tied); tied=True ties it back."""
        if not self.tied:
            raise ValueError(f"{self.path.name} does not tie its lm_head to its embedding")
        head, embed = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        head.weight = embed.weight if tied else torch.nn.Parameter(embed.weight.detach().clone(),
                                                                   requires_grad=False)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))

    @torch.no_grad()
    def weights(self) -> dict[str, torch.Tensor]:
        """Copies on the CPU, by checkpoint name (a tied model has no lm_head.weight)."""
        if self._slots is not None:
            state = {name: param.detach().view(-1)[index.to(param.device)].cpu()
                     for name, (param, index) in self._slots.items()}
        else:
            state = {name: p.detach().cpu().clone() for name, p in self.model.named_parameters()}
        if self.tied:
            state.pop("lm_head.weight", None)
        return state

    # ------------------------------------------------------------------------- colocation
    def sleep(self) -> None:
        """Move the weights to the host and give the device memory back (CPU: nothing to free)."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.asleep = True

    def wake(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)  # in place: the Parameter objects in _params stay the same
        self.asleep = False


def checkpoint_slots(model) -> dict[str, tuple[torch.nn.Parameter, torch.Tensor]] | None:
    """Where each checkpoint tensor lives in `model`'s parameters, for a model whose checkpoint names
    are not its parameters' (transformers 5 fuses a MoE layer's experts: `mlp.experts.gate_up_proj`
    [experts, 2 x width, hidden], stored per expert): name -> (parameter, the flat indices of its
    elements, shaped as the checkpoint tensor). None when the names are the parameters' (dense).
    Found by converting index tensors the way transformers converts weights, so it holds for any
    family's fusion without naming its layout here."""
    from transformers.core_model_loading import revert_weight_conversion

    params = dict(model.named_parameters())
    names = dict(revert_weight_conversion(model, {n: p.detach().to("meta") for n, p in params.items()}))
    if set(names) == set(params):
        return None
    # Tag every element with (parameter number, flat position), converted as the weights would be.
    tags = {n: torch.arange(p.numel(), dtype=torch.float64).view(p.shape) + i * (1 << 40)
            for i, (n, p) in enumerate(params.items())}
    order = list(params.values())
    slots = {}
    for name, tag in dict(revert_weight_conversion(model, tags)).items():
        which = (tag // (1 << 40)).long()
        if not torch.all(which == which.flatten()[0]):
            raise ValueError(f"{name}: a checkpoint tensor drawn from several parameters")
        slots[name] = (order[int(which.flatten()[0])], (tag - which * (1 << 40)).long().clone())
    # Router biases HF keeps as buffers (DeepSeek-V3's e_score_correction_bias): checkpoint tensors the
    # trainer exports and a sync must carry, whole.
    from harness.models.randomize import EXPERT_BIAS_BUFFERS

    for name, buffer in model.named_buffers():
        if name.endswith(EXPERT_BIAS_BUFFERS) and name not in slots:
            slots[name] = (buffer, torch.arange(buffer.numel()).view(buffer.shape))
    return slots
