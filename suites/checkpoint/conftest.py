"""The checkpoint suites' fixtures: the source checkpoints (made once per device and layout)."""
from __future__ import annotations

import pytest

from suites.checkpoint.common import CONFIG, K_STEPS, MODEL, train_batch


class SourceCheckpoint:
    """A saved source and what it did next without stopping: the step and the weights after it."""

    def __init__(self, directory, next_step, next_state, manifest):
        self.directory, self.next_step, self.next_state, self.manifest = directory, next_step, next_state, manifest


@pytest.fixture(scope="session")
def _sources():
    return {}


@pytest.fixture
def source_checkpoint(policy, device, tmp_path_factory, _sources):
    """`source_checkpoint(layout)`: K steps at `layout`, saved; plus the step after it and the
    weights after that step, without any save/load. Made once per (device, layout) per session."""

    def make(layout: str) -> SourceCheckpoint:
        if (device, layout) not in _sources:
            directory = tmp_path_factory.mktemp(f"src-{device}-{layout}") / "ckpt"
            source = policy(layout, MODEL, **CONFIG)
            source.steps([train_batch(i) for i in range(K_STEPS)])
            manifest = source.save(directory)
            next_step = source.step(train_batch(K_STEPS))
            next_state = source.hf_state_dict()
            source.close()
            _sources[(device, layout)] = SourceCheckpoint(directory, next_step, next_state, manifest)
        return _sources[(device, layout)]

    return make
