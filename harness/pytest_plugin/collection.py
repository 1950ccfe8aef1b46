"""What a session collects: the plugin's options and markers, the device variants it generates,
and keeping CUDA variants out of a plain `pytest suites` (the CPU tier)."""
from __future__ import annotations

import os

import pytest

DEVICES = ("cpu", "cuda")
GPU_MARKER = "gpu"
MARKERS = {
    "gpu": "CUDA/NCCL variant of a test (select with -m gpu); skipped when too few GPUs",
    "slow": "takes more than ~30 s on 2 CPU cores",
    "nightly": "part of the nightly regression run",
    "upstream": "reproduces an upstream bug report",
    "world_size(n)": "number of rank processes the test's world needs",
    "layouts(cpu=[...], cuda=[...] | 'all')": "parametrize (device, layout) jointly: the layouts "
    "each device runs; cuda='all' is every valid layout of the machine's GPUs",
    "layout_pairs(cpu=[(a, b), ...], cuda=[...] | 'all')": "parametrize (device, source, target): "
    "ordered layout pairs; cuda='all' is every ordered pair of the machine's plain layouts "
    "(no sp/vpp) of its full GPU count",
}


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
    group.addoption("--mrh-report-dir", default=os.environ.get("MRH_REPORT_DIR", "reports/runs"),
                    help="directory for run reports (default reports/runs or $MRH_REPORT_DIR)")


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    selected_devices(config)  # a bad --mrh-devices is a usage error before collection


def selected_devices(config: pytest.Config) -> list[str]:
    devices = [d.strip() for d in config.getoption("--mrh-devices").split(",") if d.strip()]
    unknown = sorted(set(devices) - set(DEVICES))
    if unknown:
        raise pytest.UsageError(f"--mrh-devices: unknown device(s) {unknown}; choose from {DEVICES}")
    return devices


def gpu_count() -> int:
    """CUDA devices this process may use (0 without CUDA); torch is imported only when asked."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without an explicit -m, CUDA variants are deselected: a plain `pytest suites` is the CPU tier."""
    if config.getoption("markexpr"):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker(GPU_MARKER) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
