"""The harness as a pytest plugin (entry point `pytest11`: megatron_rl_harness).

One test body, two devices: a test that takes `device` (directly or through `world`) runs once on
CPU/gloo and once on CUDA/NCCL; the CUDA variant carries the `gpu` marker and is deselected unless
the run's `-m` expression selects `gpu` (`pytest suites -m gpu`). Worlds are persistent per
(size, device) for the whole session (per xdist worker: each worker is its own process with its
own store port).

This module only names the plugin's parts; pytest registers each of them as a plugin of its own
(`pytest_plugins` of a registered plugin module is honoured), so every part keeps its own hooks.
"""
pytest_plugins = (
    "harness.pytest_plugin.collection",
    "harness.pytest_plugin.parametrize",
    "harness.pytest_plugin.worlds",
    "harness.pytest_plugin.reporting",
    "harness.pytest_plugin.workers",
)
