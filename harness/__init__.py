"""megatron-rl-harness: proves Megatron-Core is a correct training backend for RL post-training."""
