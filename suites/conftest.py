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


class _BorrowedPool:
    """The session's world pool lent to a command run in process: its `get` is the session pool's, with
    the command's own `echo_output` (`mrh parity` and `mrh repro` keep rank output off their stdout)
    while the command runs; its `close` gives that back and leaves the session's worlds open."""

    def __init__(self, pool, echo_output: bool = True, **_world_kwargs):
        self._pool, self._echo, self._lent = pool, echo_output, {}

    @property
    def spec(self) -> dict[str, str]:
        return self._pool.spec

    def get(self, *args, **kwargs):
        world = self._pool.get(*args, **kwargs)
        self._lent.setdefault(id(world), (world, world.echo_output))
        world.echo_output = self._echo
        return world

    def close(self) -> None:
        for world, echo in self._lent.values():
            world.echo_output = echo
        self._lent.clear()


@pytest.fixture
def cli_on_session_worlds(monkeypatch, world_pool):
    """`mrh parity` and `mrh repro` run in this process on the session's worlds: their WorldPool is the
    session's (what each would start is a world of the same size, device and spec). The command's own
    code, output and exit code are what is checked; the console script's launch is test_preflight's
    `test_mrh_parity_command_exits_2_with_one_line`, which runs the real `mrh` (a fresh world there cost
    ~17 s a run on the CI machine)."""
    import harness.launch
    import harness.parity.cli

    def borrowed(**world_kwargs):
        return _BorrowedPool(world_pool, **world_kwargs)

    monkeypatch.setattr(harness.parity.cli, "WorldPool", borrowed)
    monkeypatch.setattr(harness.launch, "WorldPool", borrowed)  # harness.variants.cli imports it in main
