"""Rank-side Megatron policy worker: DDP + DistributedOptimizer training steps on RL batches.

A step is correct when it equals `GroundTruthTrainer.step` on the same global batch: same loss,
same pre-clip grad norm, same lr, same updated weights. Import this module on rank processes only
(it imports Megatron lazily, but its functions need parallel state).

Gradient scaling (megatron-core 0.16.1, checked in the source):

- `forward_step_calc_loss` (pipeline_parallel/schedules.py): a loss_func returning 2 values
  (loss, reduced) gets ``loss *= cp_size; loss /= num_microbatches`` before backward. (With 3
  values and ``config.calculate_per_token_loss`` the division is skipped and grads are later
  divided by the total token count, which is not what our globally normalised loss wants.)
- DDP (distributed/distributed_data_parallel.py): without calculate_per_token_loss and with
  ``average_in_collective=False`` (default) every grad is pre-scaled by ``1 / dp_size`` and then
  summed by the reduce-scatter/all-reduce, i.e. averaged over data parallel ranks.
- `config.grad_scale_func` = `optimizer.scale_loss`: a constant 1 in fp32 (no loss scaler).

Our per-micro-batch loss is ``sum over its tokens / GLOBAL count`` (`rl_loss` with the counts of
the whole global batch), so the gradient of the global loss is the plain SUM over micro-batches
and DP ranks. The loss handed to Megatron is therefore multiplied by
``num_microbatches * dp_size`` (Megatron's ``*= cp_size`` and DDP's ``1 / (dp_size * cp_size)``
cancel the context-parallel factor): Megatron's divisions cancel exactly,
and the reported loss uses the unscaled value.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from harness.checkpoint.sharded import OPTIMIZER_FORMATS, load_sharded, model_keys, optimizer_metadata, \
    regroup_optimizer_state, rng_sharded_object, save_sharded
from harness.parallel.state import DEFAULT_SEED
from harness.training.loss import loss_counts, rl_loss
from harness.training.rl_data import RLTrainBatch
from harness.training.rng import RNGStreams
from harness.variants import require


@dataclass
class PolicyConfig:
    """Optimizer, schedule and loss settings; names as in `GroundTruthTrainer`."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float | None = 1.0
    warmup_steps: int = 0
    decay_style: str = "constant"
    total_steps: int | None = None
    min_lr: float = 0.0
    micro_batches: int = 1  # per data-parallel rank (Megatron's num_microbatches)
    dtype: str = "fp32"  # "fp32" | "bf16" (bf16 weights, fp32 main params and grad reduction)
    dropout: float = 0.0  # hidden and attention dropout (RNG-dependent training when > 0)
    deterministic: bool = False  # deterministic kernels in the step (CUDA: e.g. embedding backward)
    loss_kwargs: dict[str, Any] = field(default_factory=dict)  # to rl_loss
    variant: str | None = None  # a training variant of the catalog (harness.variants)
    offload_variant: str | None = None  # an offload variant of the catalog (harness.offload)
    routing_replay: bool = False  # MoE: megatron-core's routers can replay routes (harness.training.routing_replay)
    # megatron-core's batch-invariant kernels on for every forward and step (CUDA only; what they cover:
    # harness.backends.batch_invariant; the exact tier of issue 35)
    batch_invariant: bool = False
    # Megatron's RMSNorm rounding ("auto": "hf" on the local spec, "fused" on TE; "fused" on the local spec
    # rounds once after the weight, as TE's norms and vLLM's batch-invariant RMSNorm do: harness.bridge.norms)
    norm_precision: str = "auto"
    # Megatron's unfused RoPE in bf16: "megatron" (each product and the sum rounded) or "once" (in fp32 from the
    # rounded cos/sin, rounded once, as vLLM's kernel does; harness.compat.megatron_core.ROPE_ROUNDED_ONCE).
    # The local spec only: TE's fused RoPE has its own rounding.
    rope_rounding: str = "megatron"


