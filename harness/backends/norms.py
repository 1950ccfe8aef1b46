"""L2 norms that are exact at real widths on the CPU: squares summed in float64, a chunk at a time.

torch's float32 norm on the CPU accumulates in float32 lanes: on 1e7 N(0, 1) elements it comes out 3.7e-4
low, on 1.3e8 (the gradient of a 32k x 4096 embedding) 1.3% low (torch 2.13, AVX2; suites/training/
test_ground_truth.py measures it). The tiny models' tensors (<= 1e5 elements) are exact to 1e-7 either way;
a real embedding's are not. Two places take a norm that the harness compares: the single-process ground
truth's pre-clip grad norm (harness.training.ground_truth) and megatron-core's fallback l2 norm, which the
CPU tier runs (no apex, no TE: `local_multi_tensor_l2_norm`, torch.norm per tensor; harness.backends.cpu_patches).
On CUDA megatron-core takes TE's (or apex's) multi-tensor kernel, and torch's CUDA norms reduce in a tree.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

# Elements squared per float64 chunk: the largest tensor (a 152k x 4096 embedding, 622 M elements) is
# converted 128 MiB at a time, never copied whole.
CHUNK = 1 << 24


def float64_l2_norm(tensors: Iterable[torch.Tensor]) -> float:
    """sqrt(sum of every element's square), the sum taken in float64."""
    total = 0.0
    for tensor in tensors:
        for chunk in tensor.detach().reshape(-1).split(CHUNK):
            total += float(chunk.double().square().sum())
    return math.sqrt(total)
