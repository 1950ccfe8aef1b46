"""A checkpoint directory every rank must see (harness.checkpoint.shared_fs): on one machine it always
is; a rank that cannot read the driver's probe (a node without the shared filesystem) is one clear
error before anything is written. The cross-node pass: suites/launch/test_two_nodes.py."""
from __future__ import annotations

import pytest

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.shared_fs import require_shared


class _TwoNodes:
    """A world whose rank 1 runs on a node that does not mount the driver's directory."""

    nodes = [{"host": "node-a", "ip": "10.0.0.1"}, {"host": "node-b", "ip": "10.0.0.2"}]

    def run(self, fn, path, token):
        return [fn(path, token), fn(path.replace("/", "/not-mounted/", 1), token)]


def test_a_rank_that_cannot_see_the_directory_is_refused_before_anything_is_written(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match=r"rank 1 on node-b \(10.0.0.2\) cannot see this directory.*"
                                              r"shared.*nothing was written"):
        require_shared(_TwoNodes(), root)
    assert list(tmp_path.iterdir()) == []  # the probe is gone, the root was not made


@pytest.mark.world_size(2)
def test_every_rank_of_a_world_on_one_machine_sees_it(world, tmp_path):
    require_shared(world, tmp_path / "not-yet" / "ckpt")  # the nearest existing parent is probed
    assert list(tmp_path.iterdir()) == []
