"""Each resident worker owns its RNG streams (harness.training.rng).

Two dropout policies on one world, their steps interleaved, with a default-seed `run_in_layout`
(which reseeds Megatron's RNG and draws from every stream) and a new handle (built and seeded) in
between: each policy's losses, grad norms and weights equal, bit for bit, the same policy run
alone. Before per-worker streams, every one of those reseeded or advanced the one process-global
stream a resident policy drew its dropout masks from.
"""
from __future__ import annotations

import random

import pytest
import torch

from harness.models import TINY_VOCAB_SIZE
from harness.parallel.state import run_in_layout
from harness.training import make_rl_train_batch

# Deterministic kernels: bit-exact comparisons on CUDA (atomics make e.g. embedding backward vary).
# CUDA: tp2 forks the tracker's tensor-parallel stream; tp1 also runs on a one-GPU machine.
CONFIG = dict(lr=1e-3, micro_batches=2, dropout=0.1, deterministic=True,
              loss_kwargs=dict(kl_coef=0.05, clip_eps_high=0.28))
SEEDS = {"a": 11, "b": 22}


def _batch(step: int):
    return make_rl_train_batch(TINY_VOCAB_SIZE, batch_size=4, seed=50 + step, prompt_lengths=[3, 6, 2, 8],
                               response_lengths=[9, 5, 12, 4])


def _draw_everywhere(layout) -> None:
    """A caller outside the handles (run with the default seed): draws from every stream."""
    import numpy as np

    random.random()
    np.random.rand()
    torch.rand(3)
    if torch.cuda.is_available():
        torch.rand(3, device="cuda")


def _process_rng(layout) -> list:
    """This rank's process-level RNG states, comparable across calls (seed=None: untouched)."""
    from harness.training.rng import capture

    state = capture()
    return [state["random"], [s.tolist() if hasattr(s, "tolist") else s for s in state["numpy"]],
            state["torch"].tolist(), None if state["cuda"] is None else state["cuda"].tolist(),
            {name: s.tolist() for name, s in state["tracker"].items()}]


def _alone(policy, layout, seed):
    """The policy's two steps with nothing in between: [(loss, grad_norm)], weights."""
    p = policy(layout, seed=seed, **CONFIG)
    steps = [p.step(_batch(i)) for i in range(2)]
    state = p.hf_state_dict()
    p.close()
    return [(s["loss"], s["grad_norm"]) for s in steps], state


@pytest.mark.layouts(cpu=["tp2"], cuda=["tp2", "tp1"])
def test_interleaved_dropout_policies_each_equal_their_run_alone(policy, device, layout, report):
    a = policy(layout, seed=SEEDS["a"], **CONFIG)
    b = policy(layout, seed=SEEDS["b"], **CONFIG)
    got = {"a": [a.step(_batch(0))], "b": [b.step(_batch(0))]}
    run_in_layout(a.world, layout, _draw_everywhere)  # default seed: reseeds, then draws
    got["a"].append(a.step(_batch(1)))
    policy(layout, seed=33, **CONFIG)  # a new handle: built (drawing) and seeded in between
    got["b"].append(b.step(_batch(1)))
    states = {"a": a.hf_state_dict(), "b": b.hf_state_dict()}
    a.close(), b.close()

    for name, handle_seed in SEEDS.items():
        want_steps, want_state = _alone(policy, layout, handle_seed)
        steps = [(s["loss"], s["grad_norm"]) for s in got[name]]
        differing = sorted(n for n in want_state if not torch.equal(want_state[n], states[name][n]))
        exact = steps == want_steps and not differing
        report.add("bit_exact", float(exact), tolerance=1.0, passed=exact, claim="exact", layout=layout, dropout=0.1,
                   policy=name, tensors_differing=len(differing))
        assert steps == want_steps, f"policy {name}: interleaved {steps} vs alone {want_steps}"
        assert not differing, f"policy {name}: weights differ from its run alone in {differing[:5]}"
    # The streams matter: a's and b's dropout masks differ, and so do their losses.
    assert got["a"][0]["loss"] != got["b"][0]["loss"]


@pytest.mark.layouts(cpu=["tp2"], cuda=["tp2", "tp1"])
def test_handles_leave_the_process_rng_as_it_was(policy, reference, device, layout):
    """Building a policy, a step (dropout draws), an export, building a reference: the process's
    own streams (what callers outside handles use) are exactly as before."""
    first = reference(layout)  # only to have the world up before the first snapshot
    run_in_layout(first.world, layout, _draw_everywhere, seed=None)  # off any seed's start
    before = run_in_layout(first.world, layout, _process_rng, seed=None)
    p = policy(layout, **CONFIG)
    reference(layout)
    p.step(_batch(0))
    p.hf_state_dict()
    after = run_in_layout(first.world, layout, _process_rng, seed=None)
    assert after == before
