"""What a session collects: the plugin's options and markers, the device variants it generates,
and keeping CUDA variants and nightly sweeps out of a run that does not ask for them.

A plain `pytest suites` is the CPU tier, and so is `pytest suites -m "not slow"` or `-m nightly`:
an expression that does not depend on `gpu` must not switch the CUDA variants on by accident.
Tests marked `nightly` (long sweeps) run only when `-m` names `nightly` or `--mrh-nightly` is given:
`pytest suites -m nightly` is the nightly sweep alone, `pytest suites --mrh-nightly` everything,
`pytest suites -m gpu --mrh-nightly` every CUDA variant including the sweeps.
"""
from __future__ import annotations

import itertools
import os

import pytest
from _pytest.mark.expression import Expression

DEVICES = ("cpu", "cuda")
GPU_MARKER = "gpu"
NIGHTLY_MARKER = "nightly"
MARKERS = {
    "gpu": "CUDA/NCCL variant of a test (select with -m gpu); skipped when too few GPUs",
    "slow": "takes more than ~30 s on 2 CPU cores",
    "nightly": "part of the nightly regression run",
    "upstream": "reproduces an upstream bug report",
    "crash_injection": "SIGKILLs training jobs (crash trials): on CUDA with both layer specs selected, the "
    "local spec's run nightly (CRASH_INJECTION_ON_CUDA says why)",
    "world_size(n)": "number of rank processes the test's world needs",
    "layouts(cpu=[...], cuda=[...] | 'all')": "parametrize (device, layout) jointly: the layouts "
    "each device runs; cuda='all' is every valid layout of the machine's GPUs",
    "layout_pairs(cpu=[(a, b), ...], cuda=[...] | 'all')": "parametrize (device, source, target): "
    "ordered layout pairs; cuda='all' is every ordered pair of the machine's plain layouts "
    "(no sp/vpp) of its full GPU count",
}
CRASH_INJECTION_MARKER = "crash_injection"
# The 1-GPU tier's time budget (issue 24: both specs in <= 15 min): a CUDA crash trial starts a
# training job of its own, 8-25 s each on an H100. Crash injection tests the order of file
# operations around a save; what a layer spec changes is the state saved (TE's extra state, TE's
# FusedAdam), which the tier's checkpoint suites compare on both specs and every crash trial on TE
# carries. So with both specs selected the GPU tier crashes jobs on TE's spec (what users train
# with), the local spec's CUDA crash trials run nightly, and the local spec's crash trials run in
# every CI run on the CPU tier (every fault point, every rotation variant).
CRASH_INJECTION_ON_CUDA = ("te",)
_SELECTS_GPU = pytest.StashKey[bool]()
_SELECTS_NIGHTLY = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("megatron-rl-harness")
    group.addoption("--mrh-devices", default="cpu,cuda",
                    help="comma list of device variants to generate (cpu, cuda). Default: both; "
                         "cuda variants still need -m gpu.")
    group.addoption("--mrh-max-world-size", type=int, default=None,
                    help="skip tests whose world needs more ranks (default: 4 on CPU, #GPUs on cuda)")
    group.addoption("--mrh-timeout", type=float, default=300.0,
                    help="seconds one call on the ranks may take before every rank's stack is "
                         "dumped and the world restarted (default 300)")
    group.addoption("--mrh-launcher", default="process", choices=["process", "ray"],
                    help="how worlds start their ranks: local processes (default) or Ray actors "
                         "(a local Ray instance for the session unless --mrh-ray-address or RAY_ADDRESS)")
    group.addoption("--mrh-ray-address", default=None,
                    help="attach the Ray launcher to this cluster (default $RAY_ADDRESS, else a local instance)")
    group.addoption("--mrh-ray-placement", default="STRICT_PACK",
                    choices=["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"],
                    help="placement group strategy of the Ray launcher's rank bundles (default STRICT_PACK)")
    group.addoption("--mrh-cpu-isa", default=None, choices=["avx2", "native"],
                    help="CPU kernels of every process of the run: avx2 (default, or $MRH_CPU_ISA: the same "
                         "bits on any x86-64 machine) or native (the machine's own; results hold on it "
                         "only). harness.backends.cpu_arithmetic says why")
    group.addoption("--mrh-spec", default="auto", choices=["auto", "te", "local", "both"],
                    help="layer specs the CUDA variants run on: te (Transformer Engine), local (Megatron's "
                         "own modules), both; auto (default): both where transformer_engine is installed, "
                         "else local. The CPU tier is local: TE has no CPU kernels (harness.bridge.specs)")
    group.addoption("--mrh-bridge", default=None, choices=["auto", "mbridge", "megatron-bridge"],
                    help="the bridge (and so the megatron-core line) every world loads models with: mbridge "
                         "(megatron-core 0.16), megatron-bridge (megatron-core 0.19), auto: the one usable in "
                         "this environment (default: $MRH_BRIDGE, else auto; harness.bridge.backends)")
    group.addoption("--mrh-other-stack", default=None, metavar="PYTHON",
                    help="the Python of the other stack's environment (e.g. .venv-b/bin/python): the "
                         "cross-stack checks write with one stack and read with the other; without it they skip")
    group.addoption("--mrh-nightly", action="store_true",
                    help="also run the tests marked nightly (long sweeps; -m nightly runs them alone)")
    group.addoption("--mrh-report-dir", default=os.environ.get("MRH_REPORT_DIR", "reports/runs"),
                    help="directory for run reports: each run writes DIR/<timestamp>-<id>/ "
                         "(default reports/runs or $MRH_REPORT_DIR)")
    # No environment variable on purpose: pytester's inner sessions inherit the environment and
    # would all write (and move) the outer run's directory.
    group.addoption("--mrh-run-dir", default=None,
                    help="this run's report directory itself, instead of a new one under "
                         "--mrh-report-dir (`make test` uses reports/runs/latest); a previous run "
                         "found there is first moved beside it under its timestamped name")


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """Pin the CPU kernels before any conftest runs code (a conftest's import may run a torch op,
    which fixes torch's choice for the process); the ranks inherit the environment."""
    from harness.backends import cpu_arithmetic, cuda_precision

    try:
        cpu_arithmetic.pin(early_config.known_args_namespace.mrh_cpu_isa)
    except (ValueError, cpu_arithmetic.ArithmeticPinError) as exc:
        raise pytest.UsageError(f"--mrh-cpu-isa: {exc}") from None
    try:  # fp32 means fp32 on CUDA (TF32 off), before CUDA starts here or in a rank
        cuda_precision.pin()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    selected_devices(config)  # a bad --mrh-devices is a usage error before collection
    selected_bridge(config)  # and a bridge this environment cannot run
    if "cuda" in selected_devices(config):
        selected_specs(config, "cuda")  # and --mrh-spec te without TE installed
    markexpr = config.getoption("markexpr") or ""
    config.stash[_SELECTS_GPU] = selects_gpu(markexpr)
    config.stash[_SELECTS_NIGHTLY] = bool(config.getoption("--mrh-nightly")) or names_nightly(markexpr)


