import pytest


@pytest.fixture(scope="session")
def hf_cache() -> dict:
    """HF reference logprobs, computed once per (model, dtype, device, batch, TP arrangement)."""
    return {}
