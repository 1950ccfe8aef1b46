"""Build a Megatron GPTModel from an HF checkpoint on this rank (rank-side; parallel state set up)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from harness.bridge.mbridge_compat import SpecChoice, make_bridge
from harness.bridge.preflight import NOT_WEIGHTS
from harness.models.checkpoints import resolve_model


@dataclass(frozen=True)
class BridgeInfo:
    """What a caller needs to know about a bridged model beyond the modules themselves."""

    hf_path: Path
    model_type: str
    spec: str  # "te" or "local"
    norm_precision: str  # "hf" (normalize in fp32, round, then scale) or "fused" (round once)
    dtype: torch.dtype
    vocab_size: int  # the HF (true) vocab: slice logits to [..., :vocab_size]
    padded_vocab_size: int  # Megatron's embedding/output rows, summed over TP ranks
    tied: bool


def load_megatron_model(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    seed: int = 0,
    make_vocab_size_divisible_by: int = 128,
    spec: SpecChoice | None = None,
    sequence_parallel: bool = False,
    norm_precision: str = "auto",
    wrap_with_ddp: bool = False,
    ddp_config: Mapping[str, Any] | None = None,
    config_overrides: Mapping[str, Any] | None = None,
) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage) with the HF weights loaded.

    Call on every rank of the model-parallel group at once (loading scatters over TP, and checks
    over PP). TP/PP/VPP come from megatron.core.parallel_state. `name_or_path` is a zoo name
    (materialized under `cache_dir` with `seed`; better done once in the parent first) or a local
    HF checkpoint dir. bf16/fp16 chunks are wrapped in Float16Module as in Megatron training;
    `wrap_with_ddp` also wraps them in Megatron DDP (mbridge's `ddp_config` defaults apply).

    Logits have `padded_vocab_size / TP` columns per TP rank; see `bridge_info(models)`.
    Raises if any tensor of the checkpoint is left unused by the Megatron model.
    """
    path = resolve_model(name_or_path, cache_dir, seed)
    bridge = _make_bridge(path, dtype=dtype, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                          spec=spec, sequence_parallel=sequence_parallel,
                          norm_precision=norm_precision, config_overrides=_dispatcher_settings(config_overrides))
    models = bridge.get_model(
        weight_path=None, fp16=dtype is torch.float16, bf16=dtype is torch.bfloat16,
        wrap_with_ddp=wrap_with_ddp, ddp_config=dict(ddp_config) if ddp_config else None)
    chunks = unwrap_model(models)
    if bridge.hf_config.model_type == "deepseek_v3":  # HF's MLA latent norms ignore rms_norm_eps (the module says)
        from harness.bridge.mla_norms import match_hf_mla_norms

        match_hf_mla_norms(chunks, bridge.hf_config)
    _check_every_hf_tensor_is_used(bridge, chunks, path)
    bridge.load_weights(chunks, str(path))
    info = BridgeInfo(
        hf_path=path, model_type=bridge.hf_config.model_type, spec=bridge.harness_spec,
        norm_precision=bridge.harness_norm_precision,
        dtype=dtype, vocab_size=bridge.vocab_size, padded_vocab_size=bridge.padded_vocab_size,
        tied=bridge.harness_tied)
    for chunk in chunks:
        # Plain attributes on the innermost GPTModel: they survive any later DDP/Float16 wrapping.
        chunk.harness_bridge = bridge
        chunk.harness_info = info
    return models


DISPATCHERS = ("alltoall", "allgather")  # megatron-core's MoE token dispatchers that run without TE/DeepEP


