"""The checkpoint suites' fixtures: the source checkpoints (made once per device and layout)."""
from __future__ import annotations

import pytest

from harness.checkpoint.resume_check import train_and_save


@pytest.fixture(scope="session")
def _sources():
    return {}


@pytest.fixture
def source_checkpoint(policy, device, spec, tmp_path_factory, _sources):
    """`source_checkpoint(layout)`: K steps at `layout`, saved; plus the step after it and the
    weights after that step, without any save/load (harness.checkpoint.resume_check.Uninterrupted).
    Made once per (device, layer spec, layout) per session."""

    def make(layout: str):
        if (device, spec, layout) not in _sources:
            directory = tmp_path_factory.mktemp(f"src-{device}-{spec}-{layout}") / "ckpt"
            _sources[(device, spec, layout)] = train_and_save(policy, layout, directory)
        return _sources[(device, spec, layout)]

    return make


def layout_for(device: str) -> str:
    """Where the async-checkpoint suites run: dp2 (two ranks: fully parallel saves split the
    writes); on a machine of one GPU, tp1."""
    from harness.pytest_plugin.collection import gpu_count

    return "dp2" if device == "cpu" or gpu_count() >= 2 else "tp1"
