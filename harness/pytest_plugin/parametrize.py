"""Parametrization: every test that takes `device` runs once per selected device, and the
`layouts` / `layout_pairs` markers parametrize (device, layout) or (device, source, target)
jointly, because the layouts a CUDA machine can run depend on its GPU count."""
from __future__ import annotations

import pytest

from harness.parallel.layout import enumerate_layouts, parse_layout
from harness.pytest_plugin.collection import GPU_MARKER, gpu_count, selected_devices

CPU_LAYOUTS = ["tp1", "tp2", "pp2"]  # the CPU tier's 2-rank layouts


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" not in metafunc.fixturenames or _has_direct_param(metafunc, "device"):
        return
    pairs = metafunc.definition.get_closest_marker("layout_pairs")
    if pairs is not None:
        metafunc.parametrize(("device", "source", "target"), _device_pair_params(metafunc.config, pairs))
        return
    marker = metafunc.definition.get_closest_marker("layouts")
    if marker is not None:
        metafunc.parametrize(("device", "layout"), _device_layout_params(metafunc.config, marker))
        return
    params = [pytest.param(d, id=d, marks=_device_marks(d)) for d in selected_devices(metafunc.config)]
    metafunc.parametrize("device", params)


def _device_marks(device: str) -> list:
    return [getattr(pytest.mark, GPU_MARKER)] if device == "cuda" else []


def cuda_layouts(config: pytest.Config) -> list[str]:
    """Every valid layout of the machine's GPUs (all of them), plus tp1 on one GPU.
    Without GPUs: the CPU tier's 2-rank layouts, so `-m gpu` reports skips rather than nothing."""
    count = min(gpu_count(), config.getoption("--mrh-max-world-size") or 1 << 30)
    if count == 0:
        return list(CPU_LAYOUTS)
    names = ["tp1"] + [l.name for l in enumerate_layouts(count)] if count > 1 else ["tp1"]
    return list(dict.fromkeys(names))


def _device_layout_params(config: pytest.Config, marker: pytest.Mark) -> list:
    params = []
    for device in selected_devices(config):
        layouts = marker.kwargs.get(device, [])
        if layouts == "all":
            layouts = cuda_layouts(config) if device == "cuda" else list(CPU_LAYOUTS)
        params += [pytest.param(device, layout, id=f"{device}-{layout}", marks=_device_marks(device))
                   for layout in layouts]
    return params


def cuda_layout_pairs(config: pytest.Config) -> list[tuple[str, str]]:
    """Every ordered pair of distinct plain layouts (no sp, no vpp) of all the machine's GPUs."""
    plain = [name for name in cuda_layouts(config)
             if "sp" not in name and "vpp" not in name and parse_layout(name).world_size > 1]
    return [(a, b) for a in plain for b in plain if a != b]


def _device_pair_params(config: pytest.Config, marker: pytest.Mark) -> list:
    params = []
    for device in selected_devices(config):
        pairs = marker.kwargs.get(device, [])
        if pairs == "all":
            pairs = cuda_layout_pairs(config) if device == "cuda" else []
        params += [pytest.param(device, a, b, id=f"{device}-{a}-to-{b}", marks=_device_marks(device))
                   for a, b in pairs]
    return params


def _has_direct_param(metafunc: pytest.Metafunc, name: str) -> bool:
    return any(name in m.args[0] for m in metafunc.definition.iter_markers("parametrize") if m.args)