def selected_devices(config: pytest.Config) -> list[str]:
    devices = [d.strip() for d in config.getoption("--mrh-devices").split(",") if d.strip()]
    unknown = sorted(set(devices) - set(DEVICES))
    if unknown:
        raise pytest.UsageError(f"--mrh-devices: unknown device(s) {unknown}; choose from {DEVICES}")
    return devices


def selected_bridge(config: pytest.Config) -> str:
    """The session's bridge (`--mrh-bridge`, else $MRH_BRIDGE, else auto), put in the environment
    every world hands its ranks (harness.launch.base reads it there)."""
    from harness.bridge import backends

    choice = config.getoption("--mrh-bridge") or os.environ.get(backends.ENV) or "auto"
    try:
        bridge = backends.for_world(choice)
    except backends.BridgeChoiceError as exc:
        raise pytest.UsageError(f"--mrh-bridge: {exc}") from None
    os.environ[backends.ENV] = bridge
    return bridge


def selected_specs(config: pytest.Config, device: str) -> list[str]:
    """The layer specs the `device` variants run on (harness.bridge.specs.selected)."""
    from harness.bridge import specs

    try:
        return specs.selected(config.getoption("--mrh-spec"), device)
    except specs.SpecError as exc:
        raise pytest.UsageError(str(exc)) from None


