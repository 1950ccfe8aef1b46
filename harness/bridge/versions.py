"""Which Megatron-Core / mbridge / Transformer Engine this process has, and whether the pair works."""
from __future__ import annotations

import functools
import importlib.util
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

TESTED_MCORE = "0.16.1"
TESTED_MBRIDGE = "0.15.1"
# mbridge 0.15.1's get_model compares against ModelType.encoder_and_decoder, which Megatron-Core
# 0.17 removed: every model build fails there with an AttributeError deep inside mbridge.
FIRST_BROKEN_MCORE = Version("0.17")


class UnsupportedVersionError(RuntimeError):
    """The installed Megatron-Core / mbridge pair is known not to work together."""


def mcore_version() -> str:
    """megatron-core's release (package_info.__version__ without a local '+...' part). 0.19 appends
    `+<git short hash>` of whatever git repository its install directory sits in: a .venv-b inside
    the harness's checkout read as '0.19.2+1cd4970', and every version gate refused it (the first
    fresh-clone CI run, 2026-11-25)."""
    from megatron.core import package_info

    return package_info.__version__.split("+", 1)[0]


def mbridge_version() -> str:
    try:
        return version("mbridge")
    except PackageNotFoundError:
        return "not installed"


def check_supported_versions() -> None:
    """Raise UnsupportedVersionError for a Megatron-Core that mbridge cannot build models with."""
    mcore = mcore_version()
    # By release number: 0.17.0rc0 and 0.17.0.dev0 (Megatron-LM main) sort before 0.17 but are broken.
    if Version(mcore).release[:2] >= FIRST_BROKEN_MCORE.release[:2]:
        raise UnsupportedVersionError(
            f"megatron-core {mcore} with mbridge {mbridge_version()} is not supported: mbridge's "
            f"get_model uses ModelType.encoder_and_decoder, removed in megatron-core "
            f"{FIRST_BROKEN_MCORE}. The tested pair is megatron-core {TESTED_MCORE} + mbridge "
            f"{TESTED_MBRIDGE} (0.16.1 is also the newest megatron-core for Python 3.11); "
            "mbridge is being deprecated in favour of Megatron-Bridge.")


@functools.cache
def te_available() -> bool:
    """True when `import transformer_engine` works (then the TE layer spec is used by default)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a broken TE install (e.g. CUDA mismatch) counts as absent
        return False
    return True


@functools.cache
def fused_softmax_kernels_available() -> bool:
    """Megatron's fused masked-softmax CUDA extensions (built with Megatron-LM/apex, not pip)."""
    return all(importlib.util.find_spec(name) is not None for name in (
        "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
        "scaled_softmax_cuda"))
