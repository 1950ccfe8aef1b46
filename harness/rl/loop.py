"""A GRPO loop made of the harness's parts: rollouts from the engine, rewards of a tiny task,
group-normalized advantages, the trainer's old logprobs, a policy step, a weight sync.

    with RLLoop(world, "dp2", "tiny-qwen3", LoopConfig(iterations=6)) as loop:
        history = loop.run()          # one Iteration per step: reward, loss, grad norm, ...

Each iteration: (colocated: offload the policy, wake the engine) generate n completions per prompt
-> (colocated: engine sleeps, policy reloads) rewards -> advantages (reward minus the group mean,
over the group std) -> old logprobs from the trainer, and how far the engine's logprobs of the
tokens it sampled are from them (harness.rollout.mismatch: mean/max/p99 |d|, token_mult_prob_error,
NeMo-RL's health metric, the k3 KL(engine || trainer), the share of tokens off by more than a factor
of 2) -> one policy step -> sync the weights into the engine. Everything is seeded from
`LoopConfig.seed`: the same seed gives the same trajectory.

On CUDA the engine (HF or vLLM) shares the first GPU with rank 0 (`placement="separate"`: vLLM on
the next GPU after the trainer's, weights broadcast over NCCL); `colocate=True` gives the GPU to
one of them at a time: the policy is offloaded while the engine generates, the engine sleeps (vLLM's
sleep mode frees its weights and KV cache) while the policy computes logprobs and trains, and wakes
for the weight sync.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from harness.rl.task import make_task
from harness.rollout import DEFAULT_BUCKET_BYTES, Sampling, sync_weights
from harness.rollout.engines import ENGINES, open_engine


PLACEMENTS = ("colocated", "separate")


@dataclass(frozen=True)
class LoopConfig:
    iterations: int = 8
    task: str = "parity"
    mixed: bool = False  # the parity task's EVEN/ODD instructions (harness.rl.task)
    prompts_per_step: int = 4
    group_size: int = 4  # completions per prompt (GRPO's group)
    max_tokens: int = 4
    temperature: float = 1.0  # 1.0 only: the policy step computes its logprobs at temperature 1
    lr: float = 1e-2
    micro_batches: int = 2
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # > 0: a frozen reference model's logprobs enter the loss
    dtype: str = "fp32"
    colocate: bool = False  # offload the policy while the engine generates; the engine sleeps while it trains
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    seed: int = 0
    engine: str = "hf"  # or "vllm" (harness.rollout.engines; a head_dim >= 32 model on CPU)
    routing_replay: bool = False  # MoE (R3): the trainer replays the engine's routes (harness.training.routing_replay)
    # Where the engine runs on CUDA: "colocated" on the trainer's first GPU (vLLM: weights by CUDA IPC),
    # "separate" on the first GPU after the trainer's (vLLM only: weights broadcast over NCCL).
    placement: str = "colocated"

    def __post_init__(self) -> None:
        for name in ("iterations", "prompts_per_step", "group_size", "max_tokens", "micro_batches"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.group_size < 2:
            raise ValueError("group_size must be >= 2: a group of one has no advantage")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype must be fp32 or bf16, got {self.dtype!r}")
        if not self.lr > 0 or self.kl_coef < 0:
            raise ValueError("lr must be > 0 and kl_coef >= 0")
        if self.temperature != 1.0:
            raise ValueError(f"temperature must be 1.0, got {self.temperature!r}: the policy step computes its "
                             "logprobs at temperature 1, so old logprobs, the engine's and the step's would be "
                             "of different distributions")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.placement == "separate" and self.engine != "vllm":
            raise ValueError("placement 'separate' (the engine on a GPU of its own, weights broadcast) is the "
                             f"vLLM engine's: the {self.engine} engine shares the trainer's first GPU")
        if self.placement == "separate" and self.colocate:
            raise ValueError("colocate (offload and sleep turn by turn on one GPU) needs placement 'colocated'")


@dataclass
class Iteration:
    iteration: int
    reward_mean: float
    reward_std: float
    loss: float
    grad_norm: float
    # The engine's logprobs of the tokens it sampled vs the trainer's old logprobs of the same tokens
    # (harness.rollout.mismatch.mismatch_metrics, r = trainer - engine per token):
    token_mult_prob_error: float  # mean exp(|r|), 1 for a perfect match
    max_abs: float  # max |r|
    mean_abs: float  # mean |r|
    p99_abs: float  # the 99th percentile of |r|
    kl_k3: float  # mean exp(r) - 1 - r: the k3 estimate of KL(engine || trainer) from the engine's samples
    frac_over_ln2: float  # the share of tokens with |r| > ln 2 (a probability off by more than a factor of 2)
    mismatch_tokens: int  # the sampled tokens compared
    tokens: list[list[int]] = field(repr=False, default_factory=list)  # the sampled completions
    seconds: dict[str, float] = field(default_factory=dict)
    # With routing replay: the fraction of (real token, layer) top-k sets the trainer routed as the
    # engine did, the worse of its logprob pass and its step (1.0 when replay works).
    routing_agreement: float | None = None

    # The engine-vs-trainer figures, each a report row and a line of the mismatch plot (mrh loop).
    MISMATCH = ("token_mult_prob_error", "max_abs", "mean_abs", "p99_abs", "kl_k3", "frac_over_ln2")
    METRICS = ("reward_mean", "reward_std", "loss", "grad_norm", *MISMATCH)

    def metrics(self) -> dict[str, float]:
        return {m: getattr(self, m) for m in self.METRICS}


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (reward - its group's mean) / (its group's std + eps), per row."""
    out = torch.zeros_like(rewards)
    for g in groups.unique():
        rows = groups == g
        r = rewards[rows]
        out[rows] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return out


