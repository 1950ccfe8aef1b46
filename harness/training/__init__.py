"""RL training: the batch, the policy loss and the single-process ground-truth trainer.

These names are pure PyTorch (no torch.distributed, no Megatron): safe to import in the pytest
parent process. The rank-side Megatron workers live in `harness.training.policy` (PolicyWorker)
and `harness.training.reference` (ReferenceWorker); their parent-side handles, `PolicyHandle` and
`ReferenceHandle`, are exported here but imported on first use (`harness.training.handles` pulls in
transformers and the model zoo, which `import harness.training` should not pay for).
"""
from harness.training.ground_truth import GroundTruthTrainer, megatron_lr_lambda, policy_logprobs
from harness.training.loss import (
    AGGREGATIONS,
    aggregate,
    clipped_surrogate,
    k3_kl,
    loss_counts,
    rl_loss,
)
from harness.training.rl_data import RLTrainBatch, concat_train_batches, make_rl_train_batch

_LAZY = {"PolicyHandle": "harness.training.handles", "ReferenceHandle": "harness.training.handles"}

__all__ = [
    "AGGREGATIONS", "GroundTruthTrainer", "PolicyHandle", "RLTrainBatch", "ReferenceHandle", "aggregate",
    "clipped_surrogate", "concat_train_batches", "k3_kl", "loss_counts", "make_rl_train_batch", "megatron_lr_lambda",
    "policy_logprobs", "rl_loss",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
