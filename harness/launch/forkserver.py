"""One forkserver per process, with the heavy modules imported once, that rank and driver processes
fork from: a CUDA world's rank (harness.launch.world, start_method "forkserver") and a crash trial's
driver (harness.checkpoint.crash) then start in about a second instead of importing torch,
megatron-core and Transformer Engine afresh (24.5 s on an H100 host, 2026-11-24).

The forkserver never starts CUDA: it is started with PYTORCH_NVML_BASED_CUDA_CHECK=1, so an import
that asks `torch.cuda.is_available()` asks NVML, and its imports do not call cuInit (checked on that
host with cuDeviceGetCount, which answers "not initialized" after all of them). A process forked
from it may therefore start CUDA, or fork CUDA ranks of its own.

A forkserver's child has the forkserver, not the process that asked for it, as its parent, and the
environment the forkserver started with: `World` hands its ranks the caller's environment and
watches for the caller through the forkserver (which exits when its last client does).
"""
from __future__ import annotations

import multiprocessing as mp
import os

# Imported by `preload` below in the forkserver; harmless where a module is missing.
MODULES = ("torch", "torch.distributed", "megatron.core", "megatron.core.dist_checkpointing", "mbridge",
           "transformers", "transformer_engine.pytorch", "harness.training.policy", "harness.training.handles",
           "harness.checkpoint.checkpointer", "harness.checkpoint.crash")
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # "1": torch.cuda.is_available() asks NVML, not CUDA
_context = None


def context():
    """The multiprocessing context of this process's preloaded forkserver (started on first use)."""
    global _context
    if _context is None:
        # Before the forkserver starts (it inherits the environment): see the module docstring.
        os.environ[NVML_CHECK] = "1"
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(["harness.launch.preload"])
    return _context

