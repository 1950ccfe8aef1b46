import pytest


@pytest.fixture(scope="session")
def hf_cache() -> dict:
    """HF reference logprobs, computed once per (model, dtype, device, batch) for the session:
    the reference does not depend on the Megatron layout under test."""
    return {}
