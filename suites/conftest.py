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


@pytest.fixture(scope="session")
def other_stack_python(pytestconfig: pytest.Config) -> str:
    """The other stack's Python (`--mrh-other-stack`; `make test` passes it): the cross-stack checks
    skip without it, and fail with one clear error when it names no working interpreter."""
    import shutil
    import subprocess

    python = pytestconfig.getoption("--mrh-other-stack")
    if not python:
        pytest.skip("no --mrh-other-stack PYTHON: the cross-stack checks need the other stack's environment")
    found = shutil.which(python)
    if found is None:
        pytest.fail(f"--mrh-other-stack {python}: no such executable (make setup builds .venv-b)", pytrace=False)
    probe = subprocess.run([found, "-c", "import harness, megatron.core"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.fail(f"--mrh-other-stack {python}: cannot import the harness and megatron-core there:\n"
                    f"{probe.stderr[-2000:]}", pytrace=False)
    return found