class RLLoop:
    """The loop's parts, resident in `world`: a policy, the engine in this process, a reference
    when kl_coef > 0. `progress(iteration)` after each iteration."""

    def __init__(self, world, layout, model: str = "tiny-qwen3", config: LoopConfig | None = None, *,
                 progress: Callable[[Iteration], None] | None = None) -> None:
        from harness.models import load_hf_config
        from harness.training.handles import PolicyHandle, ReferenceHandle

        self.config = config or LoopConfig()
        self.progress = progress
        self.policy = self.reference = None
        hf_config = load_hf_config(model)
        vocab = hf_config.vocab_size
        if self.config.routing_replay:
            require_experts(model, hf_config)
        self.task = make_task(self.config.task, vocab, prompts_per_step=self.config.prompts_per_step,
                              seed=self.config.seed, mixed=self.config.mixed)
        c = self.config
        self.policy = PolicyHandle(world, layout, model, seed=c.seed, lr=c.lr, micro_batches=c.micro_batches,
                                   dtype=c.dtype, loss_kwargs=dict(clip_eps=c.clip_eps, kl_coef=c.kl_coef),
                                   routing_replay=c.routing_replay)
        self.reference = None
        try:
            if c.kl_coef > 0:
                dtype = torch.float32 if c.dtype == "fp32" else torch.bfloat16
                self.reference = ReferenceHandle(world, layout, model, dtype=dtype, seed=c.seed)
            self.engine = open_engine(c.engine, model, dtype=torch.float32 if c.dtype == "fp32" else torch.bfloat16,
                                      device="cuda" if world.device == "cuda" else "cpu", routing=c.routing_replay,
                                      **engine_options(c, world.size if world.device == "cuda" else None))
            sync_weights(self.policy, self.engine, bucket_bytes=c.bucket_bytes)  # the engine starts as the policy
        except BaseException:
            self.close()
            raise
        self.history: list[Iteration] = []

    def run(self) -> list[Iteration]:
        for _ in range(self.config.iterations):
            self.history.append(self.step())
            if self.progress:
                self.progress(self.history[-1])
        return self.history

    def step(self) -> Iteration:
        from harness.rollout.mismatch import mismatch_metrics
        from harness.training.rl_data import RLTrainBatch

        c, it = self.config, len(self.history)
        seconds: dict[str, float] = {}
        prompts = self.task.prompts(it)
        t = time.perf_counter()
        if c.colocate:
            self.policy.offload()
            if self.engine.asleep:  # awake since the last sync; vLLM's wake_up is for a sleeping engine
                self.engine.wake()
        rollouts = self.engine.generate(prompts, Sampling(n=c.group_size, max_tokens=c.max_tokens,
                                                          temperature=c.temperature, seed=c.seed * 1_000_003 + it),
                                        **({"routing": True} if c.routing_replay else {}))
        if c.colocate:
            self.engine.sleep()
            self.policy.reload()
        seconds["generate"] = time.perf_counter() - t
        batch = rollouts.batch
        rewards = self.task.rewards(prompts, rollouts.prompt_index, rollouts.completions)
        mask = batch.response_mask & batch.logprob_mask()
        advantages = torch.where(mask, group_advantages(rewards, rollouts.prompt_index).unsqueeze(1), 0.0)
        t = time.perf_counter()
        old, taken = self._old_logprobs(rollouts)
        ref = self.reference.logprobs(batch) if self.reference is not None else old
        # On the host: the engine's logprobs and the trainer's may come from different devices.
        mismatch = mismatch_metrics(rollouts.logprobs.cpu(), old.cpu(), batch.response_mask.cpu())
        stats, routed = self._train(RLTrainBatch(batch, advantages.float(), old, ref), rollouts, taken)
        seconds["train"] = time.perf_counter() - t
        t = time.perf_counter()
        if c.colocate:
            self.engine.wake()
        sync_weights(self.policy, self.engine, bucket_bytes=c.bucket_bytes)
        seconds["sync"] = time.perf_counter() - t
        return Iteration(iteration=it, reward_mean=float(rewards.mean()), reward_std=float(rewards.std(unbiased=False)),
                         loss=float(stats["loss"]), grad_norm=float(stats["grad_norm"]),
                         **{m: float(mismatch[m]) for m in Iteration.MISMATCH},
                         mismatch_tokens=int(mismatch["tokens"]), tokens=rollouts.completions.tolist(),
                         seconds=seconds, routing_agreement=routed)

    # With routing replay (R3) the policy's routers replay the engine's routes in both passes.
    def _old_logprobs(self, rollouts):
        """The trainer's logprobs of the rollouts, and the routes its routers took (None: no replay)."""
        from harness.training.routing_replay import logprobs_with_routes

        if not self.config.routing_replay:
            return self.policy.logprobs(rollouts.batch), None
        return logprobs_with_routes(self.policy, rollouts.batch, rollouts.routing)[:2]

    def _train(self, train_batch, rollouts, taken):
        """The step's stats, and the worse routing agreement with the engine of the two passes."""
        from harness.rollout.routing import routing_agreement
        from harness.training.routing_replay import train_with_routes

        if not self.config.routing_replay:
            return self.policy.step(train_batch), None
        step = train_with_routes(self.policy, train_batch, rollouts.routing)
        real = rollouts.batch.attention_mask
        return step["stats"], min(routing_agreement(rollouts.routing, routes, real) for routes in (taken, step["routes"]))

    def close(self) -> None:
        for handle in (self.policy, self.reference):
            if handle is not None:
                handle.close()

    def __enter__(self) -> "RLLoop":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def engine_options(config: LoopConfig, trainer_gpus: int | None) -> dict[str, Any]:
    """What the placement asks of the engine: "separate" puts vLLM on the GPU after the trainer's
    `trainer_gpus` (None: not on CUDA) and broadcasts the weights to it (on CPU, over gloo)."""
    if config.placement != "separate":
        return {}
    if trainer_gpus is None:
        return {"transport": "broadcast"}
    available = torch.cuda.device_count()
    if available <= trainer_gpus:
        raise ValueError(f"placement 'separate' needs a GPU beyond the trainer's {trainer_gpus}: "
                         f"{available} visible")
    return {"transport": "broadcast", "gpu": trainer_gpus}


def require_experts(model, hf_config) -> None:
    """Routing replay is for MoE models this stack's bridge builds: one clear error, before any rank works,
    for a dense model, and for a MoE family the bridge refuses (the preflight's reason: gpt-oss on stack A,
    where mbridge 0.15.1 has no gpt-oss bridge; it replays on stack B)."""
    from harness.bridge.preflight import check_hf_config, num_experts

    if not num_experts(hf_config):
        raise ValueError(f"routing replay needs a Mixture-of-Experts model: {model} is dense (no routers to "
                         "record or replay; e.g. tiny-qwen3-moe)")
    try:
        check_hf_config(hf_config)
    except ValueError as exc:
        raise ValueError(f"routing replay of {model} cannot run here: {exc}") from None


def as_dicts(history: list[Iteration]) -> list[dict[str, Any]]:
    return [asdict(h) for h in history]
