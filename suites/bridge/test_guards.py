"""The bridge's guards: each fires on the input it exists for, and not otherwise.

Parent-side guards are called directly; the rank-side ones (the second line behind the parent's
preflight) run on a 2-rank world with `run_in_layout` and no `model=`, so that the parent's
preflight does not refuse the input first.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from harness.bridge import versions
from harness.bridge.norms import resolve_norm_precision
from harness.bridge.specs import resolve as resolve_spec
from harness.bridge.preflight import UnsupportedModelError, check_hf_config
from harness.models import load_hf_config, resolve_model
from harness.parallel.state import run_in_layout
from suites.bridge.test_preflight import UNSUPPORTED, local_checkpoint

# ----------------------------------------------------------------------------- parent-side
_TINY = {k: v for k, v in load_hf_config("tiny-llama").to_dict().items()
         if k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size", "rope_parameters")}

CONFIG_CASES = {
    "model-type": (lambda: _gemma_config(), "model_type 'gemma'"),
    "hidden-act": (lambda: LlamaConfig(**_TINY, hidden_act="gelu_pytorch_tanh"), "hidden_act 'gelu_pytorch_tanh'"),
    "sliding-window": (lambda: Qwen2Config(**_TINY, use_sliding_window=True, sliding_window=8,
                                           max_window_layers=0), "sliding-window"),
    "sliding-layer-types": (lambda: Qwen3Config(**_TINY, sliding_window=8, layer_types=[
        "sliding_attention", "full_attention", "full_attention", "full_attention"]), "sliding-window"),
    "unknown-rope-type": (lambda: LlamaConfig(**{**_TINY, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 32}}, max_position_embeddings=128), "rope type 'longrope'"),
}


def _gemma_config():
    from transformers import GemmaConfig

    return GemmaConfig(**_TINY)


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_check_hf_config_refuses(case):
    make, message = CONFIG_CASES[case]
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        check_hf_config(make())


@pytest.mark.parametrize("config", [LlamaConfig(**_TINY), Qwen2Config(**_TINY), Qwen3Config(**_TINY),
                                    load_hf_config("tiny-llama3"), load_hf_config("qwen3-0.6b-shape")],
                         ids=["llama", "qwen2", "qwen3", "llama3-rope", "qwen3-0.6b"])
def test_check_hf_config_accepts_supported_configs(config):
    settings = check_hf_config(config)
    assert settings.theta == config.rope_parameters["rope_theta"]
    assert (settings.llama3 is not None) == (config.rope_parameters["rope_type"] == "llama3")


@pytest.mark.parametrize("mcore, refused", [("0.16.1", False), ("0.16.9", False), ("0.17.0", True),
                                            ("0.17.0rc0", True), ("0.17.0.dev0", True), ("0.19.2", True)])
def test_check_supported_versions(monkeypatch, mcore, refused):
    """megatron-core 0.17 removed what mbridge 0.15's get_model uses; its pre-releases and dev
    builds (as Megatron-LM's main branch reports itself) already lack it."""
    monkeypatch.setattr(versions, "mcore_version", lambda: mcore)
    if refused:
        with pytest.raises(versions.UnsupportedVersionError, match=f"megatron-core {mcore} with mbridge"):
            versions.check_supported_versions()
    else:
        versions.check_supported_versions()


def test_resolve_spec_never_guesses_from_what_is_installed(monkeypatch):
    assert resolve_spec("local") == "local"
    for bad in ("fast", "auto"):  # "auto" is a choice of the run (--mrh-spec), never of a model
        with pytest.raises(ValueError, match="spec must be"):
            resolve_spec(bad)
    monkeypatch.delenv("MRH_LAYER_SPEC", raising=False)
    assert resolve_spec(None) == "local"  # outside a world: the local spec, whatever is installed
    if versions.te_available():
        assert resolve_spec("te") == "te"
        return
    with pytest.raises(RuntimeError, match="spec='te' requested but `import transformer_engine` fails"):
        resolve_spec("te")


@pytest.mark.parametrize("precision, spec, expected", [
    ("auto", "local", "hf"), ("auto", "te", "fused"), ("hf", "local", "hf"), ("fused", "local", "fused"),
    ("fused", "te", "fused"),
    ("hf", "te", "needs the local spec"), ("exact", "local", "must be 'auto' or one of"),
    ("exact", "te", "must be 'auto' or one of"),
])
def test_resolve_norm_precision(precision, spec, expected):
    if expected in ("hf", "fused"):
        assert resolve_norm_precision(precision, spec) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            resolve_norm_precision(precision, spec)


# ----------------------------------------------------------------------------- rank-side
def _load_outcomes(layout, paths: dict[str, str]) -> dict[str, str | None]:
    """Load each checkpoint on this rank: None if it loads, else 'ExceptionType: message'."""
    from harness.bridge import load_megatron_model

    outcomes = {}
    for label, path in paths.items():
        try:
            load_megatron_model(path)
            outcomes[label] = None
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test inspects
            outcomes[label] = f"{type(exc).__name__}: {exc}"
    return outcomes


RANK_SIDE = {  # the parent's preflight refuses each of these too; here the rank's own guard must
    "extra-tensor": "ValueError: ",  # _check_every_hf_tensor_is_used
    "rope-yarn": "UnsupportedModelError: ",  # check_hf_config in make_bridge
    "hidden-act": "UnsupportedModelError: ",
    "sliding-window-qwen2": "UnsupportedModelError: ",
}


@pytest.mark.world_size(2)
def test_rank_side_guards_refuse_and_accept(world, device, tmp_path):
    """At pp2 (the unused-tensor check gathers names over the pipeline stages): the extra tensor is
    a layer-3 o_proj bias, owned by stage 1; the unmodified checkpoint loads."""
    paths = {"plain": str(resolve_model("tiny-llama")),
             "extra-tensor": str(local_checkpoint(tmp_path / "extra", "tiny-llama", add={
                 "model.layers.3.self_attn.o_proj.bias": torch.zeros(64)}))}
    for case in RANK_SIDE:
        if case != "extra-tensor":
            base, config, add, drop, _ = UNSUPPORTED[case]
            paths[case] = str(local_checkpoint(tmp_path / case, base, config, add, drop))
    for rank, outcomes in enumerate(run_in_layout(world, "pp2", _load_outcomes, paths)):
        assert outcomes["plain"] is None, f"rank {rank}: {outcomes['plain']}"
        for case, prefix in RANK_SIDE.items():
            message = UNSUPPORTED[case][-1] if case != "extra-tensor" else \
                "no Megatron counterpart (they would be dropped silently): ['model.layers.3.self_attn.o_proj.bias']"
            assert outcomes[case] is not None and outcomes[case].startswith(prefix) and message in outcomes[case], \
                f"rank {rank} {case}: {outcomes[case]}"


def _output_layer_sources(layout, paths: list[tuple[str, str]]) -> dict[str, dict[str, bool]]:
    """Load the models in order in this process; on the last stage, which HF tensor the output
    layer holds. Also the stock mbridge class table, which must stay as it was."""
    from mbridge.core.util import unwrap_model
    from mbridge.models.qwen2 import Qwen2Bridge

    from harness.bridge import bridge_info, load_megatron_model

    found: dict[str, dict[str, bool]] = {}
    for label, path in paths:
        models = load_megatron_model(path)
        chunk = unwrap_model(models)[-1]
        if chunk.post_process:
            hf = load_file(Path(path) / "model.safetensors")
            weight = chunk.output_layer.weight[:bridge_info(models).vocab_size].cpu()
            found[label] = {name: torch.equal(weight, hf[name]) for name in
                            ("model.embed_tokens.weight", "lm_head.weight") if name in hf}
    found["stock-table"] = {"untouched": Qwen2Bridge._DIRECT_MAPPING.get("output_layer.weight") == "lm_head.weight"}
    return found


@pytest.mark.world_size(2)
def test_tied_mapping_is_per_instance(world, device):
    if world.bridge != "mbridge":
        pytest.skip("mbridge's class tables (Megatron-Bridge maps ties per instance: no table to share)")
    """Stock Qwen2Bridge ties by writing into its class table, so an untied model built after a tied
    one would load its lm_head from embed_tokens. Tied, untied, tied again in one process, at pp2
    (the last stage keeps its own copy of a tied embedding): each gets its own output layer."""
    tied, untied = str(resolve_model("tiny-qwen3-tied")), str(resolve_model("tiny-qwen3"))
    paths = [("tied", tied), ("untied", untied), ("tied-again", tied)]
    last = run_in_layout(world, "pp2", _output_layer_sources, paths)[1]
    assert last["tied"] == last["tied-again"] == {"model.embed_tokens.weight": True}
    assert last["untied"] == {"model.embed_tokens.weight": False, "lm_head.weight": True}
    assert last["stock-table"] == {"untouched": True}


def _export_twice(layout, path: str) -> tuple[int, str | None]:
    """Export (must work), desynchronize the last stage's copy of the tied embedding, export again."""
    from harness.bridge import export_hf_state_dict, load_megatron_model
    from harness.parity.variants import apply_variant

    models = load_megatron_model(path)
    keys = len(export_hf_state_dict(models))
    apply_variant("unsynced-tied-embedding", models)
    try:
        export_hf_state_dict(models)
    except RuntimeError as exc:
        return keys, str(exc)
    return keys, None


@pytest.mark.world_size(2)
def test_export_refuses_differing_tied_copies(world, device):
    path = resolve_model("tiny-qwen3-tied")
    expected_keys = len(load_file(path / "model.safetensors"))
    for rank, (keys, error) in enumerate(run_in_layout(world, "pp2", _export_twice, str(path))):
        assert keys == expected_keys, f"rank {rank}: the synchronized export has {keys} tensors"
        assert error is not None and error.startswith(
            "model.embed_tokens.weight: the copies on different pipeline stages differ"), f"rank {rank}: {error}"
