"""Megatron-Bridge workarounds, each gated on the Megatron-Bridge versions it was verified on.

- `TE_IMPORT`: `import megatron.bridge` imports Transformer Engine unguarded
  (`megatron/bridge/peft/lora_layers.py`: `import transformer_engine.pytorch as te`, reached from
  `models/conversion/model_bridge.py` through `peft_bridge` and `canonical_lora`) and evaluates
  `te.ops.*` in method annotations at class creation, so the bridge cannot even be imported on a
  machine without TE (every CPU machine; 0.6.2, seen 2026-11-24). `import_bridge` imports it with
  that one module, and only it, seeing a stand-in for TE whose attributes are inert classes (so
  the annotations and `isinstance` checks of TE's fused LoRA, which the harness never builds,
  evaluate to nothing). Every other module still sees that TE is absent: megatron-core picks its
  non-TE paths exactly as without the bridge.

- `TP1_VOCAB_PAD`: `ColumnParallelMapping.hf_to_megatron` pads a vocab-padded embedding or output
  layer to Megatron's rows only on its TP > 1 path; at TP 1 it returns the checkpoint's rows as they
  are, and loading a padded model (what mbridge and Megatron-LM build: 128 x TP rows) fails with
  "Shape mismatch for megatron param embedding.word_embeddings.weight" (0.6.2, seen 2026-11-24).
  Wrapped: at TP 1 those two tensors are padded with zero rows as the TP > 1 path does.

- `GLM45_LOCAL_EXPERTS` (issue 37, found here): `GLM45Bridge.mapping_registry` maps GLM-4.5-MoE's routed
  experts by TEGroupedMLP's names only (`mlp.experts.linear_fc1.weight<e>`), where Qwen3-MoE's bridge also
  maps SequentialMLP's (`mlp.experts.local_experts.<e>.linear_fc1.weight`). On the local spec (SequentialMLP:
  the CPU tier) no conversion task reads the checkpoint's experts, Megatron-Bridge only warns, and the
  experts keep whatever they were built with (`perform_initialization` off: garbage); the harness's
  every-tensor-used guard refused the tiny model naming all 36 expert tensors. Wrapped: the two SequentialMLP
  mappings Qwen3-MoE's bridge has, for a checkpoint that stores its experts one by one (the harness's; a
  fused one is refused).

On another version `require` raises before anything changes (harness.compat.megatron_core says why
a gate and not a warning).
"""
from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version as _dist_version

from harness.compat import refuse_unverified
from harness.compat.megatron_core import Workaround

TE_IMPORT = Workaround(
    "bridge-unguarded-te-import", "megatron.bridge.peft.lora_layers imports transformer_engine.pytorch "
    "unguarded and evaluates te.ops.* at class creation: the bridge does not import without TE", ("0.6.2",))
TP1_VOCAB_PAD = Workaround(
    "bridge-tp1-vocab-pad", "ColumnParallelMapping.hf_to_megatron skips the vocab padding at TP 1",
    ("0.6.2",))
_GUARDED = "megatron.bridge.peft.lora_layers"
_PADDED_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


class UnverifiedMegatronBridgeError(RuntimeError):
    """A workaround was asked for on a Megatron-Bridge version it was not verified on."""


def version() -> str | None:
    try:
        return _dist_version("megatron-bridge")
    except PackageNotFoundError:
        return None


def require(workaround: Workaround) -> None:
    refuse_unverified(UnverifiedMegatronBridgeError, "Megatron-Bridge", version(), workaround.name,
                      workaround.verified_on, "import megatron.bridge without Transformer Engine")


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def import_bridge():
    """`megatron.bridge`, imported with `TE_IMPORT` worked around where TE is not installed, and
    with `TP1_VOCAB_PAD` applied."""
    if "megatron.bridge" not in sys.modules and not te_installed():
        require(TE_IMPORT)
        finder = _GuardFinder()
        sys.meta_path.insert(0, finder)
        try:
            import megatron.bridge  # noqa: F401
        finally:
            sys.meta_path.remove(finder)
    import megatron.bridge

    _pad_vocab_at_tp1()
    return megatron.bridge


