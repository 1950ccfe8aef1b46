"""Which bridge converts HF weights to Megatron-Core and back: a dimension of a run, never picked up
by accident.

`mbridge`: ISEEKYAN's mbridge 0.15.1 on megatron-core 0.16.x (what the harness has always used).
`megatron-bridge`: NVIDIA's Megatron-Bridge 0.6 on megatron-core 0.19.x (what verl, NeMo-RL and SkyRL
pin today). Each needs its own environment (Megatron-Bridge and megatron-core >= 0.17 need Python
3.12; mbridge cannot build models on megatron-core >= 0.17). A world carries its bridge to its ranks
in the environment (`ENV`), as it carries its layer spec; `auto` is the one bridge installed here.
Parent-side: nothing here imports megatron (package metadata only).
"""
from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

BACKENDS = ("mbridge", "megatron-bridge")
ENV = "MRH_BRIDGE"  # how a world tells its ranks their bridge
CHOICES = ("auto", *BACKENDS)
# The megatron-core line each bridge builds models with (mbridge: `ModelType.encoder_and_decoder`,
# removed in 0.17; Megatron-Bridge 0.6: `megatron.training` of the 0.19 wheels).
MCORE_LINE = {"mbridge": ("0.16",), "megatron-bridge": ("0.19",)}


class BridgeChoiceError(ValueError):
    """A bridge that does not exist, or that this environment cannot run."""


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def installed() -> dict[str, str | None]:
    """The installed version of each bridge and of megatron-core (None: not installed)."""
    return {name: _version(name) for name in (*BACKENDS, "megatron-core")}


def usable() -> list[str]:
    """The bridges installed here together with a megatron-core of their line."""
    found = installed()
    mcore = found["megatron-core"]
    line = ".".join((mcore or "").split(".")[:2])
    return [name for name in BACKENDS if found[name] and line in MCORE_LINE[name]]


def for_world(choice: str | None) -> str:
    """The bridge a world runs for `--mrh-bridge CHOICE` (None: `auto`)."""
    choice = choice or "auto"
    if choice not in CHOICES:
        raise BridgeChoiceError(f"unknown bridge {choice!r}; choose from {', '.join(CHOICES)}")
    found = usable()
    if choice == "auto":
        if len(found) != 1:
            have = ", ".join(f"{k} {v}" for k, v in installed().items() if v) or "none"
            raise BridgeChoiceError(f"cannot choose a bridge: {len(found)} usable here (installed: {have}); "
                                    f"name one of {', '.join(BACKENDS)}")
        return found[0]
    if choice not in found:
        have = installed()
        raise BridgeChoiceError(f"bridge {choice!r} cannot run here: {choice} {have[choice] or 'not installed'}, "
                                f"megatron-core {have['megatron-core'] or 'not installed'} (it needs megatron-core "
                                f"{' or '.join(MCORE_LINE[choice])}.x)")
    return choice


def current() -> str:
    """This process's bridge: a rank's is its world's; anywhere else the one usable here."""
    return os.environ.get(ENV) or for_world("auto")
