"""Layouts switch inside one live world: Megatron state is initialized and destroyed per layout,
the rank processes stay the same, and a bad layout is one clear error before any rank works."""
from __future__ import annotations

import pytest

from harness.parallel.layout import LayoutError
from harness.parallel.state import run_in_layout
from harness.probe import ProbeSpec

pytestmark = pytest.mark.world_size(2)


def _parallel_sizes(layout) -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
    }


def _is_initialized() -> bool:
    from megatron.core import parallel_state as ps

    return ps.model_parallel_is_initialized()


@pytest.mark.parametrize("name, tp, pp, dp", [("tp2", 2, 1, 1), ("pp2", 1, 2, 1), ("tp1", 1, 1, 2), ("tp2", 2, 1, 1)])
def test_layout_switch_reuses_the_rank_processes(world, name, tp, pp, dp):
    pids = world.pids
    sizes = run_in_layout(world, name, _parallel_sizes)
    assert [(s["tp"], s["pp"], s["dp"]) for s in sizes] == [(tp, pp, dp)] * 2
    # Rank r sits at position r of the only model-parallel dimension that is > 1.
    positions = [s["tp_rank"] + s["pp_rank"] for s in sizes]
    assert positions == ([0, 1] if dp == 1 else [0, 0])
    assert world.pids == pids
    assert world.run(_is_initialized) == [False, False], "layout state must be destroyed on exit"


@pytest.mark.parametrize("bad, message", [
    ("tp3", "tp\\*pp\\*cp = 3 does not divide 2"),
    ("tp4", "world size 2"),
    ("pp2vpp4", "num_layers=4"),
])
def test_bad_layout_is_one_clear_error_before_any_work(world, bad, message):
    calls = world.calls
    with pytest.raises(LayoutError, match=message):
        run_in_layout(world, bad, _parallel_sizes, model=ProbeSpec())
    assert world.calls == calls, "no call may reach the ranks for an invalid layout"


def test_heads_not_divisible_by_tp_is_rejected(world):
    spec = ProbeSpec(num_attention_heads=3, num_query_groups=3, hidden_size=48)
    with pytest.raises(LayoutError, match="num_attention_heads=3"):
        run_in_layout(world, "tp2", _parallel_sizes, model=spec)


def _group_count(layout) -> int:
    from torch.distributed import distributed_c10d

    return len(distributed_c10d._world.pg_map)


def test_revisiting_a_layout_reuses_its_process_groups(world):
    """Groups are created on a layout's first use only: a long session must not accumulate them
    (on 4x H200, re-creating them per switch ended in an NCCL error after ~100 switches)."""
    for name in ("tp2", "pp2", "tp1"):
        run_in_layout(world, name, _group_count)
    settled = run_in_layout(world, "tp2", _group_count)
    for name in ("pp2", "tp1", "tp2", "pp2"):
        run_in_layout(world, name, _group_count)
    assert run_in_layout(world, "tp2", _group_count) == settled


def _gloo_loops_and_groups(layout) -> tuple[int, int]:
    from torch.distributed import distributed_c10d

    from harness.compat.torch import gloo_loop_threads

    return gloo_loop_threads(), len(distributed_c10d._world.pg_map)


def test_a_ranks_gloo_groups_share_one_event_loop_thread(world, device):
    """harness.compat.torch.GLOO_SHARED_DEVICE: stock c10d gives each gloo group its own TCP device and loop
    thread (waking every 10 ms); after three layouts a CPU rank holds dozens of groups and one loop."""
    if device != "cpu":
        pytest.skip("the shared gloo device is installed on the CPU tier only (harness.launch.rank)")
    for name in ("tp2", "pp2", "tp1"):
        run_in_layout(world, name, _group_count)
    counts = run_in_layout(world, "tp2", _gloo_loops_and_groups)
    assert all(loops == 1 and groups > 10 for loops, groups in counts), counts
