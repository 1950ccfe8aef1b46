"""How a bucket of weights travels from the trainer's rank 0 to a rollout engine in another process.

Three transports, chosen by the engine (`engine.transport`):
- `host`: the tensors are copied to the CPU on rank 0 and pickled through the driver to the engine
  (the CPU tier; any engine).
- `cuda-ipc`: colocated on one GPU, as verl, NeMo-RL and slime hand weights to vLLM. Rank 0 packs the
  bucket into one flat CUDA buffer (each tensor at a 256-byte aligned offset, copied in as it joins the
  bucket: `Packer`, the one copy rank 0 makes) and sends a CUDA IPC
  handle of it (`torch.multiprocessing.reductions.reduce_tensor`), a few hundred bytes, through the
  driver; the engine maps the buffer (`open_shared`), takes views of it, copies them into its own
  weights and synchronizes before it answers. Rank 0 keeps the buffer until the next bucket is asked
  for: the engine has answered by then, so nothing is freed while it may still be read.
- `broadcast`: the engine on GPUs of its own (separate placement), as NeMo-RL, verl and slime update a
  remote vLLM: rank 0 and the engine's process share a two-member process group of their own (a
  TCPStore on the driver's host, `open_group`: NCCL on CUDA, gloo on CPU, so the CPU tier runs the
  same protocol). Rank 0 packs a bucket as for cuda-ipc and starts a broadcast of it; the driver
  hands the engine the bucket's layout (`WireBucket`); the engine receives into a buffer of its own
  and loads views of it. The broadcast is asynchronous on rank 0, which waits for it before it packs
  the next bucket.

The handle names the GPU by UUID, not by index: the engine's process may number its GPUs otherwise.
The producer synchronizes its stream after packing, because no CUDA stream order holds across
processes: without it the engine could read the buffer before the copies into it have run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable

import torch

TRANSPORTS = ("host", "cuda-ipc", "broadcast")
GROUP_PREFIX = "mrh-weight-sync"
ALIGN = 256  # bytes: every view keeps the alignment of a fresh allocation


Spec = tuple  # (HF name, dtype name, shape, byte offset) of one tensor in a packed buffer


@dataclass
class WireBucket:
    """One bucket packed into one flat buffer, by layout: `specs` are (HF name, dtype name, shape,
    byte offset). Sent by broadcast: the engine receives `nbytes` and views the specs."""

    specs: list[Spec]
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

    def views(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, view of `buffer`) for every spec: no copy."""
        out = []
        for name, dtype, shape, offset in self.specs:
            dtype = getattr(torch, dtype)
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            out.append((name, buffer[offset:offset + nbytes].view(dtype).view(shape)))
        return out


@dataclass
class SharedBucket(WireBucket):
    """A packed bucket shared by a CUDA IPC handle (reduce_tensor's (rebuild function, args) of the
    uint8 buffer) on the GPU named by `device_uuid`."""

    handle: tuple = ()
    device_uuid: str = ""


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_names(bucket: Any) -> list[str]:
    return bucket.names if isinstance(bucket, WireBucket) else [name for name, _ in bucket]


