"""The weight-sync invariants as one check (suites/rollout, `mrh repro` of the weight-sync variants).

The engine first serves the check's prompts at the checkpoint's weights (a prefix cache now holds
their KV). After a training step, the trainer's offload/reload round trip and a sync:
  (b) the engine's logprobs of its own samples (at temperature 0.8; prompts it served before the sync
      among them) match the trainer's logprobs of the same tokens at the same temperature (max |d|,
      mean |d|, token_mult_prob_error; bounds per dtype in harness.rollout.tolerances);
then, after the engine's sleep/wake round trip (colocation; vLLM's sleep also drops its prefix cache,
so (b) comes first):
  (a) the engine's weights equal the policy's exported HF weights, every tensor bit for bit;
  (c) a second sync with no step in between changes no engine weight and no engine logprob.
The engine-side variants act here: sync-stale-prefix-cache (the engine keeps its prefix cache across
the update), sync-sleep-level2-no-reload (the sleep discards the weights), logprobs-before-temperature
(the trainer's logprobs without the temperature), sync-tied-lm-head-stale (the engine's tied lm_head
untied from the start: only (b) sees it, a tied engine reports its embedding once).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from harness.parallel import parse_layout
from harness.report import Row
from harness.rollout.engine import Sampling
from harness.rollout.tolerances import sync_tolerance
from harness.tolerance import CheckResult, Judged

MODEL = "tiny-qwen3"
BUCKET_BYTES = 16 << 10  # small: the tiny model streams in ~100 buckets, so a skipped one shows
CONFIG = dict(lr=1e-3, micro_batches=2)  # at least 2 micro-batches: the step accumulates gradients
STEP_PROMPTS, STEP_RESPONSES = (3, 6, 2, 5), (5, 4, 6, 3)  # token lengths of the step's rows, cycled
# A model whose KV heads a layout's TP does not divide gets its twin with 4 KV heads (TP4 on 4 GPUs);
# the report rows name the model that ran.
TP4_TWINS = {"tiny-qwen3": "tiny-qwen3-kv4", "tiny-qwen3-hd32": "tiny-qwen3-kv4-hd32"}
SAMPLING = Sampling(n=2, max_tokens=6, temperature=0.8, seed=11)
LONG_PROMPT = 40  # tokens: whole KV blocks (16 tokens on CUDA) a prefix cache can keep
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def prompts(vocab_size: int, count: int = 4, seed: int = 5) -> list[list[int]]:
    """`count` prompts of 3..8 random token ids (never 0, the pad id)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (count,), generator=g)
    return [torch.randint(1, vocab_size, (int(n),), generator=g).tolist() for n in lengths]


def check_prompts(vocab_size: int) -> list[list[int]]:
    """The sync check's prompts: four short ones and one of LONG_PROMPT tokens (whole KV blocks)."""
    g = torch.Generator().manual_seed(6)
    return prompts(vocab_size) + [torch.randint(1, vocab_size, (LONG_PROMPT,), generator=g).tolist()]


def model_for(model: str, layout: str) -> str:
    """`model`, or its TP4-valid twin where `layout`'s TP does not divide its KV heads."""
    from harness.models import load_hf_config

    tp = parse_layout(layout).tp
    if model in TP4_TWINS and load_hf_config(model).num_key_value_heads % tp:
        return TP4_TWINS[model]
    return model


def step_shape(layout) -> tuple[int, int]:
    """(micro-batches, rows) of the check's training step at `layout` (a resolved Layout): at least 2
    micro-batches and 4 rows, as many as the interleaved schedule (a multiple of pp) and every
    data-parallel rank (rows = a multiple of dp x micro-batches) need."""
    micro = layout.fitted_micro_batches(CONFIG["micro_batches"])
    return micro, layout.fitted_rows(len(STEP_PROMPTS), micro)


def padded_logprobs(policy, batch, temperature: float) -> torch.Tensor:
    """The trainer's logprobs of `batch`, its rows padded (with copies of the last) to what the layout
    splits: every data-parallel rank a multiple of the schedule's micro-batches."""
    from harness.data.rl_batch import RLBatch

    rows = batch.batch_size
    extra = -rows % (policy.layout.dp * policy.layout.micro_batch_multiple)
    if extra:
        def pad(t):
            return torch.cat([t, t[-1:].expand(extra, *t.shape[1:])])

        batch = RLBatch(pad(batch.input_ids), pad(batch.attention_mask), pad(batch.response_mask), batch.pad_id)
    return policy.logprobs(batch, temperature=temperature)[:rows]


def engine_device(device: str) -> str:
    """The driver's engine shares the first GPU with rank 0 (colocation), or runs on the CPU."""
    return "cuda" if device == "cuda" else "cpu"


@dataclass
class SyncResult(Judged):
    layout: str
    dtype: str
    device: str
    variant: str | None
    model: str
    engine: str = "hf"
    transport: str = ""
    checks: list[CheckResult] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    report: Any = None  # the SyncReport of the synced step

    def check(self, metric: str, value: float, detail: str = "") -> None:
        self.judge(metric, value, sync_tolerance(metric, self.dtype),
                   f"{metric}={value:g}" + (f" ({detail})" if detail else ""))

    def rows(self, **fields: Any) -> list[Row]:
        return self.check_rows(self.layout, self.model, **fields, variant=self.variant,
                               **({"engine": self.engine} if self.engine != "hf" else {}),
                               **({"transport": self.transport} if self.transport not in ("", "host") else {}),
                               **({"load_path": self.report.load_path}
                                  if self.report is not None and self.report.load_path else {}))

    def summary(self) -> str:
        what = f"{self.model} {self.layout} {self.dtype} {self.engine}" + (f" variant={self.variant}" if self.variant else "")
        return f"{what}: " + ("; ".join(self.failures) if self.failures else "engine equals the policy")