def _pad_vocab_at_tp1() -> None:
    from megatron.bridge.models.conversion import param_mapping

    mapping = param_mapping.ColumnParallelMapping
    if getattr(mapping.hf_to_megatron, "harness_workaround", None) == TP1_VOCAB_PAD.name:
        return
    require(TP1_VOCAB_PAD)
    stock = mapping.hf_to_megatron

    def hf_to_megatron(self, hf_weights, megatron_module):
        converted = stock(self, hf_weights, megatron_module)
        if self.tp_size != 1 or self.megatron_param not in _PADDED_PARAMS or converted is None:
            return converted
        _, target = param_mapping.get_module_and_param_from_name(megatron_module, self.megatron_param)
        missing = target.shape[0] - converted.shape[0]
        return param_mapping._pad_right_dim0(converted, pad_size=missing) if missing > 0 else converted

    hf_to_megatron.harness_workaround = TP1_VOCAB_PAD.name
    mapping.hf_to_megatron = hf_to_megatron


GLM45_LOCAL_EXPERTS = Workaround(
    "bridge-glm45-local-experts", "GLM45Bridge maps the routed experts by TEGroupedMLP's names only: on the "
    "local spec (SequentialMLP) no conversion task loads them (a warning; the experts stay as built)", ("0.6.2",))


def add_glm45_local_expert_mappings() -> None:
    """`GLM45_LOCAL_EXPERTS`: SequentialMLP's expert mappings added to GLM45Bridge's registry."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping
    from megatron.bridge.models.glm.glm45_bridge import GLM45Bridge

    if getattr(GLM45Bridge.mapping_registry, "harness_workaround", None) == GLM45_LOCAL_EXPERTS.name:
        return
    require(GLM45_LOCAL_EXPERTS)
    stock = GLM45Bridge.mapping_registry

    def mapping_registry(self):
        registry = stock(self)
        if self._uses_fused_experts():
            raise NotImplementedError("GLM-4.5-MoE with fused expert tensors (mlp.experts.gate_up_proj) on the local "
                                      "spec: the harness maps checkpoints that store their experts one by one")
        return MegatronMappingRegistry(*registry.mappings, GatedMLPMapping(
            megatron_param="decoder.layers.*.mlp.experts.local_experts.*.linear_fc1.weight",
            gate="model.layers.*.mlp.experts.*.gate_proj.weight", up="model.layers.*.mlp.experts.*.up_proj.weight",
        ), AutoMapping(
            megatron_param="decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight",
            hf_param="model.layers.*.mlp.experts.*.down_proj.weight",
        ))

    mapping_registry.harness_workaround = GLM45_LOCAL_EXPERTS.name
    GLM45Bridge.mapping_registry = mapping_registry


class _InertMeta(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _InertMeta(name, (), {"__module__": "harness.compat.megatron_bridge.te_stand_in"})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"Transformer Engine is not installed: {cls.__name__} cannot be built "
                           "(harness.compat.megatron_bridge.TE_IMPORT)")


_TE_STAND_IN = _InertMeta("transformer_engine_pytorch", (), {"__module__": "harness.compat.megatron_bridge"})


def _guarded_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and (name == "transformer_engine" or name.startswith("transformer_engine.")):
        # `import transformer_engine.pytorch as te` binds `te` to the leaf: IMPORT_NAME with an empty
        # fromlist returns the top package and IMPORT_FROM walks to `.pytorch`; both are the stand-in.
        return _TE_STAND_IN
    return builtins.__import__(name, globals, locals, fromlist, level)


class _GuardedLoader(importlib.machinery.SourceFileLoader):
    """Executes the one guarded module with its own `__import__` (nothing else sees the stand-in)."""

    def exec_module(self, module) -> None:
        module.__builtins__ = {**vars(builtins), "__import__": _guarded_import}
        super().exec_module(module)


class _GuardFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _GUARDED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _GuardedLoader(spec.loader.name, spec.loader.path)
        return spec