ROPE_ROUNDINGS = ("megatron", "once")
# The training variants of the catalog (harness.variants) this worker implements.
IMPLEMENTED = ("no-finalize-grads", "grad-times-microbatches", "grad-norm-without-experts",
               "expert-grads-over-dp", "cp-grads-summed-over-cp", "cp-metrics-summed")
# The context-parallel ones the logprob path implements (harness.logprobs.context_parallel).
CP_VARIANTS = ("cp-grads-summed-over-cp",)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class PolicyWorker:
    """This rank's share of a Megatron policy: model chunks (DDP), DistributedOptimizer, scheduler.

    Build it on every rank of the world at once, inside a Megatron layout. `steps_done` and
    `consumed_samples` (global rows trained on) are the data position a checkpoint records.
    `rng` holds the worker's own RNG streams, seeded from `seed` and the layout alone; run each
    call on the worker inside `worker.rng.active()` (the handles do) so that its dropout stream
    continues from its previous call whatever else the process ran in between.
    """

    def __init__(self, path, config: PolicyConfig | None = None, *, sequence_parallel: bool = False,
                 seed: int = DEFAULT_SEED, **overrides: Any) -> None:
        from harness.checkpoint.async_save import RankSaver

        from harness.launch import context
        from harness.offload import OffloadManager

        self.rng = RNGStreams.seeded(seed)
        self.saver = RankSaver()  # this worker's checkpoint writes (one async save in flight)
        self.accumulating: _Pending | None = None  # an open begin_step .. finish_step
        with self.rng.active():  # building draws from the streams (e.g. initializers)
            self._build(path, config, sequence_parallel, overrides)
        self.offloader = OffloadManager(self, context().device, self.config.offload_variant)

    def _build(self, path, config: PolicyConfig | None, sequence_parallel: bool,
               overrides: dict[str, Any]) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.utils import get_model_config

        from harness.bridge import bridge_info, load_megatron_model
        from harness.compat.megatron_core import filter_expert_grads_over_expert_tp

        config = config or PolicyConfig()
        for key, value in overrides.items():
            if not hasattr(config, key):
                raise TypeError(f"unknown PolicyConfig field {key!r}")
            setattr(config, key, value)
        require(config.variant, check="training")
        require(config.offload_variant, check="offload")
        if config.dtype not in DTYPES:
            raise ValueError(f"unknown policy dtype {config.dtype!r}; choose from {sorted(DTYPES)}")
        if not 0.0 <= config.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {config.dropout!r}")
        if config.rope_rounding not in ROPE_ROUNDINGS:
            raise ValueError(f"rope_rounding must be one of {ROPE_ROUNDINGS}, got {config.rope_rounding!r}")
        if config.batch_invariant:
            from harness.backends.batch_invariant import check
            from harness.launch import context

            check(context().device)
            if config.dropout:
                raise ValueError("batch_invariant=True with dropout: dropout's masks depend on the batch")
        self.config = config
        self.path = path
        self.steps_done = 0
        self.consumed_samples = 0
        dtype = DTYPES[config.dtype]
        self.models = load_megatron_model(
            path, dtype=dtype, wrap_with_ddp=True, sequence_parallel=sequence_parallel,
            norm_precision=config.norm_precision,
            config_overrides=dict(hidden_dropout=config.dropout, attention_dropout=config.dropout,
                                  **({"moe_enable_routing_replay": True} if config.routing_replay else {})),
            ddp_config=dict(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                            overlap_grad_reduce=False, overlap_param_gather=False,
                            average_in_collective=False))
        self.true_vocab = bridge_info(self.models).vocab_size
        clip = float(config.clip_grad) if config.clip_grad else 0.0  # Megatron: 0 = no clipping
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=config.lr, min_lr=config.min_lr,
                            weight_decay=config.weight_decay, adam_beta1=config.betas[0],
                            adam_beta2=config.betas[1], adam_eps=config.eps, clip_grad=clip,
                            use_distributed_optimizer=True, bf16=dtype is torch.bfloat16,
                            fp16=False, params_dtype=dtype),
            self.models)
        # megatron-core 0.16.1 filters expert grads for the grad norm over the dense TP group (Megatron-LM
        # #5916 with TE's grouped experts); gated, a no-op on 0.19.2 and wherever the experts are marked.
        filter_expert_grads_over_expert_tp(self.optimizer)
        decay_steps = config.total_steps if config.total_steps else max(config.warmup_steps, 0) + 1
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=config.lr, min_lr=config.min_lr,
            lr_warmup_steps=config.warmup_steps, lr_decay_steps=decay_steps,
            lr_decay_style=config.decay_style, start_wd=config.weight_decay,
            end_wd=config.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant")
        # As Megatron-LM's training.py (setup_model_and_optimizer / train) wires them.
        model_config = get_model_config(self.models[0])
        model_config.grad_scale_func = self.optimizer.scale_loss
        if config.variant != "no-finalize-grads":
            model_config.finalize_model_grads_func = finalize_model_grads
        if config.variant == "grad-norm-without-experts":
            _drop_experts_from_grad_norm(self.optimizer)
        if config.variant == "expert-grads-over-dp":
            model_config.finalize_model_grads_func = _experts_reduced_over_dp(self.models, finalize_model_grads)
        no_sync = [m.no_sync for m in self.models]
        model_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if config.rope_rounding == "once" and getattr(model_config, "apply_rope_fusion", False):
            raise ValueError("rope_rounding='once' rounds megatron-core's unfused RoPE (the local spec); this "
                             "model applies a fused RoPE (apply_rope_fusion)")
        self.model_config = model_config
        self.ps = ps

    @contextmanager
    def _numerics(self) -> Iterator[None]:
        """The config's kernel choices for a step: deterministic algorithms, and the forward's (below)."""
        with _deterministic(self.config.deterministic), self._forward_numerics():
            yield

    @contextmanager
    def _forward_numerics(self) -> Iterator[None]:
        """The config's kernel choices for any forward: batch-invariant kernels, the RoPE's rounding."""
        from harness.backends.batch_invariant import batch_invariance
        from harness.compat.megatron_core import rope_rounded_once

        with batch_invariance(self.config.batch_invariant), rope_rounded_once(self.config.rope_rounding == "once"):
            yield

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def train_step(self, train_batch: RLTrainBatch) -> dict[str, Any]:
        """One optimizer step on the GLOBAL train_batch (identical on every rank)."""
        pending = self._prepare(train_batch, "a training step")
        with self._numerics():
            self._backward(pending, range(len(pending.micros)), finalize=True)
            return self._update(pending)

    # A step in pieces, for gradient accumulation across calls (and offloads in between):
    # begin_step, accumulate(indices) until every micro-batch is in, finish_step. Equal to
    # train_step bit for bit when the micro-batch count is a power of two (the loss scale of
    # each piece is then an exact power-of-two rescaling of the whole step's).
    def begin_step(self, train_batch: RLTrainBatch) -> None:
        self.accumulating = self._prepare(train_batch, "begin_step")

    def accumulate(self, indices) -> None:
        """Forward and backward of these micro-batches (of this rank's share) into the grads."""
        pending = self._open("accumulate")
        indices = list(indices)
        bad = [i for i in indices if not 0 <= i < len(pending.micros) or i in pending.done]
        if bad or not indices:
            raise ValueError(f"micro-batches {indices} of {len(pending.micros)}: each once, "
                             f"{sorted(pending.done)} already done")
        with self._numerics():
            self._backward(pending, indices, finalize=False)

    def finish_step(self) -> dict[str, Any]:
        """Reduce the accumulated grads and take the optimizer step."""
        pending = self._open("finish_step")
        if len(pending.done) != len(pending.micros):
            raise RuntimeError(f"finish_step before every micro-batch was accumulated: "
                               f"{sorted(pending.done)} of {len(pending.micros)}")
        with self._numerics():
            finalize = self.model_config.finalize_model_grads_func
            if finalize is not None:  # what the schedule does after its last backward
                finalize(list(self.models), None)
            self.accumulating = None
            return self._update(pending)

    def _open(self, what: str) -> "_Pending":
        self.offloader.require("params", "grads", "optimizer", what=what)
        if self.accumulating is None:
            raise RuntimeError(f"{what} needs an open step: call begin_step first")
        return self.accumulating

    def _prepare(self, train_batch: RLTrainBatch, what: str) -> "_Pending":
        from harness.logprobs.micro_batches import split_micro_batches

        self.offloader.require("params", "grads", "optimizer", what=what)
        if self.accumulating is not None:
            raise RuntimeError(f"{what} with a step open (begin_step without finish_step)")
        ps = self.ps
        n_micro = self.config.micro_batches
        dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        tokens_total, seqs_total = loss_counts(train_batch)  # the WHOLE global batch
        local = train_batch.split(dp_size)[dp_rank]
        # Sequence parallelism shards each micro-batch's sequence over the TP ranks: its length must
        # divide by TP (padded columns are masked; tp4-sp on 4 H100s failed without it, 2026-11-27).
        from harness.bridge import unwrap_model

        # Context parallelism splits each micro-batch's sequence into 2 x cp chunks (and each CP
        # rank's share over TP under SP): harness.logprobs.context_parallel.
        from harness.logprobs.context_parallel import length_multiple

        sp = bool(unwrap_model(self.models)[0].config.sequence_parallel)
        multiple = length_multiple(ps.get_context_parallel_world_size(), ps.get_tensor_model_parallel_world_size(), sp)
        micros = split_micro_batches(local.batch, n_micro, length_multiple=multiple)  # checks the count divides the rows
        parts = local.split(n_micro)  # the same rows, with their advantages, old logprobs, ...
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        return _Pending(train_batch, micros, parts, tokens_total, seqs_total, dp_size)

    def _backward(self, pending: "_Pending", indices, finalize: bool) -> None:
        """Forward and backward of micro-batches `indices` through Megatron's schedule; the
        schedule reduces the grads at its end only with `finalize`."""
        from harness.launch import context
        from harness.logprobs.schedule import run_schedule, token_logprobs

        indices = list(indices)
        device = context().device
        # Undo Megatron's loss /= num_microbatches (of this schedule call), loss *= cp and the DDP
        # 1/dp grad pre-scaling: per-part losses are already normalised by the global counts, so
        # grads must simply add. (Megatron multiplies by cp_size, DDP divides by dp_size * cp_size.)
        scale = float(len(indices) * pending.dp_size)
        if self.config.variant == "grad-times-microbatches":
            scale *= len(indices)

        cp_variant = self.config.variant if self.config.variant in CP_VARIANTS else None

        def loss_for(local_index, micro, tokens):
            index = indices[local_index]

            def loss_func(logits: torch.Tensor):
                logprobs = token_logprobs(logits, tokens, micro, self.true_vocab, cp_variant)
                loss, stats = rl_loss(logprobs, pending.parts[index], global_token_count=pending.tokens_total,
                                      global_seq_count=pending.seqs_total, **self.config.loss_kwargs)
                pending.losses[index] = loss.detach()
                pending.clipped[index] = stats["clip_fraction"]
                return (loss * scale).to(device), {"loss": loss.detach()}

            return loss_func

        saved = self.model_config.finalize_model_grads_func
        if not finalize:
            self.model_config.finalize_model_grads_func = None
        try:
            run_schedule(self.models, [pending.micros[i] for i in indices], loss_for, forward_only=False)
        finally:
            self.model_config.finalize_model_grads_func = saved
        pending.done.update(indices)

    def _update(self, pending: "_Pending") -> dict[str, Any]:
        import torch.distributed as dist

        from harness.launch import context

        ps = self.ps
        device = context().device
        local_losses = pending.losses
        lr = self.lr
        success, grad_norm, _num_zeros = self.optimizer.step()
        if not success:
            raise RuntimeError("optimizer step skipped (inf/nan gradients)")
        self.scheduler.step(increment=1)

        # The loss lives on the last pipeline stage: sum over DP there, then broadcast over PP.
        last = ps.is_pipeline_last_stage(ignore_virtual=True)
        # [loss, clip fraction]: the share of loss tokens whose ratio the clip held (no gradient); a
        # comparison of steps reads it to tell a token flipped across the clip boundary (bf16).
        value = torch.zeros(2, dtype=torch.float64, device=device)
        if last:
            value[0] += sum(float(local_losses[i]) for i in range(len(pending.micros)))
            value[1] += sum(float(pending.clipped[i]) for i in range(len(pending.micros)))
        # Over DP only: every CP rank already holds its DP rank's whole loss (the gathered logprobs);
        # summing over the CP ranks too is the variant cp-metrics-summed (SkyRL PR 1420).
        dist.all_reduce(value, group=ps.get_data_parallel_group(
            with_context_parallel=self.config.variant == "cp-metrics-summed"))
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(value, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        self.steps_done += 1
        self.consumed_samples += pending.train_batch.batch_size
        return {"loss": float(value[0]), "clip_fraction": float(value[1]), "grad_norm": float(grad_norm), "lr": lr,
                "micro_batches": self._micro_batch_stats(local_losses, pending.parts, last, device)}

    def _micro_batch_stats(self, local_losses, parts, last: bool, device) -> list[dict[str, Any]]:
        """Every micro-batch of the global batch, in (dp rank, index) order: its contribution to
        the loss and its response-token count; identical on every rank."""
        import torch.distributed as dist

        ps = self.ps
        mine = torch.zeros(len(parts), 2, dtype=torch.float64, device=device)
        if last:
            for i, part in enumerate(parts):
                mine[i, 0] = float(local_losses[i])
                mine[i, 1] = float(part.loss_mask().sum())
        gathered = [torch.empty_like(mine) for _ in range(ps.get_data_parallel_world_size())]
        dist.all_gather(gathered, mine, group=ps.get_data_parallel_group())
        table = torch.stack(gathered)
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(table, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        return [{"dp_rank": d, "index": i, "loss": float(table[d, i, 0]), "tokens": int(table[d, i, 1])}
                for d in range(table.shape[0]) for i in range(table.shape[1])]

    @torch.no_grad()
    def logprobs(self, batch, micro_batches: int = 1, temperature: float = 1.0):
        """This rank's share of the current weights' logprobs of `batch` (the forward the parity
        suite checks; no dropout, nothing recorded for a backward), the logits divided by `temperature`."""
        from harness.logprobs.megatron import megatron_logprobs

        self.offloader.require("params", what="policy logprobs")
        training = [m.training for m in self.models]
        for m in self.models:
            m.eval()
        try:
            with self._forward_numerics():  # the step's deterministic switch: steps only
                return megatron_logprobs(self.models, batch, micro_batches=micro_batches, temperature=temperature)
        finally:
            for m, mode in zip(self.models, training):
                m.train(mode)

    def export(self) -> dict[str, torch.Tensor]:
        """The full HF state dict (call on every rank at once)."""
        from harness.bridge import export_hf_state_dict

        self.offloader.require("params", what="a weight export")
        return export_hf_state_dict(self.models)

    @torch.no_grad()
    def _full_main_params(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Each model parameter's float32 main parameter, whole. Each data-parallel rank holds a
        slice of every main parameter: the slices are summed over DP. Every rank walks the same
        parameters in the same order (its optimizer knows only those its slice touches), so the
        all-reduces pair up."""
        import torch.distributed as dist

        self.offloader.require("params", "optimizer", what="reading the main params")
        group = self.ps.get_data_parallel_group()
        optimizers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        full_params = {}
        for param in (p for model in self.models for p in model.parameters()):
            full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
            for dist_opt in optimizers:
                if param in dist_opt.model_param_group_index_map:
                    main = dist_opt._get_main_param_and_optimizer_states(param)["param"]
                    span = dist_opt._get_model_param_range_map(param)["param"]
                    full[span.start:span.end] = main.detach().float().view(-1)
            dist.all_reduce(full, group=group)
            full_params[param] = full.view(param.shape)
        return full_params

    @torch.no_grad()
    def replica_divergence(self) -> float:
        """The largest |difference| between float32 main copies of one parameter held by several
        ranks: the tensor-parallel replicas of every parameter TP does not split (norms, row-parallel
        biases; an expert's over the expert-TP group) and, for tied embeddings under PP, the first and last stage's copies. Exactly 0 when
        training is right: every replica gets the same all-reduced gradient and the same update. A
        missing reduction (finalize_model_grads unset) lets the replicas drift apart, which no
        comparison of one rank's weights with a ground truth sees in bf16."""
        import torch.distributed as dist
        from harness.bridge import unwrap_model

        ps = self.ps
        full = self._full_main_params()
        worst = torch.zeros((), dtype=torch.float64)

        def spread(value: torch.Tensor, group, size: int) -> None:
            copies = [torch.empty_like(value) for _ in range(size)]
            dist.all_gather(copies, value.contiguous(), group=group)
            for copy in copies[1:]:
                worst.copy_(torch.maximum(worst, (copy - copies[0]).abs().max().double().cpu()))

        tp, etp = ps.get_tensor_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
        for param, value in full.items():
            if getattr(param, "tensor_model_parallel", False):
                continue
            # An expert parameter (allreduce=False) is replicated over the expert-TP group, not the
            # dense one: at ep over the TP ranks each TP rank holds other experts (TE's grouped experts
            # are unmarked on megatron-core 0.16.1 even then: harness.compat.megatron_core).
            if getattr(param, "allreduce", True) and tp > 1:
                spread(value, ps.get_tensor_model_parallel_group(), tp)
            elif not getattr(param, "allreduce", True) and etp > 1:
                spread(value, ps.get_expert_tensor_parallel_group(), etp)
        if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
            for chunk in unwrap_model(list(self.models)):
                if chunk.share_embeddings_and_output_weights and (chunk.pre_process or chunk.post_process):
                    group = ps.get_embedding_group()
                    spread(full[chunk.shared_embedding_or_output_weight()], group, dist.get_world_size(group))
        result = worst.to(full[next(iter(full))].device)
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
        return float(result)

    # ------------------------------------------------- checkpoints (rank side of harness.checkpoint)
    def _chunks(self) -> list[torch.nn.Module]:
        from harness.bridge import unwrap_model

        return unwrap_model(list(self.models))

    def position(self) -> dict[str, int]:
        return {"steps_done": self.steps_done, "consumed_samples": self.consumed_samples}

    def sharded_state_dict(self, optimizer_format: str = "fully_reshardable", *, is_loading: bool = False,
                           with_rng: bool = True) -> dict[str, Any]:
        """The whole policy state as Megatron's sharded state dict (Megatron-LM's keys):
        ``model``/``model0..`` (one per virtual pipeline chunk), ``optimizer`` (DistributedOptimizer
        state in `optimizer_format`), ``scheduler`` and ``position`` (saved once), and
        ``rng_state`` (this worker's RNG streams, per rank)."""
        if optimizer_format not in OPTIMIZER_FORMATS:
            raise ValueError(f"unknown optimizer format {optimizer_format!r}; choose from {OPTIMIZER_FORMATS}")
        self.offloader.require("params", "optimizer", what="a checkpoint save or load")
        ps = self.ps
        chunks = self._chunks()
        state: dict[str, Any] = {}
        for i, (name, chunk) in enumerate(zip(model_keys(len(chunks)), chunks)):
            if len(chunks) > 1:
                ps.set_virtual_pipeline_model_parallel_rank(i)
            state[name] = chunk.sharded_state_dict()
        if len(chunks) > 1:
            ps.set_virtual_pipeline_model_parallel_rank(0)
        state["optimizer"] = self.optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=optimizer_metadata(optimizer_format))
        state["scheduler"] = self.scheduler.state_dict()
        state["position"] = self.position()
        if with_rng:
            state["rng_state"] = rng_sharded_object(self.rng.current())
        return state

    def save_checkpoint(self, directory: str, *, optimizer_format: str = "fully_reshardable",
                        fully_parallel: bool = True, async_save: bool = False, iteration: int | None = None,
                        allow_overlap: bool = False) -> dict[str, int]:
        """Write this rank's part of the policy into `directory` (every rank at once); returns the
        data position saved and where the time went ("timings": state_dict_s, plan_s, stage_s).
        With async_save the write continues in a forked writer after this returns, from a snapshot
        of the state now; `finalize_checkpoints` completes it. The directory's atomicity, manifest
        and tracker are the parent's (harness.checkpoint)."""
        from harness.compat.megatron_core import ensure_optimizer_state

        self.offloader.require("params", "optimizer", what="a checkpoint save")
        ensure_optimizer_state(self.optimizer)  # a never-stepped policy saves its zero Adam state
        started = time.perf_counter()
        state = self.sharded_state_dict(optimizer_format)
        built = time.perf_counter() - started
        timings = save_sharded(self.saver, state, directory, optimizer_format, fully_parallel,
                               async_save=async_save, iteration=iteration, allow_overlap=allow_overlap)
        return {**self.position(), "timings": {"state_dict_s": built, **timings}}

    # ------------------------------------------------- offload (harness.offload)
    def offload(self, components) -> list[dict[str, Any]]:
        return self.offloader.offload(tuple(components))

    def reload(self, components) -> list[dict[str, Any]]:
        return self.offloader.reload(tuple(components))

    def offload_accounting(self) -> dict[str, Any]:
        return self.offloader.accounting()

    def finalize_checkpoints(self, blocking: bool = False) -> dict[str, Any]:
        """Complete the async saves whose writes are done on every rank (collective);
        harness.checkpoint.async_save.RankSaver.finalize."""
        return self.saver.finalize(blocking)

    def checkpoint_writes_done(self, iteration: int) -> bool:
        """This rank's writer of the pending save of `iteration` has exited (RankSaver.writes_done)."""
        return self.saver.writes_done(iteration)

    def abort_checkpoints(self) -> list[int]:
        """Kill this rank's in-flight checkpoint writers; returns their pids."""
        return self.saver.abort()

    def checkpoint_writers(self) -> list[int]:
        """Live checkpoint writer processes of this rank (none once every save is finalized)."""
        from harness.checkpoint.async_save import writer_processes

        return writer_processes()

    def load_checkpoint(self, directory: str, *, optimizer_format: str = "fully_reshardable",
                        fully_parallel: bool = True, load_rng: bool = False,
                        unshare_adam_steps: bool = True) -> dict[str, int]:
        """Replace the whole policy state by the checkpoint's (every rank at once; the parent has
        validated it: harness.checkpoint.manager.check_loadable); with load_rng the worker's own
        RNG streams become the saved ones. unshare_adam_steps=False keeps megatron-core's shared
        Adam step (the `shared-adam-step` variant). Returns the data position loaded.

        Not transactional: a load that fails inside dist_checkpointing can leave the live
        embedding and output layer zeroed and the Adam steps shared (megatron-core 0.16.1, see
        test_dp_reshardable_optimizer_at_another_tp_pp_fails_inside_megatron_and_damages_the_target),
        which is why the parent refuses every checkpoint it can tell will not load first."""
        from harness.compat.megatron_core import ensure_optimizer_state, load_optimizer_state_dict

        self.offloader.require("params", "optimizer", what="a checkpoint load")
        ensure_optimizer_state(self.optimizer)
        template = self.sharded_state_dict(optimizer_format, is_loading=True, with_rng=load_rng)
        loaded = load_sharded(template, directory, fully_parallel)
        chunks = self._chunks()
        for name, chunk in zip(model_keys(len(chunks)), chunks):
            chunk.load_state_dict(loaded[name])
        optimizer_state = regroup_optimizer_state(
            loaded["optimizer"], len(getattr(self.optimizer, "chained_optimizers", [self.optimizer])))
        load_optimizer_state_dict(self.optimizer, optimizer_state, unshare_steps=unshare_adam_steps)
        self.scheduler.load_state_dict(loaded["scheduler"])
        self.steps_done = int(loaded["position"]["steps_done"])
        self.consumed_samples = int(loaded["position"]["consumed_samples"])
        if load_rng:
            self.rng.replace(loaded["rng_state"])
        return self.position()


@dataclass
class _Pending:
    """A step under way: its global batch, this rank's micro-batches, what is accumulated."""

    train_batch: RLTrainBatch
    micros: list
    parts: list
    tokens_total: int
    seqs_total: int
    dp_size: int
    done: set = field(default_factory=set)
    losses: dict = field(default_factory=dict)
    clipped: dict = field(default_factory=dict)  # per part: its share of the global clip fraction


@contextmanager
def _deterministic(on: bool) -> Iterator[None]:
    """torch's deterministic algorithms for the duration (the rank's previous setting after):
    bit-exact resume checks on CUDA need them, as atomics make e.g. embedding backward vary."""
    if not on:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _drop_experts_from_grad_norm(optimizer) -> None:
    """The grad-norm-without-experts variant (Megatron-LM #5916's class): under expert parallelism
    megatron-core keeps a MoE model's expert parameters in an optimizer of their own (a
    ChainedOptimizer's expert-parallel part; at ep 1 they sit with the others); leave its gradients
    out of the global grad norm, and so out of clipping."""
    from harness.compat.megatron_core import expert_parallel_parts
    from harness.variants import VariantError

    experts = expert_parallel_parts(optimizer)
    if not experts:
        raise VariantError("variant 'grad-norm-without-experts' needs a MoE model under expert parallelism "
                           "(ep >= 2: only then does megatron-core give the experts an optimizer of their own)")
    for part in experts:  # both of ChainedOptimizer.get_grad_norm's paths (0.19 renamed the first)
        for name in ("get_main_grads_for_grad_norm", "get_grads_for_grad_norm"):
            if hasattr(part, name):
                setattr(part, name, lambda: [])
        part.get_grad_norm = lambda: 0.0


def _experts_reduced_over_dp(models, finalize):
    """The expert-grads-over-dp variant (Megatron-LM #5916's second class): the experts' gradients
    reduced over the dense data-parallel group, as megatron-core does for a parameter whose
    `allreduce` flag was left True (0.16.1's layers set it False only at ep > 1). Megatron-core's own
    expert reduction then runs over expert DP as usual; summing the expert buffers over DP first gives
    the reduced gradients the flag bug gives: where the DP group is not the expert-DP group (dp2ep2),
    experts that differ per rank are summed as if they were replicas."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from harness.variants import VariantError

    if ps.get_data_parallel_world_size() == ps.get_expert_data_parallel_world_size():
        raise VariantError("variant 'expert-grads-over-dp' needs the data-parallel group to differ from the "
                           "expert data-parallel group (ep * etp != tp * cp)")

    def wrong_group_first(*args, **kwargs):
        for model in models:
            for buffer in model.expert_parallel_buffers:
                dist.all_reduce(buffer.grad_data, group=ps.get_data_parallel_group())
        return finalize(*args, **kwargs)

    return wrong_group_first
