"""How a bucket of weights travels from the trainer's rank 0 to a rollout engine in another process.

Two transports, chosen by the engine (`engine.transport`):
- `host`: the tensors are copied to the CPU on rank 0 and pickled through the driver to the engine
  (the CPU tier; any engine).
- `cuda-ipc`: colocated on one GPU, as verl, NeMo-RL and slime hand weights to vLLM. Rank 0 packs the
  bucket into one flat CUDA buffer (each tensor at a 256-byte aligned offset) and sends a CUDA IPC
  handle of it (`torch.multiprocessing.reductions.reduce_tensor`), a few hundred bytes, through the
  driver; the engine maps the buffer (`open_shared`), takes views of it, copies them into its own
  weights and synchronizes before it answers. Rank 0 keeps the buffer until the next bucket is asked
  for: the engine has answered by then, so nothing is freed while it may still be read.

The handle names the GPU by UUID, not by index: the engine's process may number its GPUs otherwise.
The producer synchronizes its stream after packing, because no CUDA stream order holds across
processes: without it the engine could read the buffer before the copies into it have run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

TRANSPORTS = ("host", "cuda-ipc")
ALIGN = 256  # bytes: every view keeps the alignment of a fresh allocation


@dataclass
class SharedBucket:
    """One bucket in one CUDA buffer: `specs` are (HF name, dtype name, shape, byte offset)."""

    handle: tuple  # reduce_tensor's (rebuild function, args) of the uint8 buffer
    device_uuid: str
    specs: list[tuple[str, str, tuple[int, ...], int]]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [name for name, *_ in self.specs]

    def __len__(self) -> int:
        return len(self.specs)

    def meta(self) -> list[tuple[str, torch.Tensor]]:
        """(name, meta tensor) pairs: the names and shapes, for checks that need no values."""
        return [(name, torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
                for name, dtype, shape, _ in self.specs]


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_names(bucket: Any) -> list[str]:
    return bucket.names if isinstance(bucket, SharedBucket) else [name for name, _ in bucket]


def bucket_nbytes(bucket: Any) -> int:
    if isinstance(bucket, SharedBucket):
        return sum(tensor_bytes(t) for _, t in bucket.meta())
    return sum(tensor_bytes(t) for _, t in bucket)


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def device_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def pack(pairs: Iterable[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, SharedBucket]:
    """Pack CUDA tensors into one buffer; returns (the buffer, which the caller keeps alive until the
    consumer has answered, and its SharedBucket)."""
    from torch.multiprocessing.reductions import reduce_tensor

    pairs = list(pairs)
    if not pairs:
        raise ValueError("an empty bucket has nothing to share")
    device = pairs[0][1].device
    if device.type != "cuda" or any(t.device != device for _, t in pairs):
        raise ValueError("cuda-ipc packs CUDA tensors of one device, got "
                         f"{sorted({str(t.device) for _, t in pairs})}")
    specs, offset = [], 0
    for name, tensor in pairs:
        offset = _aligned(offset)
        specs.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset += tensor_bytes(tensor)
    buffer = torch.empty(max(offset, 1), dtype=torch.uint8, device=device)
    for (_, _, _, start), (_, tensor) in zip(specs, pairs):
        buffer[start:start + tensor_bytes(tensor)].copy_(tensor.contiguous().view(-1).view(torch.uint8))
    torch.cuda.current_stream(device).synchronize()  # the consumer's process does not wait on our stream
    return buffer, SharedBucket(reduce_tensor(buffer), device_uuid(device), specs, offset)


def _local_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise RuntimeError(f"GPU {uuid} (the trainer's) is not visible to this process: cuda-ipc needs the engine "
                       "on the trainer's GPU (colocated)")


def open_shared(bucket: SharedBucket) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """The consumer's side: map the buffer and view each tensor of it (no copy). Returns (the mapped
    buffer, (name, view) pairs); drop both once the views have been copied."""
    rebuild, args = bucket.handle
    args = list(args)
    args[6] = _local_index(bucket.device_uuid)  # rebuild_cuda_tensor's target_device
    buffer = rebuild(*args)
    views = []
    for name, dtype, shape, offset in bucket.specs:
        dtype = getattr(torch, dtype)
        count = 1
        for size in shape:
            count *= size
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        views.append((name, buffer[offset:offset + nbytes].view(dtype).view(shape)))
    return buffer, views