def _dispatcher_settings(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """`overrides` with what a chosen MoE token dispatcher needs: both bridges set
    variable_seq_lengths (for pipeline p2p), which megatron-core refuses with the allgather
    dispatcher; without pipeline parallelism nothing needs it."""
    overrides = dict(overrides or {})
    dispatcher = overrides.get("moe_token_dispatcher_type")
    if dispatcher is not None and dispatcher not in DISPATCHERS:
        raise ValueError(f"MoE token dispatcher {dispatcher!r}: choose from {', '.join(DISPATCHERS)}")
    if dispatcher == "allgather":
        from megatron.core import parallel_state

        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise ValueError("the allgather MoE token dispatcher needs fixed sequence lengths, which the "
                             "harness's pipeline schedule does not give: use alltoall with pp > 1")
        overrides.setdefault("variable_seq_lengths", False)
    return overrides


def _make_bridge(path: Path, **kwargs: Any):
    """This process's bridge (harness.bridge.backends.current) for the checkpoint at `path`."""
    from harness.bridge import backends

    if backends.current() == "megatron-bridge":
        from harness.bridge.backends.megatron_bridge import MegatronBridgeHandle

        return MegatronBridgeHandle(path, **kwargs)
    return make_bridge(path, **kwargs)


def unwrap_model(models: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The innermost GPTModel of each chunk (DDP, FSDP and Float16Module wrappers removed):
    megatron-core's own helper, the same on every bridge."""
    from megatron.core.utils import unwrap_model as unwrap

    return unwrap(list(models))


def _innermost(models: list[torch.nn.Module]) -> torch.nn.Module:
    chunk = unwrap_model(models)[0]
    if not hasattr(chunk, "harness_bridge"):
        raise ValueError("these modules were not built by harness.bridge.load_megatron_model")
    return chunk


def bridge_info(models: list[torch.nn.Module]) -> BridgeInfo:
    """Vocab sizes, dtype, spec and source path of chunks from `load_megatron_model`."""
    return _innermost(models).harness_info


def hf_bridge(models: list[torch.nn.Module]):
    """The native bridge object that built `models` (bridge-specific tests only; everything else
    goes through `hf_config` and `iter_hf_weights`)."""
    return _innermost(models).harness_bridge


def hf_config(models: list[torch.nn.Module]):
    """The HF config of the checkpoint `models` were loaded from."""
    return _innermost(models).harness_bridge.hf_config


def iter_hf_weights(models: list[torch.nn.Module]):
    """(HF name, full tensor) for every weight of `models`, walked by every rank of the
    model-parallel group together (shards gathered over TP, stages broadcast over PP). A tensor is
    valid until the next item (a view into a gather buffer): copy what you keep. A tied model under
    PP yields its embedding once per copy (the first stage's, then the last stage's): callers check
    the copies are equal."""
    return iter(hf_bridge(models).export_weights(unwrap_model(models)))


def _check_every_hf_tensor_is_used(bridge, chunks: list[torch.nn.Module], path: Path) -> None:
    """A bridge walks Megatron's parameters, so an HF tensor without a Megatron counterpart (e.g. an
    o_proj bias) would be skipped without a word; refuse such a checkpoint instead. (The parent
    checks the same from the tensor names first: harness.bridge.preflight; this is the second guard,
    against the names the Megatron model really maps.)"""
    from harness.bridge.preflight import checkpoint_tensor_names, glm4_moe_mtp_layers

    # GLM-4.5-MoE's MTP layers: ignored explicitly, as the preflight ignores them (neither HF nor we compute them).
    mtp = tuple(f"model.layers.{layer}." for layer in glm4_moe_mtp_layers(bridge.hf_config))
    on_disk = {name for name in checkpoint_tensor_names(path) if not name.startswith(mtp)}
    if hasattr(bridge, "unused_hf_tensors"):
        unused = bridge.unused_hf_tensors(chunks, on_disk)
    else:
        unused = _unused_by_mbridge(bridge, chunks, on_disk)
    if unused:
        raise ValueError(f"{path}: checkpoint tensors with no Megatron counterpart (they would be "
                         f"dropped silently): {unused}")


def _unused_by_mbridge(bridge, chunks: list[torch.nn.Module], on_disk: set[str]) -> list[str]:
    import torch.distributed as dist
    used: set[str] = set()
    for chunk in chunks:
        for local, name in bridge._weight_name_mapping_mcore_local_to_global(chunk).items():
            if "_extra_state" not in local:
                used.update(bridge._weight_name_mapping_mcore_to_hf(name))
    # Every rank of the world: pipeline stages hold other layers, expert-parallel ranks other experts.
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, sorted(used))
    used = set().union(*per_rank)
    if bridge.harness_tied:
        used.add("lm_head.weight")  # some tied checkpoints store the duplicate anyway
    return sorted(n for n in on_disk - used if not n.endswith(NOT_WEIGHTS))
