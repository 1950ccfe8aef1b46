"""Host memory of a same-layout resume, per phase, for a Moonlight-like MoE and a dense model of its width.

Why: moonlight-shape's fp32 resume at tp1 (2.5 B parameters, a ~29 GB checkpoint) died twice on one GPU while
qwen3-8b-shape's (2 B parameters, 24 GB) passed: session 49's was killed for host memory beside two other jobs
(exit -9), session 54's lost its rank during the load (the world restarted; its own error hidden then, now
reported by harness.checkpoint.resume_check). Megatron's `fully_reshardable` optimizer format gathers the whole
parameter state (fp32 main weights, exp_avg, exp_avg_sq: 12 bytes a parameter) into host tensors at save and
allocates them empty at load (`DistributedOptimizer.get_parameter_state_dp_zero`), on the GPU tier too. This
probe measures, on the CPU tier, how many host bytes each phase adds per parameter, in the rank and in the
driver, so a GPU run's host need can be projected from its parameter count, and shows whether the experts
change it.

Not collected by `pytest suites` (CI) or the nightly run: ~14 GB of host memory and ~3 min on 2 cores.
Run by hand, with its report kept (reports/cpu/2026-12-07-resume-memory/):

    .venv/bin/pytest ci/probes/test_resume_memory.py --mrh-timeout 1200 --mrh-report-dir DIR -s

On the CPU tier the model's own state lives in the rank's host memory: each phase's figure is its peak above
the rank's resident size when the phase began (what the phase adds), not the total. On CUDA the weights load
into GPU tensors through host staging buffers, which this tier does not have: the load's figure here is a
lower bound of the GPU tier's.
"""
from __future__ import annotations

import threading

import pytest

from harness.checkpoint.resume_check import CONFIG, K_STEPS, state_digests, train_batch

from suites.models.test_shapes import SHAPE_LR

# Moonlight-16B-A3B's widths (harness.models.zoo._MOONLIGHT_SHAPE) cut to one dense and one MoE layer of 16
# experts and a 32k vocabulary (~0.39 B parameters); the dense model: a Qwen3 of the same hidden and MLP widths.
MOE = dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
           kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=11264,
           moe_intermediate_size=1408, n_routed_experts=16, num_experts_per_tok=6, n_group=1, topk_group=1,
           n_shared_experts=2, routed_scaling_factor=2.446, norm_topk_prob=True, first_k_dense_replace=1,
           vocab_size=32768, max_position_embeddings=4096, rms_norm_eps=1e-5,
           rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, rope_interleave=True,
           hidden_act="silu", attention_bias=False, tie_word_embeddings=False, num_nextn_predict_layers=0)
DENSE = dict(hidden_size=2048, num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
             intermediate_size=11264, vocab_size=32768, max_position_embeddings=4096, tie_word_embeddings=False)
MODELS = {"moonlight-like-moe": ("DeepseekV3Config", MOE), "dense-qwen3": ("Qwen3Config", DENSE)}


@pytest.fixture(scope="module", params=list(MODELS))
def probe_model(request, tmp_path_factory):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from harness.models.randomize import randomize_weights

    config_class, kwargs = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs), dtype=torch.float32)
    randomize_weights(model, 0)
    model.save_pretrained(path)
    return request.param, str(path), sum(p.numel() for p in model.parameters())


class Sampler:
    """Every 0.1 s: the resident bytes of the driver and of each rank; `phase(name)` starts a phase, whose
    peak above its start is kept per process (`peaks`), and its start too (`starts`: what earlier phases left)."""

    def __init__(self, pids: list[int]) -> None:
        import os

        import psutil

        self.procs = {"driver": psutil.Process(os.getpid()),
                      **{f"rank{i}": psutil.Process(pid) for i, pid in enumerate(pids)}}
        self.peaks: dict[str, dict[str, int]] = {}
        self.starts: dict[str, dict[str, int]] = {}
        self.name: str | None = None
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _rss(self) -> dict[str, int]:
        return {who: proc.memory_info().rss for who, proc in self.procs.items()}

    def phase(self, name: str) -> None:
        with self.lock:
            self.name = name
            now = self._rss()
            self.peaks[name] = {who: 0 for who in now}
            self.start = self.starts[name] = now

    def _run(self) -> None:
        while not self.done.wait(0.1):
            with self.lock:
                if self.name is None:
                    continue
                for who, rss in self._rss().items():
                    self.peaks[self.name][who] = max(self.peaks[self.name][who], rss - self.start[who])

    def stop(self) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
        self.done.set()
        self.thread.join()
        return self.peaks, self.starts


# What the driver holds of the target's state through the load: digests (resume_and_compare since 2026-12-08)
# or the copy it held before.
@pytest.mark.parametrize("hold", ["digests", "copy"])
@pytest.mark.layouts(cpu=["tp1"])
def test_host_bytes_a_resume_adds_per_parameter(policy, device, layout, probe_model, hold, tmp_path, report):
    name, path, params = probe_model
    config = {**CONFIG, "lr": SHAPE_LR}
    source = policy(layout, path, **config)
    sampler = Sampler(source.world.pids)
    try:
        source.steps([train_batch(i) for i in range(K_STEPS)])
        sampler.phase("save")
        source.save(tmp_path / "ckpt")
        sampler.phase("next_step")
        want = source.step(train_batch(K_STEPS))
        sampler.phase("export")
        next_state = source.hf_state_dict()
        source.close()
        sampler.phase("build_target")
        target = policy(layout, path, **config)
        before = target.hf_state_dict()
        if hold == "digests":
            before = state_digests(before)
        sampler.phase("load")
        target.load(tmp_path / "ckpt")
        sampler.phase("resumed_step")
        got = target.step(train_batch(K_STEPS))
        sampler.phase("end")
    finally:
        peaks, starts = sampler.stop()
    disk = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
    print(f"\n{name}, the driver holding {hold}: {params / 1e9:.3f} B parameters, "
          f"checkpoint {disk / 2**30:.2f} GiB ({disk / params:.2f} B/param)")
    for phase, who in peaks.items():
        if phase == "end":
            continue
        for proc, extra in who.items():
            per_param, resident = extra / params, starts[phase][proc]
            print(f"  {phase:13s} {proc:7s} +{extra / 2**30:6.2f} GiB  {per_param:5.2f} B/param"
                  f"  (resident at its start {resident / 2**30:6.2f} GiB, {resident / params:5.2f} B/param)")
            report.add(f"host_bytes_per_param_{phase}_{proc}", per_param, tolerance=None, passed=True,
                       claim="observed", layout=layout, model=name, parameters=params, hold=hold)
            report.add(f"resident_bytes_per_param_at_{phase}_{proc}", resident / params, tolerance=None,
                       passed=True, claim="observed", layout=layout, model=name, parameters=params, hold=hold)
    report.add("checkpoint_bytes_per_param", disk / params, tolerance=None, passed=True, claim="observed",
               layout=layout, model=name, parameters=params)
    # The measurement is of a resume that worked: the same layout's next step, bit for bit.
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"], (got, want)
    state = target.hf_state_dict()
    assert all((state[n] == t).all() for n, t in next_state.items())
    before = before if hold == "digests" else state_digests(before)
    assert before.keys() == next_state.keys() and before != state_digests(state)  # the load changed the weights
