"""Per-token logprobs under the project-wide convention (see `harness.data.rl_batch`).

`hf` is the HF reference; `shifted_token_outputs` turns any backend's next-token logits into that
convention, so every backend shares the same shift/mask/float32 code.
"""
from harness.logprobs.hf import hf_logprobs, hf_token_outputs, hf_top1, shifted_token_outputs

__all__ = ["hf_logprobs", "hf_token_outputs", "hf_top1", "shifted_token_outputs"]
