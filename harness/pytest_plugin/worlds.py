"""The world fixtures: the session's persistent worlds (one per size, device and layer spec), a
test's world, private worlds for tests that break theirs, and the skip for a world the machine
cannot hold. A test's layer spec (`spec`, parametrized with `device`, harness.pytest_plugin.
parametrize) is the spec of every world it gets, from a fixture or from the pool directly."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest

from harness.launch import WorldPool, make_world
from harness.launch.base import WorldBase
from harness.parallel.layout import Layout, LayoutError, parse_layout
from harness.pytest_plugin.collection import gpu_count

CPU_MAX_WORLD_SIZE = 4  # 4 ranks on a 2-core CI machine is the most the CPU tier plans for
_POOL_KEY = pytest.StashKey[WorldPool]()


def world_kwargs(config: pytest.Config) -> dict:
    """What every world of this session is started with: the launcher and its options."""
    kwargs = {"launcher": config.getoption("--mrh-launcher"), "timeout": config.getoption("--mrh-timeout")}
    if kwargs["launcher"] == "ray":
        kwargs["placement"] = config.getoption("--mrh-ray-placement")
    return kwargs


def pytest_configure(config: pytest.Config) -> None:
    kwargs = world_kwargs(config)
    if kwargs["launcher"] == "ray":
        from harness.launch import ensure_ray

        ensure_ray(config.getoption("--mrh-ray-address"))  # once per session
    config.stash[_POOL_KEY] = WorldPool(**kwargs)


def pytest_unconfigure(config: pytest.Config) -> None:
    pool = config.stash.get(_POOL_KEY, None)
    if pool is not None:
        pool.close()
        if pool.launcher == "ray":
            from harness.launch import shutdown_ray

            shutdown_ray()


def session_worlds(config: pytest.Config) -> list[dict]:
    """Each world this session started: launcher, size, device, spec and what its ranks reported."""
    pool = config.stash.get(_POOL_KEY, None)
    return [{"launcher": w.launcher, "size": w.size, "device": w.device, "spec": w.spec, "starts": w.starts,
             "start_method": getattr(w, "start_method", None), **w.facts}  # Ray worlds have none
            for w in (pool.worlds() if pool is not None else []) if w.starts]


@pytest.fixture(scope="session")
def world_pool(pytestconfig: pytest.Config) -> WorldPool:
    """The session's persistent worlds, one per (size, device)."""
    return pytestconfig.stash[_POOL_KEY]


def _max_world_size(config: pytest.Config, device: str) -> int:
    configured = config.getoption("--mrh-max-world-size")
    if configured is not None:
        return configured
    return gpu_count() if device == "cuda" else CPU_MAX_WORLD_SIZE


def _requested_world_size(request: pytest.FixtureRequest) -> int:
    marker = request.node.get_closest_marker("world_size")
    if marker is not None:
        return int(marker.args[0])
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if "layout" in params:
        layout = params["layout"]
        return (layout if isinstance(layout, Layout) else parse_layout(str(layout))).world_size
    raise pytest.UsageError(
        f"{request.node.nodeid}: the world fixture needs @pytest.mark.world_size(n) "
        "or a 'layout' parameter to know how many ranks to start"
    )


@contextmanager
def skip_invalid_layout() -> Iterator[None]:
    """A layout the test's model cannot take (tp4 on 2 KV heads, pp4vpp2 on 4 layers: `cuda="all"`
    enumerates layouts without a model) skips the test with the layout error, instead of failing it."""
    try:
        yield
    except LayoutError as exc:
        pytest.skip(str(exc).replace("\n", " "))


def skip_unless_converted(model: str) -> None:
    """Skip the test when this run's bridge refuses `model`'s family by name (a family one stack cannot
    build: suites/bridge/test_preflight.py holds the refusal itself)."""
    from harness.bridge.backends import current
    from harness.bridge.preflight import bridge_converts

    if not bridge_converts(model):
        pytest.skip(f"the {current()} bridge does not convert {model} (suites/bridge/test_preflight.py: refused)")


def skip_unless_fits(config: pytest.Config, size: int, device: str) -> None:
    """Skip the test (with the reason) when a world of `size` ranks does not fit on `device`.
    Shared by every fixture that starts or borrows a world (here and in `workers`)."""
    limit = _max_world_size(config, device)
    if size > limit:
        what = "GPUs available" if device == "cuda" else "--mrh-max-world-size"
        pytest.skip(f"needs a world of {size} {device} ranks; {what}: {limit}")


@pytest.fixture
def spec() -> str:
    """The layer spec of a test's worlds; tests taking `device` get it as a parameter (cpu: local,
    cuda: each selected spec), the others build no model on a spec of their choosing: local."""
    return "local"


@pytest.fixture(autouse=True)
def _test_spec(request: pytest.FixtureRequest) -> None:
    """Worlds a test takes from the pool without naming a spec (benches, runners, workers) get
    the test's own."""
    if "device" in request.fixturenames:
        pool = request.config.stash[_POOL_KEY]
        pool.spec[request.getfixturevalue("device")] = request.getfixturevalue("spec")


@pytest.fixture
def world(request: pytest.FixtureRequest, world_pool: WorldPool, device: str, spec: str) -> WorldBase:
    """The persistent world for this test's size, device and layer spec (started on first use)."""
    size = _requested_world_size(request)
    skip_unless_fits(request.config, size, device)
    return world_pool.get(size, device, spec)


@pytest.fixture
def fresh_world(request: pytest.FixtureRequest, world_pool: WorldPool, device: str, spec: str):
    """A factory of private worlds (`fresh_world(size)`), for tests that stop or break their world;
    skipped like `world` when the machine is too small, closed at teardown."""
    made: list[WorldBase] = []

    def make(size: int, **kwargs) -> WorldBase:
        skip_unless_fits(request.config, size, device)
        if world_pool.exclusive(device):
            world_pool.release(device)  # the session's worlds hold the GPUs under Ray
        made.append(make_world(size, device, **{**world_kwargs(request.config), "spec": spec, **kwargs}))
        return made[-1]

    yield make
    for world in made:
        world.close()
