"""RL training: the batch, the policy loss and the single-process ground-truth trainer.

These names are pure PyTorch (no torch.distributed, no Megatron): safe to import in the pytest
parent process. The rank-side Megatron workers live in `harness.training.policy` (PolicyWorker)
and `harness.training.reference` (ReferenceWorker).
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

__all__ = [
    "AGGREGATIONS", "GroundTruthTrainer", "RLTrainBatch", "aggregate", "clipped_surrogate",
    "concat_train_batches", "k3_kl", "loss_counts", "make_rl_train_batch", "megatron_lr_lambda",
    "policy_logprobs", "rl_loss",
]
