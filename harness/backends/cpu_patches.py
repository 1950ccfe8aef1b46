"""Make Megatron-Core run on CPU (gloo) inside a rank process.

Megatron-Core assumes CUDA in a handful of places; each patch below answers one of them
(measured facts: shared notes "megatron-on-cpu.md"). The patches are process-global, so they are
installed only inside rank processes that run on CPU - never in the pytest parent or a CUDA rank.
`uninstall()` restores every original (used by the tests of this module).
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_originals: list[tuple[Any, str, Any]] = []
_mode: "_CudaToCpuMode | None" = None


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's device arguments (`device=0`).
    return isinstance(value, int) and not isinstance(value, bool)


def _map_device(value: Any) -> Any:
    return _CPU if _is_cuda_device(value) else value


# Tensor methods whose first positional argument may be a device.
_DEVICE_FIRST_ARG = {torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros}


class _CudaToCpuMode(TorchFunctionMode):
    """Maps `device="cuda"` (and friends) to CPU in every torch call; `Tensor.cuda()` is identity.

    Also reports CUDA type strings from `Tensor.type()` for CPU tensors, because Megatron's
    DistributedOptimizer and clip_grads compare against 'torch.cuda.FloatTensor' etc.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # CP's RoPE slice (get_pos_emb_on_this_cp_rank): no pinned memory here
            kwargs["pin_memory"] = False
        # A bare int is a size, not an ordinal, in new_empty/new_zeros(*sizes) (HF's DeepSeek-V3 MLA:
        # `kv.new_empty(*shape)`): only `to` reads it as a device.
        if func in _DEVICE_FIRST_ARG and len(args) > 1 and _is_cuda_device(args[1]) \
                and (func is torch.Tensor.to or not isinstance(args[1], int)):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _DropRngWarning(logging.Filter):
    """The RNG tracker shares the CPU generator here, so its 'CPU RNG state changed' warning is
    always true and always noise (~70 lines a run)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_rng_filter = _DropRngWarning()


def _patch(obj: Any, attr: str, new: Any) -> None:
    _originals.append((obj, attr, getattr(obj, attr)))
    setattr(obj, attr, new)


def _set_cpu_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _ignore(*args: Any, **kwargs: Any) -> None:
    return None


def _seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, i.e. this function.
    torch.default_generator.manual_seed(int(seed))


class _CpuStream:
    """A stand-in for torch.cuda.Stream/Event on CPU, where everything runs in order: megatron-core
    0.19 creates streams where 0.16 did not (DDP wrapping in megatron.training's dist_utils, the
    alltoall token dispatcher's constructor), and torch's CUDA wheels fail there without a driver."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> "_CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def record_event(self, *args: Any, **kwargs: Any) -> "_CpuStream":
        # The alltoall token dispatcher synchronizes on the event this returns (d2h_event).
        return _CpuStream()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        return _ignore  # wait_stream, wait_event, record, synchronize, query...


def _split_sizes_to_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    """megatron-core's token dispatcher moves the all-to-all split sizes to the host with
    `maybe_move_tensor_to_cpu(..., as_numpy=True)`, which converts CUDA tensors only: a CPU tensor
    stays a tensor, and gloo's all_to_all_single refuses it as split sizes (ep > 1)."""
    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)
    return maybe_move_tensor_to_cpu


def is_installed() -> bool:
    return _mode is not None


# Up to this many elements a float32 CPU norm is within 2.3e-7 of the float64 one (2**17 N(0, 1) elements,
# AVX2; 2**20: 1.2e-5 low, 1e7: 3.7e-4, 1.3e8: 1.3%): the tiny models' tensors (<= 2**15) keep megatron-core's
# own arithmetic bit for bit, and with it the committed RL trajectories (suites/rl/golden.py).
_FLOAT32_NORM_EXACT_UP_TO = 1 << 16


