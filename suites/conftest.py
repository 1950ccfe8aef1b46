import pytest


@pytest.fixture(scope="session")
def hf_cache() -> dict:
    """HF reference logprobs, computed once per (model, dtype, device, batch, TP arrangement) for the
    session: the reference does not depend on anything else of the Megatron layout under test."""
    return {}


@pytest.fixture(scope="session")
def crash_cache() -> dict:
    """What crash-injection checks make once per session: the uninterrupted reference runs and the
    verdicts of fixed-path trials (shared by suites/checkpoint and suites/sensitivity)."""
    return {}


@pytest.fixture(scope="module")
def _module_reference_runs() -> dict:
    return {}


@pytest.fixture
def reference_runs(_module_reference_runs: dict, device: str, spec: str) -> dict:
    """A module's reference runs (made once, compared with by several tests), kept apart per device
    and layer spec: a TE run is not the local spec's reference (a cache keyed by layout alone once
    compared the local spec's offload run with TE's, on an H100, 2026-11-24)."""
    return _module_reference_runs.setdefault((device, spec), {})
