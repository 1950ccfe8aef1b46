"""A tiny Megatron GPTModel with layout-independent weights: the harness's self-test workload.

Weights are generated per *global* parameter name and full (unsharded) shape, then sliced to this
rank's tensor-parallel shard, so TP=1, TP=2, PP=2 and DP=2 hold the same model and must produce the
same loss and gradient norm. Used by the harness's own tests and by `mrh bench world`.
(The HF-bridged model zoo is `harness.models`; this probe needs neither HF nor mbridge.)
"""
from __future__ import annotations

import contextlib
import os
import re
import zlib
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from harness.parallel.layout import Layout


@dataclass(frozen=True)
class ProbeSpec:
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    vocab_size: int = 128
    seq_length: int = 16
    global_batch: int = 4
    seed: int = 0


def build_model(spec: ProbeSpec, device: torch.device) -> torch.nn.Module:
    """This rank's pipeline stage of the probe GPT (local spec, no dropout, fp32)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        sequence_parallel=False, pipeline_dtype=torch.float32,
        # The local spec's attention, said as such (the probe never runs TE attention)
        attention_backend=AttnBackend.local,
    )
    with _own_attention_env():
        model = GPTModel(
            config, get_gpt_layer_local_spec(), vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length, pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
        ).to(device)
    _fill_weights(model, spec.seed)
    return model


@contextlib.contextmanager
def _own_attention_env():
    """Build the probe as if no model had been built in this rank before. megatron-core sets
    NVTE_FLASH/FUSED/UNFUSED_ATTN process-wide from the first model's attention backend (1 for
    "auto", mbridge's; 0 for "local", Megatron-Bridge's) and asserts every later model agrees: the probe
    then failed after an mbridge model with "local" (nightly, megatron-core 0.16.1) and after a
    Megatron-Bridge model with "auto" (0.19.2). The variables are put back after the build: the rank's
    other models (TE's attention reads them) keep what they were built with."""
    from harness.launch.facts import TE_ATTENTION_ENV

    names = TE_ATTENTION_ENV[:3]
    saved = {name: os.environ.pop(name, None) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _global_name(model: torch.nn.Module, name: str) -> str:
    """Rename `decoder.layers.<local>` to the layer's global index (PP stages count from 0)."""
    offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
    return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + offset}.", name)


def _fill_weights(model: torch.nn.Module, seed: int) -> None:
    from megatron.core import parallel_state as ps

    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for name, param in model.named_parameters():
        full_shape = list(param.shape)
        split = getattr(param, "tensor_model_parallel", False)
        if split:
            full_shape[param.partition_dim] *= tp_size
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(_global_name(model, name).encode()))
        full = torch.randn(full_shape, generator=generator) * 0.05
        if name.endswith("layer_norm_weight") or name.endswith("layernorm.weight"):
            full = 1.0 + full  # norms near 1 keep activations sane
        if split:
            full = full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
        with torch.no_grad():
            param.copy_(full.to(param.device))


def make_batch(spec: ProbeSpec) -> torch.Tensor:
    """The global batch of token ids, identical on every rank and layout."""
    generator = torch.Generator().manual_seed(spec.seed + 7)
    return torch.randint(0, spec.vocab_size, (spec.global_batch, spec.seq_length + 1), generator=generator)


def forward_backward(layout: Layout, spec: ProbeSpec = ProbeSpec(), micro_batches: int | None = None) -> dict[str, Any]:
    """One forward+backward of the probe under the active `layout`; the same dict on every rank.

    Returns the mean token loss over the global batch and the global gradient norm (over all
    TP/PP shards, TP-replicated parameters counted once, DP gradients averaged).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from harness.launch import context

    device = context().device
    model = build_model(spec, device)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    tokens = make_batch(spec).chunk(dp_size)[dp_rank].to(device)
    micro_batches = micro_batches or (2 * layout.pp if layout.pp > 1 else 1)
    micro = list(tokens.chunk(micro_batches))

    collected: list[float] = []  # our own record: schedules differ in how they scale theirs

    def loss_func(token_count: int, output: torch.Tensor):
        loss = output.float().sum() / token_count
        collected.append(loss.item())
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        ids, labels = batch[:, :-1], batch[:, 1:]
        positions = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
        output = model(ids, positions, None, labels=labels)
        return output, partial(loss_func, labels.numel())

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=model,
        num_microbatches=len(micro), seq_length=spec.seq_length, micro_batch_size=micro[0].shape[0],
        forward_only=False,
    )
    loss = torch.tensor(sum(collected) / max(len(collected), 1), device=device)
    if not ps.is_pipeline_last_stage():
        loss.zero_()
    dist.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    loss /= dp_size

    sq = torch.zeros((), device=device)
    for param in model.parameters():
        grad = param.grad if param.grad is not None else getattr(param, "main_grad", None)
        if grad is None:
            continue
        dist.all_reduce(grad, group=ps.get_data_parallel_group())
        grad /= dp_size
        if param_is_not_tensor_parallel_duplicate(param):
            sq += grad.float().pow(2).sum()
    dist.all_reduce(sq, group=ps.get_model_parallel_group())
    return {"layout": layout.name, "loss": loss.item(), "grad_norm": sq.sqrt().item(),
            "spec": asdict(spec)}
