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
