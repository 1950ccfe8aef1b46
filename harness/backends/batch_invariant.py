"""Megatron's batch-invariant kernels for a policy's calls (`PolicyConfig.batch_invariant`; the exact
tier of issue 35): the same sequence gives the same bits alone or inside any batch.

megatron-core ships them in `megatron/core/transformer/custom_layers/batch_invariant_kernels.py`
(0.16.1 and 0.19.2; adapted from Thinking Machines' batch_invariant_ops): Triton kernels whose
reduction order does not depend on the batch, switched on process-wide by
`enable_batch_invariant_mode()`. Megatron-LM's training script calls that; megatron-core itself
never does. What the switch covers (read in both versions' source):

- aten::mm and aten::addmm -> a persistent Triton matmul (fixed tiles, fp32 accumulation): the local
  spec's linear layers (and the output layer);
- aten::_log_softmax and aten::mean.dim -> Triton kernels with a fixed reduction order: the
  RMSNorm's mean of squares (the harness's LocalRMSNorm). The harness's logprobs are megatron-core's
  vocab_parallel_cross_entropy (max, exp, sum: torch reductions the switch does not patch, whose CUDA
  reduction order follows the row count); with the switch on at tp 1 they are `log_softmax` instead
  (harness.logprobs.vocab_parallel), one of the switch's kernels;
- with Transformer Engine importable: TE's `general_gemm` (every TE linear layer's GEMM, as the
  same Triton matmul), `te.RMSNorm.forward` (the final norm, QK-norm) and, on 0.19.2 only,
  `apply_normalization` (the RMSNorm TE fuses into LayerNormLinear: input_layernorm and
  pre_mlp_layernorm of the TE spec). On 0.16.1 that fused norm stays TE's kernel, whose reduction
  strategy depends on the row count (megatron-core 0.19.2's own comment: 1 bf16 ulp per layer, seen
  on GB200): the TE spec on stack A is not fully covered.

Not covered by the switch: attention. `TransformerConfig.batch_invariant_mode` is the other half: it
makes the attention run FlashAttention with one split (`num_splits=1`) and asserts
`attention_backend == flash` (0.19.2 also flash_attention_version 3 or 4, no context parallelism, no
attention dropout). The GPU image has no flash-attn package (TE finds no FlashAttention 2/3 to run,
vLLM's own vllm_flash_attn is not one TE can load), so the harness does not set it: the TE spec's
attention is TE's choice (cuDNN's fused attention or TE's unfused one; TE 2.20.2's
DotProductAttention defaults to num_splits=1 anyway, and that flag filters only FlashAttention), the
local spec's is torch's baddbmm/softmax/bmm (none of them patched). Whether those are batch-invariant
is what the exact tier's GPU tests measure (suites/rollout/test_exact.py); nothing here claims it.

The switch is process-wide (it registers aten kernels), and a persistent world's rank runs many
tests' workers: `batch_invariance(on)` turns it on for one call and off after (nested calls keep it
on). The kernels run on CUDA only (Triton; the aten kernels are registered for the accelerator's
dispatch key): `check(device)` refuses anything else before a worker is built.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

class BatchInvarianceUnavailable(RuntimeError):
    """megatron-core's batch-invariant kernels cannot be loaded here (no Triton)."""


def check(device: str) -> None:
    """Refuse a batch-invariant policy on anything but CUDA (one clear error, before any rank works)."""
    if str(device).split(":")[0] != "cuda":  # "cuda" or "cuda:0"
        raise ValueError("batch_invariant=True needs CUDA: megatron-core's batch-invariant kernels are Triton "
                         f"kernels registered for the GPU's dispatch key (harness.backends.batch_invariant); "
                         f"this world runs on {device!r}")


def kernels():
    """megatron-core's batch_invariant_kernels module (0.16.1 imports Triton at the top, 0.19.2 lazily)."""
    try:
        from megatron.core.transformer.custom_layers import batch_invariant_kernels as module
    except ImportError as error:
        raise BatchInvarianceUnavailable(f"megatron-core's batch-invariant kernels need Triton: {error}") from None
    if not getattr(module, "HAVE_TRITON", True):
        raise BatchInvarianceUnavailable("megatron-core's batch-invariant kernels need Triton, which is not installed")
    return module


def active() -> bool:
    """Whether megatron-core's batch-invariant kernels are on in this process now (never imports them:
    on the CPU tier, without Triton, the answer is False)."""
    import sys

    module = sys.modules.get("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    return bool(module is not None and module.is_batch_invariant_mode_enabled())


@contextmanager
def batch_invariance(on: bool) -> Iterator[None]:
    """Megatron's batch-invariant kernels for the duration (off after, unless already on)."""
    if not on:
        yield
        return
    module = kernels()
    if module.is_batch_invariant_mode_enabled():
        yield
        return
    try:
        module.enable_batch_invariant_mode()
    except ImportError:
        # No Transformer Engine: the aten kernels were registered before TE's patch failed to import it.
        if not module.is_batch_invariant_mode_enabled():
            raise
    try:
        yield
    finally:
        try:
            module.disable_batch_invariant_mode()
        except ImportError:  # 0.16.1's unpatch looks for TE's modules; the aten kernels are gone already
            pass