def _float64_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's fallback l2 norm without apex or TE (`local_multi_tensor_l2_norm`: the grad norm the
    optimizer clips by and reports), summed in float64 once a tensor is past what float32 sums exactly here:
    the fallback's torch.norm per tensor is 3.7e-4 low on a 1e7-element gradient on the CPU, 1.3% on 1.3e8
    (harness.backends.norms; suites/harness/test_cpu_backend.py)."""
    from megatron.core.utils import local_multi_tensor_l2_norm

    from harness.backends.norms import float64_l2_norm

    tensors = [t for tensors in tensor_lists for t in tensors]
    if all(t.numel() <= _FLOAT32_NORM_EXACT_UP_TO for t in tensors):
        return local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
    return torch.tensor([float64_l2_norm(tensors)], dtype=torch.float), None


def install() -> None:
    """Install every patch (idempotent)."""
    global _mode
    if _mode is not None:
        return
    cuda_rng: dict[str, Callable[..., Any]] = {
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": _set_cpu_rng_state,
        "manual_seed": _seed,
        "manual_seed_all": _seed,
    }
    for name, fn in cuda_rng.items():
        _patch(torch.cuda, name, fn)
        _patch(torch.cuda.random, name, fn)
    # A device, not an ordinal: the function mode is not active inside autograd's backward (torch
    # 2.13), where Megatron's sequence-parallel gathers allocate on current_device().
    _patch(torch.cuda, "current_device", lambda: _CPU)
    _patch(torch.cuda, "synchronize", _ignore)  # pipeline p2p calls it unconditionally
    for name in ("Stream", "Event"):
        _patch(torch.cuda, name, _CpuStream)
    _patch(torch.cuda, "current_stream", lambda *a, **k: _CpuStream())
    _patch(torch.cuda, "stream", lambda *a, **k: _CpuStream())
    # On a GPU host a CPU rank behaves as on the CPU machines CI runs on: no CUDA. torch caches its
    # device count, so a rank forked from a process that had counted still "sees" the GPU that
    # CUDA_VISIBLE_DEVICES hides; its Adam then asks CUDA whether it is capturing a graph, for CPU
    # tensors, and fails (cudaErrorInitializationError / NoDevice; torch 2.11 on the H100 host).
    _patch(torch.cuda, "is_available", lambda: False)
    _patch(torch.optim.Optimizer, "_accelerator_graph_capture_health_check", _ignore)
    try:
        from megatron.core.tensor_parallel import random as mcore_random
    except ImportError:  # the world itself works without megatron-core
        mcore_random = None
    if mcore_random is not None:
        _patch(mcore_random, "_set_cuda_rng_state", _set_cpu_rng_state)
        _patch(mcore_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
        logging.getLogger(mcore_random.__name__).addFilter(_rng_filter)
    try:
        from megatron.core.transformer.moe import token_dispatcher
    except ImportError:
        token_dispatcher = None
    if token_dispatcher is not None and hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        _patch(token_dispatcher, "maybe_move_tensor_to_cpu",
               _split_sizes_to_cpu(token_dispatcher.maybe_move_tensor_to_cpu))
    try:
        from megatron.core import utils as mcore_utils
        from megatron.core.optimizer import clip_grads
    except ImportError:
        clip_grads = None
    if clip_grads is not None and clip_grads.l2_norm_impl is mcore_utils.local_multi_tensor_l2_norm:
        _patch(clip_grads, "l2_norm_impl", _float64_multi_tensor_l2_norm)
    warnings.filterwarnings("ignore", message=".*CPU RNG state changed.*")
    _mode = _CudaToCpuMode()
    _mode.__enter__()


def uninstall() -> None:
    """Undo `install()`: restore every original attribute and leave the function mode."""
    global _mode
    if _mode is None:
        return
    _mode.__exit__(None, None, None)
    _mode = None
    while _originals:
        obj, attr, original = _originals.pop()
        setattr(obj, attr, original)
    try:
        from megatron.core.tensor_parallel import random as mcore_random

        logging.getLogger(mcore_random.__name__).removeFilter(_rng_filter)
    except ImportError:
        pass
