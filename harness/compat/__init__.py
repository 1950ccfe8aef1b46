"""Version-gated workarounds for third-party bugs: one module per library.

Each module lists its workarounds with the upstream bug and the versions they were verified on,
and refuses (one clear error) to apply one on a version nobody has checked it against.
mbridge's fixes live in `harness.bridge.mbridge_compat`; the CPU backend
(`harness.backends.cpu_patches`) is a port of Megatron-Core to CPU, not a bug workaround.
"""
