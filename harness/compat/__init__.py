"""Version-gated workarounds for third-party bugs: one module per library.

Each module lists its workarounds with the upstream bug and the versions they were verified on,
and refuses (one clear error) to apply one on a version nobody has checked it against.
mbridge's fixes live in `harness.bridge.mbridge_compat`; the CPU backend
(`harness.backends.cpu_patches`) is a port of Megatron-Core to CPU, not a bug workaround.
"""
from __future__ import annotations


def refuse_unverified(error: type[Exception], library: str, found: str | None, name: str,
                      verified_on: tuple[str, ...], how: str) -> None:
    """Raise `error` unless `found` (the installed version of `library`) is one a workaround was
    verified on; `how` says how to re-verify it."""
    if found not in verified_on:
        raise error(f"{name}: verified on {library} {', '.join(verified_on)}, this is {found}; re-verify "
                    f"({how}) before adding it")
