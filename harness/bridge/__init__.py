"""HF <-> Megatron-Core weights via mbridge 0.15.1, with or without Transformer Engine.

Rank-side: everything here runs inside a rank process whose Megatron parallel state is
initialized (and, on CPU, after harness.backends.cpu_patches.install()).

    models = load_megatron_model("tiny-qwen3", dtype=torch.float32, cache_dir=...)
    info = bridge_info(models)              # info.vocab_size: slice logits to it
    state = export_hf_state_dict(models)    # HF names -> full tensors, on every rank

The mbridge fixes and why each is needed: harness.bridge.mbridge_compat. Sequence parallelism
works with the local (no-TE) spec through harness.bridge.norms.LocalRMSNorm.

Parent-side: `check_model_supported(name_or_dir_or_config)` (harness.bridge.preflight) refuses
every model feature the bridge would not convert faithfully, before any rank starts.
"""
from harness.bridge.export import export_hf_state_dict
from harness.bridge.load import (BridgeInfo, bridge_info, hf_bridge, hf_config, iter_hf_weights, load_megatron_model,
                                 unwrap_model)
from harness.bridge.mbridge_compat import HarnessBridgeMixin, make_bridge, resolve_spec
from harness.bridge.preflight import (
    SUPPORTED_MODEL_TYPES,
    UnsupportedModelError,
    check_hf_config,
    check_model_supported,
)
from harness.bridge.norms import LocalRMSNorm, local_block_spec, norm_slots, use_local_norms
from harness.bridge.versions import (
    UnsupportedVersionError,
    check_supported_versions,
    te_available,
)

__all__ = [
    "BridgeInfo", "HarnessBridgeMixin", "LocalRMSNorm", "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError", "UnsupportedVersionError", "bridge_info", "check_hf_config",
    "check_model_supported",
    "check_supported_versions", "export_hf_state_dict", "hf_bridge", "hf_config", "iter_hf_weights",
    "load_megatron_model", "unwrap_model",
    "local_block_spec", "make_bridge", "norm_slots", "resolve_spec", "te_available",
    "use_local_norms",
]
