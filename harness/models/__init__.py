"""HF causal LMs for the harness: the in-code zoo and local checkpoint dirs, behind one API.

Safe to import in the pytest parent process: nothing here touches torch.distributed or Megatron.
"""
from harness.models.checkpoints import (
    ModelNotFoundError,
    check_checkpoint_dir,
    default_cache_dir,
    is_complete,
    materialize,
    resolve_model,
    zoo_dir,
)
from harness.models.randomize import randomize_weights
from harness.models.zoo import (
    ATTN_IMPLEMENTATION,
    TINY_VOCAB_SIZE,
    ZOO,
    ZooModel,
    build_hf_model,
    is_zoo_name,
    list_models,
    load_hf_config,
)

__all__ = [
    "ATTN_IMPLEMENTATION", "TINY_VOCAB_SIZE", "ZOO", "ZooModel", "ModelNotFoundError",
    "build_hf_model", "check_checkpoint_dir", "default_cache_dir", "is_complete", "is_zoo_name",
    "list_models", "load_hf_config", "materialize", "randomize_weights", "resolve_model", "zoo_dir",
]
