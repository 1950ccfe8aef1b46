"""The CPU backend answers each CUDA assumption Megatron-Core makes (shared notes, megatron-on-cpu)."""
from __future__ import annotations

import pytest


def _cuda_assumptions() -> dict:
    import torch

    made = torch.empty(3, device="cuda")
    moved = torch.ones(2).cuda()
    ordinal = torch.arange(4, device=torch.cuda.current_device())
    torch.cuda.synchronize()
    torch.cuda.manual_seed(7)
    first = torch.rand(3)
    torch.cuda.manual_seed(7)
    second = torch.rand(3)
    return {
        "devices": {made.device.type, moved.device.type, ordinal.device.type},
        "float_type": torch.ones(1).type(),
        "half_type": torch.ones(1, dtype=torch.half).type(),
        "explicit_type_cast": str(torch.ones(1).type(torch.float64).dtype),
        "seed_reproducible": bool((first == second).all()),
    }


def _rng_tracker_forks_cleanly() -> bool:
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    from harness.parallel.state import model_parallel

    with model_parallel("tp2"):
        model_parallel_cuda_manual_seed(11)
        before = torch.get_rng_state()
        with get_cuda_rng_tracker().fork():
            inside = torch.rand(2)
        after = torch.get_rng_state()
        with get_cuda_rng_tracker().fork():
            inside_again = torch.rand(2)
    # The fork restores the default stream and advances the model-parallel stream.
    return bool(torch.equal(before, after)) and not bool(torch.equal(inside, inside_again))


def test_cuda_calls_land_on_cpu_inside_cpu_ranks(world_pool):
    world = world_pool.get(2, "cpu")
    for answer in world.run(_cuda_assumptions):
        assert answer == {
            "devices": {"cpu"},
            "float_type": "torch.cuda.FloatTensor",
            "half_type": "torch.cuda.HalfTensor",
            "explicit_type_cast": "torch.float64",
            "seed_reproducible": True,
        }


def test_megatron_rng_tracker_forks_on_cpu(world_pool):
    assert world_pool.get(2, "cpu").run(_rng_tracker_forks_cleanly) == [True, True]


def _ok_in_a_fresh_interpreter(code: str) -> None:
    """Run `code` in a throwaway interpreter (the patches are process-wide); it must print "ok"."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_patches_install_and_uninstall_cleanly():
    """In a throwaway interpreter: install changes behaviour, uninstall restores every original."""
    code = (
        "import torch; from harness.backends import cpu_patches as p; orig = torch.cuda.current_device; "
        "p.install(); assert torch.empty(1, device='cuda').device.type == 'cpu'; p.uninstall(); "
        "assert torch.cuda.current_device is orig and not p.is_installed(); "
        "assert torch.ones(1).type() == 'torch.FloatTensor'; print('ok')"
    )
    _ok_in_a_fresh_interpreter(code)


def test_new_empty_takes_int_sizes_and_still_maps_a_cuda_device():
    """`t.new_empty(*sizes)` (HF's DeepSeek-V3 MLA) keeps its int sizes; `to(0)` and a 'cuda' device still
    land on the CPU (in a throwaway interpreter, as above)."""
    code = (
        "import torch; from harness.backends import cpu_patches as p; p.install(); t = torch.ones(1); "
        "assert t.new_empty(2, 1, 3).shape == (2, 1, 3); assert t.new_zeros(2, 3).shape == (2, 3); "
        "assert t.new_empty((2,), device='cuda').device.type == 'cpu'; assert t.to(0).device.type == 'cpu'; "
        "p.uninstall(); print('ok')"
    )
    _ok_in_a_fresh_interpreter(code)


def _megatron_grad_norms(sizes: list[int]) -> list[tuple[float, float, float]]:
    """megatron-core's fp32 grad norm (the one its optimizer clips by) of one N(0, 1) tensor per size, with
    the float64 norm and megatron-core's own fallback (torch.norm per tensor) of the same tensor."""
    import torch
    from megatron.core import utils
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    from harness.parallel.state import model_parallel

    out = []
    with model_parallel("tp1"):
        from megatron.core import parallel_state as ps

        for size in sizes:
            grad = torch.randn(size, generator=torch.Generator().manual_seed(size))
            fallback = float(utils.local_multi_tensor_l2_norm(None, None, [[grad]], False)[0])
            norm = get_grad_norm_fp32([grad], grad_stats_parallel_group=ps.get_model_parallel_group())
            out.append((norm, grad.double().norm().item(), fallback))
    return out


def test_megatron_grad_norm_is_exact_at_real_widths_and_unchanged_on_tiny_tensors(world_pool):
    """The fallback l2 norm megatron-core uses without apex or TE sums float32 on the CPU: 1e7 elements come out
    3.7e-4 low (harness.backends.norms). Inside a CPU rank a tensor past 2**16 elements is summed in float64; a
    tiny model's (<= 2**16) keeps the fallback's own bits, and with them the committed RL trajectories."""
    (small, large), = world_pool.get(1, "cpu").run(_megatron_grad_norms, [4096, 10**7])
    norm, exact, fallback = small
    assert norm == pytest.approx(fallback, rel=1e-7) and norm == pytest.approx(exact, rel=1e-6)
    norm, exact, fallback = large
    assert abs(fallback - exact) / exact > 1e-4  # what the fallback alone gives (the check can fail)
    assert norm == pytest.approx(exact, rel=1e-7)
