"""Device backends: what a rank process needs to run Megatron-Core on its device."""
