"""Storages, not tensors: what offloading frees, and how to tell two tensors share memory.

A DDP buffer's parameters, `main_grad`s, bucket views and (fp32) the optimizer's main shards are
views of one storage each. Freeing the storage (`untyped_storage().resize_(0)`) frees them all and
resizing it back revives every view with its offset; rebinding a tensor (`t = t.cpu()`) frees
nothing while any view is alive. So everything here works on storages:

- `storage_id` is the StorageImpl's address: the same across views and across `resize_`. Not
  `data_ptr()`, which is 0 for every freed storage and changes on a CUDA reload.
- `readable` says whether a tensor's bytes exist. On the CPU, reading a tensor whose storage was
  resized to 0 does not raise: it segfaults the process (torch 2.13), so every check compares
  sizes before contents.
"""
from __future__ import annotations

import torch

ALLOCATOR_ROUNDING = 512  # CUDA caching allocator: every block is a multiple of 512 bytes


def storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def nbytes(t: torch.Tensor) -> int:
    """Bytes the tensor's storage holds now (0 once freed)."""
    return t.untyped_storage().nbytes()


def readable(t: torch.Tensor) -> bool:
    return nbytes(t) >= (t.storage_offset() + t.numel()) * t.element_size() if t.numel() else True


def whole(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the tensor's entire storage: copying it copies every view's bytes."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def rounded(n: int, device: torch.device | str) -> int:
    """What a storage of n bytes costs the device: CUDA rounds blocks up to 512 bytes."""
    if torch.device(device).type != "cuda" or n == 0:
        return n
    return -(-n // ALLOCATOR_ROUNDING) * ALLOCATOR_ROUNDING


def host_buffer(n: int, pinned: bool) -> torch.Tensor:
    """n host bytes, page-locked when the copy is from a GPU. Always a new storage: on the CPU tier
    `t.cpu()` is `t` itself (and pin_memory the identity), so a "shadow" made that way would be the
    very storage the offload frees."""
    return torch.empty(n, dtype=torch.uint8, device="cpu", pin_memory=pinned)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