def bucket_nbytes(bucket: Any) -> int:
    if isinstance(bucket, WireBucket):
        return sum(tensor_bytes(t) for _, t in bucket.meta())
    return sum(tensor_bytes(t) for _, t in bucket)


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def device_uuid(device: torch.device | int) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class Packer:
    """A bucket packed: tensors of one device copied one at a time into one flat uint8 buffer, each at a
    256-byte aligned offset (a WireBucket's layout). `add` copies at once, so a tensor valid only until
    the next one (the bridge's export yields views into its gather buffers) needs no copy of its own
    before it is packed. The buffer holds `capacity` bytes and grows (one copy of what it holds) if a
    tensor does not fit."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(int(capacity), 1)
        self.buffer: torch.Tensor | None = None  # allocated by the first add, on that tensor's device
        self.specs: list[Spec] = []
        self.end = 0

    def add(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Copy `tensor` in; returns its packed copy (a view of the buffer)."""
        if self.buffer is None:
            self.buffer = torch.empty(max(self.capacity, tensor_bytes(tensor), 1), dtype=torch.uint8,
                                      device=tensor.device)
        elif tensor.device != self.buffer.device:
            raise ValueError(f"a bucket packs tensors of one device, got {self.buffer.device} and {tensor.device}")
        start = _aligned(self.end)
        end = start + tensor_bytes(tensor)
        if end > self.buffer.numel():
            grown = torch.empty(max(end, 2 * self.buffer.numel()), dtype=torch.uint8, device=self.buffer.device)
            grown[:self.end].copy_(self.buffer[:self.end])
            self.buffer = grown  # views handed out before stay valid: they keep the old storage
        packed = self.buffer[start:end].view(tensor.dtype).view(tensor.shape)
        packed.copy_(tensor)
        self.specs.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), start))
        self.end = end
        return packed

    def layout(self, names: Iterable[str] | None = None) -> tuple[torch.Tensor, WireBucket]:
        """(the buffer cut to the packed bytes, its WireBucket); `names`: only these tensors' specs (the
        bytes of the others still travel, as a packed bucket's do when its layout is cut)."""
        if self.buffer is None:
            raise ValueError("an empty bucket has nothing to send")
        keep = None if names is None else set(names)
        specs = self.specs if keep is None else [spec for spec in self.specs if spec[0] in keep]
        return self.buffer[:max(self.end, 1)], WireBucket(specs, self.end)


def share(buffer: torch.Tensor, wire: WireBucket) -> tuple[torch.Tensor, SharedBucket]:
    """A packed CUDA buffer shared by CUDA IPC; returns (the buffer, which the caller keeps alive until
    the consumer has answered, and its SharedBucket)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda":
        raise ValueError(f"cuda-ipc shares CUDA tensors, got {buffer.device}")
    torch.cuda.current_stream(buffer.device).synchronize()  # the consumer's process does not wait on our stream
    return buffer, SharedBucket(wire.specs, wire.nbytes, reduce_tensor(buffer), device_uuid(buffer.device))


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
    return buffer, bucket.views(buffer)


# ------------------------------------------------------------------------------------- broadcast
def serve_store(host: str, timeout_s: float = 300.0):
    """Rank 0's TCPStore for a weight-sync group, on a port the OS picks (`.port`): bound at once, so
    no other process can take the port between its choice and its use."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, 2, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def open_group(host: str, port: int, rank: int, device: torch.device, timeout_s: float = 300.0, store=None):
    """The two-member group of rank 0 (rank 0, holding the TCPStore: `store`, from `serve_store`) and
    the engine (rank 1, connecting to `host:port`): NCCL when `device` is CUDA, gloo on CPU. Both sides
    call it at once; it returns once a first broadcast went through (so later broadcasts never wait on a
    peer joining)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if (store is None) != (rank != 0):
        raise ValueError("open_group: rank 0 passes the store it serves (serve_store), the engine none")
    if store is None:
        store = dist.TCPStore(host, port, 2, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(GROUP_PREFIX, store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
    group = Group(group, store)  # the store must outlive the group (rank 0 serves it)
    probe = torch.full((1,), 7 if rank == 0 else 0, dtype=torch.int32, device=device)
    broadcast(group, probe).wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if int(probe.item()) != 7:
        raise RuntimeError("the weight-sync group's first broadcast did not arrive")
    return group


@dataclass
class Group:
    """A weight-sync group: the process group and the TCPStore it was made from."""

    pg: Any
    store: Any


def broadcast(group: Group, buffer: torch.Tensor):
    """Start a broadcast of `buffer` from rank 0 of `group` (into it, on rank 1); returns the work."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.pg.broadcast([buffer], options)


def receive(group, bucket: WireBucket, device: torch.device) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """The engine's side of one bucket: receive its buffer, view its tensors."""
    buffer = torch.empty(max(bucket.nbytes, 1), dtype=torch.uint8, device=device)
    broadcast(group, buffer).wait()
    return buffer, bucket.views(buffer)
