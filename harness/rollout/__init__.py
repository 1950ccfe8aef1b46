"""Rollouts: an inference engine behind one interface, and the policy's weights synced into it.

    engine = HFEngine("tiny-qwen3")                      # or a local HF checkpoint dir
    sync_weights(policy, engine, bucket_bytes=64 << 20)  # from any layout, bucket by bucket
    rollouts = engine.generate(prompts, Sampling(n=4, max_tokens=8, seed=0))
"""
from harness.rollout.engine import EngineAsleep, RolloutEngine, Rollouts, Sampling
from harness.rollout.hf_engine import HFEngine
from harness.rollout.sync import DEFAULT_BUCKET_BYTES, IMPLEMENTED, SyncReport, engine_weight_diffs, sync_weights

__all__ = ["DEFAULT_BUCKET_BYTES", "EngineAsleep", "HFEngine", "IMPLEMENTED", "RolloutEngine", "Rollouts",
           "Sampling", "SyncReport", "engine_weight_diffs", "sync_weights"]