def sync_check(make_policy: Callable[..., Any], layout: str, dtype: str = "fp32", *, variant: str | None = None,
               device: str = "cpu", model: str | None = None, steps: int = 1, engine: str = "hf",
               engine_options: dict | None = None) -> SyncResult:
    """Run (a)-(c) on a fresh policy and an engine at the checkpoint's weights ("hf" or "vllm",
    harness.rollout.engines, with `engine_options`: e.g. transport="broadcast", gpu=1); closes the policy."""
    from harness.models import load_hf_config
    from harness.rollout.engines import open_engine
    from harness.rollout.sync import engine_weight_diffs, sync_weights
    from harness.training import make_rl_train_batch

    model = model_for(model or MODEL, str(layout))
    result = SyncResult(str(layout), dtype, device, variant, model, engine=engine)
    micro, _ = step_shape(parse_layout(str(layout)))
    policy = make_policy(layout, model, **{**CONFIG, "micro_batches": micro}, dtype=dtype)
    try:
        engine = open_engine(engine, model, dtype=DTYPES[dtype], device=engine_device(device), **(engine_options or {}))
        if variant == "sync-tied-lm-head-stale":
            engine.set_lm_head_tied(False)  # vLLM 51665's bug: the tied lm_head loaded as a tensor of its own
        vocab = load_hf_config(model).vocab_size
        engine.generate(check_prompts(vocab), SAMPLING)  # served at the old weights: a prefix cache keeps them
        _, rows = step_shape(policy.layout)
        for step in range(steps):
            policy.step(make_rl_train_batch(vocab, batch_size=rows, seed=step,
                                            prompt_lengths=[STEP_PROMPTS[i % 4] for i in range(rows)],
                                            response_lengths=[STEP_RESPONSES[i % 4] for i in range(rows)]))
        # colocation: the trainer gives the GPU up while the engine generates; what it syncs comes
        # back from the host (an offload that loses or reorders state shows in (a) and (b))
        policy.offload()
        policy.reload()
        if variant == "sync-stale-prefix-cache":
            engine.reset_cache_on_load = False  # NeMo-RL 4018's bug: the cache outlives the update
        try:
            result.report = sync_weights(policy, engine, bucket_bytes=BUCKET_BYTES, variant=variant)
            result.transport = result.report.transport
        finally:
            if variant == "sync-stale-prefix-cache":
                engine.reset_cache_on_load = True
        # before any sleep (vLLM's sleep resets its prefix cache): prompts served before the sync
        _logprob_agreement(result, policy, engine, vocab, variant)
        # colocation: the engine sleeps while the trainer works (TRL 5312's bug: level 2 drops the weights)
        if variant == "sync-sleep-level2-no-reload":
            engine.sleep(level=2)
        else:
            engine.sleep()
        engine.wake()
        diffs = engine_weight_diffs(engine.weights(), policy.hf_state_dict())
        bad = diffs["missing"] + diffs["extra"] + diffs["unequal"]
        result.check("unequal_tensors", len(bad), ", ".join(bad[:4]))
        result.check("engine_max_abs_diff", diffs["max_abs_diff"])
        _resync_changes_nothing(result, policy, engine, vocab, variant)
        if variant == "sync-tied-lm-head-stale":
            engine.set_lm_head_tied(True)  # a shared vLLM engine is reused (its reset ties it back too)
    finally:
        policy.close()
    return result


def _logprob_agreement(result: SyncResult, policy, engine, vocab: int, variant: str | None = None) -> None:
    from harness.parity.metrics import compare_logprobs

    rollouts = engine.generate(check_prompts(vocab), SAMPLING)
    # vime 64's bug: one side's logprobs before the temperature
    temperature = 1.0 if variant == "logprobs-before-temperature" else SAMPLING.logprob_temperature
    trainer = padded_logprobs(policy, rollouts.batch, temperature)
    metrics = compare_logprobs(trainer, rollouts.logprobs, rollouts.batch.response_mask)
    for metric in ("max_abs", "mean_abs", "token_mult_prob_error"):
        result.check(metric, metrics[metric])


def _resync_changes_nothing(result: SyncResult, policy, engine, vocab: int, variant: str | None) -> None:
    from harness.rollout.sync import engine_weight_diffs, sync_weights

    before = engine.weights()
    first = engine.generate(check_prompts(vocab), SAMPLING)
    sync_weights(policy, engine, bucket_bytes=BUCKET_BYTES, variant=variant)
    changed = engine_weight_diffs(engine.weights(), before)
    result.check("resync_changed_tensors", len(changed["unequal"]))
    again = engine.generate(check_prompts(vocab), SAMPLING)
    same = torch.equal(first.batch.input_ids, again.batch.input_ids) and torch.equal(first.logprobs, again.logprobs)
    result.check("resync_changed_rollouts", 0 if same else 1)
