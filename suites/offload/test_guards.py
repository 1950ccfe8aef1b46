"""What may not happen while something is offloaded, and what is a no-op.

- Reading an offloaded component raises `OffloadedError` naming it, never reads a freed storage
  (on the CPU that would segfault the rank): a step, an export, a save, a load, the main params,
  reference logprobs. After a reload all of them work.
- Offloading the grads inside an open accumulation is REFUSED (`OffloadRefused`): grads are
  discarded by an offload, and the accumulated ones would be lost (Megatron-LM PR 7383 / NeMo-RL
  PR 4147). Nothing changes; the step finishes as if never interrupted.
- Offloading while an async checkpoint save is not finalized is refused; once finalized, the
  offload frees what it frees with no save at all (SkyRL 565, NeMo-RL 3322). So does one after a
  sync save.
- Bad input is one clear error before any work.
"""
from __future__ import annotations

import pytest

from harness.checkpoint.checkpointer import Checkpointer
from harness.checkpoint.resume_check import train_batch
from harness.offload import OffloadedError, OffloadRefused
from harness.offload.check import CONFIG, MODEL
from suites.checkpoint.conftest import layout_for


def _freed(rows_per_rank) -> list[dict[str, int]]:
    return [{r["component"]: r["measured_bytes"] for r in rows} for rows in rows_per_rank]


def test_reading_an_offloaded_component_raises_naming_it(policy, device, tmp_path):
    worker = policy(layout_for(device), MODEL, **CONFIG)
    worker.step(train_batch(0))
    worker.save(tmp_path / "ckpt")
    worker.offload(params=True, grads=False, optimizer=False)
    with pytest.raises(OffloadedError, match="a training step needs the params"):
        worker.step(train_batch(1))
    with pytest.raises(OffloadedError, match="a weight export needs the params"):
        worker.hf_state_dict()
    with pytest.raises(OffloadedError, match="a checkpoint save needs the params"):
        worker.save(tmp_path / "other")
    assert not (tmp_path / "other").exists()  # refused before any work
    with pytest.raises(OffloadedError, match="a checkpoint load needs the params"):
        worker.load(tmp_path / "ckpt")
    worker.reload(params=True, grads=False, optimizer=False)
    worker.offload(params=False, grads=False, optimizer=True)
    with pytest.raises(OffloadedError, match="the optimizer"):
        worker.call("replica_divergence")
    with pytest.raises(OffloadedError, match=r"reload\(optimizer=True\) first"):
        worker.begin_step(train_batch(1))
    worker.reload()
    worker.step(train_batch(1))
    worker.load(tmp_path / "ckpt")


def test_offloading_grads_inside_an_open_accumulation_is_refused(policy, device):
    layout = layout_for(device)
    plain = policy(layout, MODEL, **CONFIG)
    want = plain.step(train_batch(0))
    want_state = plain.hf_state_dict()
    plain.close()
    worker = policy(layout, MODEL, **CONFIG)
    worker.begin_step(train_batch(0))
    worker.accumulate([0])
    with pytest.raises(OffloadRefused, match="open gradient accumulation"):
        worker.offload()
    assert all(a[c]["state"] == "resident" for a in worker.offload_accounting() for c in ("params", "grads", "optimizer"))
    worker.offload(params=True, grads=False, optimizer=True)  # the grads stay: allowed
    with pytest.raises(OffloadedError):
        worker.accumulate([1])
    worker.reload(params=True, grads=False, optimizer=True)
    worker.accumulate([1])
    got = worker.finish_step()
    assert (got["loss"], got["grad_norm"]) == (want["loss"], want["grad_norm"])
    state = worker.hf_state_dict()
    assert all((state[k] == want_state[k]).all() for k in want_state)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_an_offload_after_a_save_frees_what_it_frees_without_one(policy, device, tmp_path, async_save, report):
    layout = layout_for(device)
    plain = policy(layout, MODEL, **CONFIG)
    plain.step(train_batch(0))
    without = _freed(plain.offload())
    plain.close()
    worker = policy(layout, MODEL, **CONFIG)
    worker.step(train_batch(0))
    ckpt = Checkpointer(worker, tmp_path / "root", async_save=async_save, keep=2)
    ckpt.save()
    if async_save:
        with pytest.raises(OffloadRefused, match="async checkpoint save is not finalized"):
            worker.offload()
        ckpt.wait()
    after_save = _freed(worker.offload())
    for rank, (a, b) in enumerate(zip(after_save, without)):
        for component, freed in b.items():
            report.add("freed_after_save_minus_without_bytes", a[component] - freed, tolerance=0,
                       passed=a[component] == freed, claim="exact", layout=layout, rank=rank, component=component,
                       async_save=async_save, freed_bytes=a[component])
    assert after_save == without
    worker.reload()
    ckpt.close()


def test_a_closed_policy_frees_its_device_memory_at_once(policy, device):
    """Closing a handle frees what its worker held, at once: the persistent world runs test after
    test. megatron-core 0.16.1's DDP keeps itself alive through backward hooks on autograd nodes
    (a cycle the gc cannot collect), so the drop frees the storages itself (handles._drop)."""
    from harness.offload.check import live_workers

    worker = policy(layout_for(device), MODEL, **CONFIG)
    worker.step(train_batch(0))
    worker.offload()
    worker.reload()
    accounts = worker.offload_accounting()
    held = [sum(a[c]["theory_device_bytes"] for c in ("params", "grads", "optimizer")) for a in accounts]
    buffers = [a["params"]["theory_bytes"] + a["grads"]["theory_bytes"] for a in accounts]
    before = worker.world.run(live_workers)
    worker.close()
    after = worker.world.run(live_workers)
    for rank, (b, a) in enumerate(zip(before, after)):
        assert a["workers"] == b["workers"] - 1, (rank, b, a)
        assert a["ddp_buffer_bytes"] <= b["ddp_buffer_bytes"] - buffers[rank], (rank, b, a)
        if device == "cuda":
            assert b["allocated_bytes"] - a["allocated_bytes"] >= held[rank] > 0, (rank, b, a, held[rank])


def test_bad_requests_are_one_clear_error(policy, reference, device):
    worker = policy("tp1", MODEL, **CONFIG)
    with pytest.raises(ValueError, match="name at least one component"):
        worker.offload(params=False, grads=False, optimizer=False)
    with pytest.raises(TypeError):
        reference("tp1", MODEL).offload(grads=True)
    from harness.variants import VariantError

    with pytest.raises(VariantError, match="is a training variant"):
        policy("tp1", MODEL, offload_variant="no-finalize-grads")
    with pytest.raises(VariantError, match="unknown variant"):
        policy("tp1", MODEL, offload_variant="nope")