def gpu_count() -> int:
    """CUDA devices this process may use (0 without CUDA); torch is imported only when asked."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def selects_gpu(markexpr: str) -> bool:
    """Whether the `-m` expression asks for `gpu`: some combination of the other markers it names
    makes it False without `gpu` and True with it (`gpu`, `gpu and not slow`, `nightly and gpu`).
    `not slow`, `nightly` or an empty expression do not: their answer never depends on `gpu`.

    Evaluated with pytest's own expression machinery, so it reads `-m` exactly as pytest does.
    """
    if not markexpr.strip():
        return False
    try:
        expression = Expression.compile(markexpr)
    except SyntaxError as exc:
        raise pytest.UsageError(f"-m {markexpr!r}: not a valid marker expression ({exc})") from exc
    names = _identifiers(expression)
    others = sorted(names - {GPU_MARKER})
    return any(not _evaluate(expression, set(present)) and _evaluate(expression, {*present, GPU_MARKER})
               for size in range(len(others) + 1) for present in itertools.combinations(others, size))


def names_nightly(markexpr: str) -> bool:
    """Whether the `-m` expression asks about `nightly` at all (then pytest's own `-m` decides)."""
    if not markexpr.strip():
        return False
    return NIGHTLY_MARKER in _identifiers(Expression.compile(markexpr))


def _evaluate(expression: Expression, present: set[str], seen: set[str] | None = None) -> bool:
    """The expression's value for an item carrying exactly the markers in `present`."""
    def matcher(name: str, /, **kwargs) -> bool:
        if seen is not None:
            seen.add(name)
        return name in present

    return expression.evaluate(matcher)


def _identifiers(expression: Expression) -> set[str]:
    """Every marker name the expression can ask about. `and`/`or` short-circuit, so one evaluation
    does not see them all: evaluate under every combination of the names seen so far until no new
    name appears (newer pytest has Expression.idents(); this works on every pytest 8 and 9)."""
    seen: set[str] = {GPU_MARKER}
    while True:
        known = sorted(seen)
        for size in range(len(known) + 1):
            for present in itertools.combinations(known, size):
                _evaluate(expression, set(present), seen)
        if len(seen) == len(known):
            return seen


def _crash_injection_tier(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark nightly the CUDA crash-injection items of a spec outside CRASH_INJECTION_ON_CUDA, when
    a spec inside it is selected too (a run of the local spec alone keeps them)."""
    if not set(CRASH_INJECTION_ON_CUDA) & set(selected_specs(config, "cuda")):
        return
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (item.get_closest_marker(CRASH_INJECTION_MARKER) and params.get("device") == "cuda"
                and params.get("spec") not in CRASH_INJECTION_ON_CUDA):
            item.add_marker(NIGHTLY_MARKER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the CUDA variants unless `-m` selects `gpu`, and the nightly sweeps unless asked
    for (then pytest's own `-m` decides)."""
    if "cuda" in config.getoption("--mrh-devices").split(","):
        _crash_injection_tier(config, items)
    off = [marker for marker, on in ((GPU_MARKER, config.stash[_SELECTS_GPU]),
                                     (NIGHTLY_MARKER, config.stash[_SELECTS_NIGHTLY])) if not on]
    if not off:
        return
    kept, dropped = [], []
    for item in items:
        (dropped if any(item.get_closest_marker(m) for m in off) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
