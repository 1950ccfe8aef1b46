"""Parametrization: every test that takes `device` runs once per selected backend, a (device,
layer spec) pair: `cpu` (the local spec), and on CUDA once per selected spec (`cuda-te`,
`cuda-local`; `--mrh-spec`). The `layouts` / `layout_pairs` markers parametrize (device, spec,
layout) or (device, spec, source, target) jointly, because the layouts a CUDA machine can run
depend on its GPU count. The test's spec is its `spec` fixture (added to every test taking
`device`), which its worlds build models with. An entry of a device's list may be a
`pytest.param(layout, marks=...)` (a pair: `pytest.param(source, target, marks=...)`): its marks go on
that device's case, e.g. `pytest.mark.nightly` to run a layout of a sweep nightly only, the test id
unchanged."""
from __future__ import annotations

import pytest
from _pytest.mark.structures import ParameterSet

from harness.parallel.layout import enumerate_layouts, parse_layout
from harness.pytest_plugin.collection import GPU_MARKER, gpu_count, selected_devices, selected_specs

CPU_LAYOUTS = ["tp1", "tp2", "pp2"]  # the CPU tier's 2-rank layouts


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" not in metafunc.fixturenames or _has_direct_param(metafunc, "device"):
        return
    if "spec" not in metafunc.fixturenames:
        metafunc.fixturenames.append("spec")
    pairs = metafunc.definition.get_closest_marker("layout_pairs")
    if pairs is not None:
        metafunc.parametrize(("device", "spec", "source", "target"), _device_pair_params(metafunc.config, pairs))
        return
    marker = metafunc.definition.get_closest_marker("layouts")
    if marker is not None:
        metafunc.parametrize(("device", "spec", "layout"), _device_layout_params(metafunc.config, marker))
        return
    params = [pytest.param(d, s, id=name, marks=_device_marks(d)) for d, s, name in backends(metafunc.config)]
    metafunc.parametrize(("device", "spec"), params)


def backends(config: pytest.Config, device: str | None = None) -> list[tuple[str, str, str]]:
    """(device, spec, id) of every selected backend (of `device` only, if given): the CPU tier's
    id stays `cpu` (it has one spec), CUDA's names its spec."""
    found = []
    for d in selected_devices(config) if device is None else [device]:
        specs = selected_specs(config, d)
        found += [(d, s, d if d != "cuda" else f"{d}-{s}") for s in specs]
    return found


def _device_marks(device: str) -> list:
    return [getattr(pytest.mark, GPU_MARKER)] if device == "cuda" else []


def _entry(entry) -> tuple:
    """(value, marks) of one entry of a `layouts`/`layout_pairs` list: a layout or pair as is, or a
    `pytest.param(...)` of one (its marks, e.g. nightly, go on that case)."""
    if isinstance(entry, ParameterSet):
        return (entry.values[0] if len(entry.values) == 1 else tuple(entry.values)), list(entry.marks)
    return entry, []


def cuda_layouts(config: pytest.Config) -> list[str]:
    """Every valid layout of the machine's GPUs (all of them), plus tp1 on one GPU.
    Without GPUs: the CPU tier's 2-rank layouts, so `-m gpu` reports skips rather than nothing."""
    count = min(gpu_count(), config.getoption("--mrh-max-world-size") or 1 << 30)
    if count == 0:
        return list(CPU_LAYOUTS)
    names = ["tp1"] + [l.name for l in enumerate_layouts(count)] if count > 1 else ["tp1"]
    return list(dict.fromkeys(names))


def spare_gpu_layouts(config: pytest.Config) -> list[str]:
    """The layouts that leave the machine a GPU of its own for a separate rollout engine (its last):
    tp1, and every layout of half the GPUs when that leaves one spare (4 GPUs: the 2-rank layouts).
    Without a spare GPU: tp1 only (the test skips, saying why)."""
    count = min(gpu_count(), config.getoption("--mrh-max-world-size") or 1 << 30)
    half = count // 2
    names = ["tp1"] + ([l.name for l in enumerate_layouts(half)] if half > 1 and half < gpu_count() else [])
    return list(dict.fromkeys(names))


def _device_layout_params(config: pytest.Config, marker: pytest.Mark) -> list:
    params = []
    for device, spec, name in backends(config):
        layouts = marker.kwargs.get(device, [])
        if layouts == "all":
            layouts = cuda_layouts(config) if device == "cuda" else list(CPU_LAYOUTS)
        elif layouts == "spare-gpu" and device == "cuda":  # a separate engine's placement
            layouts = spare_gpu_layouts(config)
        for layout, marks in map(_entry, layouts):
            params.append(pytest.param(device, spec, layout, id=f"{name}-{layout}",
                                       marks=_device_marks(device) + marks))
    return params


def cuda_layout_pairs(config: pytest.Config) -> list[tuple[str, str]]:
    """Every ordered pair of distinct plain layouts (no sp, no vpp) of all the machine's GPUs."""
    plain = [name for name in cuda_layouts(config)
             if "sp" not in name and "vpp" not in name and parse_layout(name).world_size > 1]
    return [(a, b) for a in plain for b in plain if a != b]


def _device_pair_params(config: pytest.Config, marker: pytest.Mark) -> list:
    params = []
    for device, spec, name in backends(config):
        pairs = marker.kwargs.get(device, [])
        if pairs == "all":
            pairs = cuda_layout_pairs(config) if device == "cuda" else []
        for (a, b), marks in map(_entry, pairs):
            params.append(pytest.param(device, spec, a, b, id=f"{name}-{a}-to-{b}",
                                       marks=_device_marks(device) + marks))
    return params


def _has_direct_param(metafunc: pytest.Metafunc, name: str) -> bool:
    return any(name in m.args[0] for m in metafunc.definition.iter_markers("parametrize") if m.args)
