"""Which layer spec the Megatron model is built with, always chosen, never picked up.

`te`: Transformer Engine's layer spec, what verl, NeMo-RL, slime and SkyRL train with (fused
LayerNorm+Linear, TE's attention backends, TE's norms). `local`: Megatron's own modules (torch ops).
Until issue 24 the harness switched to TE by itself whenever `import transformer_engine` worked:
with TE installed, fp32 parity then failed (TE's fp32 GEMMs run in TF32) and bf16 could no longer
see 1% bugs. Now the spec is a property of a world (`WorldBase(spec=...)`): its ranks build every
model with it (`current()`, read from the environment the world gives them), reports carry it in
a column, and pytest runs each CUDA test once per selected spec (`--mrh-spec`). The CPU tier is
`local` only: Transformer Engine has no CPU kernels.
"""
from __future__ import annotations

import importlib.util
import os

SPECS = ("te", "local")
ENV = "MRH_LAYER_SPEC"  # how a world tells its ranks their spec
CHOICES = ("auto", "te", "local", "both")  # --mrh-spec; auto: both where TE is installed, else local


class SpecError(ValueError):
    """A spec that does not exist, or that this device or machine cannot run."""


def installed() -> bool:
    """Transformer Engine is installed here (found, not imported: no CUDA work in the parent)."""
    return importlib.util.find_spec("transformer_engine") is not None


def for_world(device: str, spec: str | None) -> str:
    """The spec a world of `device` runs: `spec`, or `local` when None. TE only on CUDA."""
    spec = spec or "local"
    if spec not in SPECS:
        raise SpecError(f"unknown layer spec {spec!r}; choose from {', '.join(SPECS)}")
    if spec == "te" and device != "cuda":
        raise SpecError("the te layer spec runs on cuda only: Transformer Engine has no CPU kernels")
    return spec


def selected(choice: str, device: str) -> list[str]:
    """The specs a run covers on `device` for `--mrh-spec CHOICE`."""
    if choice not in CHOICES:
        raise SpecError(f"unknown --mrh-spec {choice!r}; choose from {', '.join(CHOICES)}")
    if device != "cuda":
        return ["local"]  # TE has no CPU kernels: the CPU tier is the local spec, whatever was asked
    if choice == "auto":
        return ["te", "local"] if installed() else ["local"]
    if choice in ("te", "both") and not installed():
        raise SpecError(f"--mrh-spec {choice} needs Transformer Engine, and `transformer_engine` is not installed")
    return ["te", "local"] if choice == "both" else [choice]


def current() -> str:
    """This process's spec: a rank's is its world's; anywhere else `local` unless set."""
    return for_world("cuda", os.environ.get(ENV) or "local")


def resolve(spec: str | None = None) -> str:
    """`spec`, or this process's (a rank's: its world's); never guessed from what is installed."""
    from harness.bridge.versions import te_available

    spec = spec or current()
    if spec not in SPECS:
        raise ValueError(f"spec must be one of {SPECS}, got {spec!r}")
    if spec == "te" and not te_available():
        raise RuntimeError("spec='te' requested but `import transformer_engine` fails")
    return spec
