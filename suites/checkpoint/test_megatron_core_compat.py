"""The megatron-core workarounds (harness.compat.megatron_core) apply only on the versions they
were verified on; on any other one they refuse with one clear error before any state changes."""
from __future__ import annotations

import pytest
import torch

from harness.compat import megatron_core as compat
from harness.checkpoint.resume_check import CONFIG, MODEL, train_batch


class _FakeDistributedOptimizer:
    """What the workarounds touch of a DistributedOptimizer: its inner torch optimizer."""

    def __init__(self):
        self.optimizer = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])


@pytest.fixture
def version(monkeypatch):
    from megatron.core import package_info

    def set_version(value: str) -> None:
        monkeypatch.setattr(package_info, "__version__", value)

    return set_version


def test_every_workaround_is_verified_on_the_installed_version():
    compat.require(*compat.WORKAROUNDS)  # the pinned megatron-core: raises if any is not
    assert all(w.verified_on and w.bug for w in compat.WORKAROUNDS)


def test_a_vcs_suffix_is_not_a_version(version):
    """megatron-core 0.19 appends `+<git hash>` of the repository its install directory sits in (a
    venv inside a checkout): the gates read the release."""
    version("0.19.2+1cd4970")
    assert compat.mcore_version() == "0.19.2"
    compat.require(*compat.WORKAROUNDS)


@pytest.mark.parametrize("workaround", compat.WORKAROUNDS, ids=lambda w: w.name)
def test_an_unverified_version_is_refused(version, workaround):
    version("0.16.2")
    with pytest.raises(compat.UnverifiedMegatronCoreError, match=rf"megatron-core 0\.16\.2: .*{workaround.name}"):
        compat.require(workaround)


def test_the_patches_check_the_gate_before_touching_anything(version):
    fake = _FakeDistributedOptimizer()
    version("0.17.0")
    with pytest.raises(compat.UnverifiedMegatronCoreError):
        compat.ensure_optimizer_state(fake)
    with pytest.raises(compat.UnverifiedMegatronCoreError):
        compat.load_optimizer_state_dict(fake, {})
    assert not fake.optimizer.state  # nothing was applied

    version("0.16.1")
    compat.ensure_optimizer_state(fake)  # applied: a never-stepped Adam gets its state tensors
    (state,) = fake.optimizer.state.values()
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and float(state["step"]) == 0.0


def _set_mcore_version(worker, value: str) -> str:
    from megatron.core import package_info

    previous, package_info.__version__ = package_info.__version__, value
    return previous


def test_a_load_on_an_unverified_version_fails_before_the_policy_changes(policy, device, tmp_path):
    source = policy("tp2", MODEL, **CONFIG)
    source.step(train_batch(0))
    source.save(tmp_path / "ckpt")
    target = policy("tp2", MODEL, **CONFIG)
    before = target.hf_state_dict()
    previous = target.apply(_set_mcore_version, "0.16.2")[0]
    try:
        with pytest.raises(compat.UnverifiedMegatronCoreError, match="never-stepped-adam"):
            target.load(tmp_path / "ckpt")
    finally:
        target.apply(_set_mcore_version, previous)
    after = target.hf_state_dict()
    assert target.position()["steps_done"] == 0 and all(torch.equal(before[n], after[n]) for n in before)
    target.load(tmp_path / "ckpt")  # and on the verified version the same load goes through
    assert target.position()["steps_done"] == 1


def test_tensors_pickle_as_torch_does_for_a_process_without_megatron(monkeypatch):
    """`TORCH_PICKLE_OWNER`: with megatron-core 0.19's replacement of torch.storage._load_from_bytes
    (simulated here on any version), a pickled tensor names megatron.core; under `torch_pickling`
    it names torch.storage and loads back equal."""
    import pickle

    import torch.storage as storage

    def safe_load_from_bytes(b):  # what megatron-core 0.19 installs
        raise AssertionError("not reached: the payload must not name this")

    safe_load_from_bytes.__module__ = "megatron.core.safe_globals"
    safe_load_from_bytes.__qualname__ = "safe_load_from_bytes"
    monkeypatch.setattr(storage, "_load_from_bytes", safe_load_from_bytes)
    import sys
    import types

    module = types.ModuleType("megatron.core.safe_globals")
    module.safe_load_from_bytes = safe_load_from_bytes
    monkeypatch.setitem(sys.modules, "megatron.core.safe_globals", module)
    tensor = torch.arange(6.0).reshape(2, 3)
    assert b"megatron.core.safe_globals" in pickle.dumps(tensor)
    monkeypatch.setattr(compat, "mcore_version", lambda: compat.TORCH_PICKLE_OWNER.verified_on[0])
    with compat.torch_pickling():
        payload = pickle.dumps(tensor)
    assert b"megatron" not in payload and storage._load_from_bytes is safe_load_from_bytes
    monkeypatch.undo()  # torch's own loader back, as in the engine's process
    assert torch.equal(pickle.loads(payload), tensor)


@pytest.mark.parametrize("module", ["megatron_bridge", "transformer_engine"])
def test_other_libraries_workarounds_refuse_an_unverified_version(module, monkeypatch):
    """Megatron-Bridge's and TE's workarounds are gated like megatron-core's: on a version nobody
    verified them on, one clear error naming the library, the versions and how to re-verify."""
    import importlib

    lib = importlib.import_module(f"harness.compat.{module}")
    workaround = next(v for v in vars(lib).values() if isinstance(v, compat.Workaround))
    monkeypatch.setattr(lib, "version", lambda: "9.9.9")
    with pytest.raises(Exception, match=rf"{workaround.name}: verified on .* this is 9\.9\.9; re-verify \(") as info:
        lib.require(workaround)
    assert type(info.value).__name__.startswith("Unverified")


def test_experts_are_marked_only_at_ep1_with_an_etp_of_their_own(version):
    """`experts-at-ep1-etp-ne-tp`'s case (the marking itself: suites/moe/test_training.py, nightly), and
    its gate checked before anything is marked."""
    from types import SimpleNamespace

    def config(**changes):
        return SimpleNamespace(**{"num_moe_experts": 4, "expert_model_parallel_size": 1,
                                  "tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1, **changes})

    assert compat.needs_expert_marking(config())
    assert not compat.needs_expert_marking(config(expert_tensor_parallel_size=2))  # etp = tp
    assert not compat.needs_expert_marking(config(expert_model_parallel_size=2))  # megatron-core marks ep > 1
    assert not compat.needs_expert_marking(config(num_moe_experts=None))  # a dense model
    model = torch.nn.Linear(2, 2)
    version("0.16.2")
    with pytest.raises(compat.UnverifiedMegatronCoreError, match="experts-at-ep1-etp-ne-tp"):
        compat.mark_expert_parameters(model, config())
    compat.mark_expert_parameters(model, config(expert_tensor_parallel_size=2))  # not its case: no gate
    assert all(not hasattr(p, "allreduce") for p in model.parameters())


# gpt-oss's training workarounds (issue 37; harness.compat.megatron_core): verified on 0.19.2 only (stack B;
# stack A builds no gpt-oss), so outside WORKAROUNDS; each refuses another version before touching anything.
def test_gpt_oss_workarounds_mark_the_sinks_and_refuse_an_unverified_version(version):
    gates = (compat.SOFTMAX_OFFSET_UNMARKED, compat.EXPERT_BIAS_SUMMED_OVER_TP, compat.EXPERT_BIAS_INPLACE_ON_VIEW)
    assert all(w.verified_on == ("0.19.2",) and w.bug for w in gates)
    attention = torch.nn.Module()
    attention.core_attention = torch.nn.Module()
    attention.core_attention.softmax_offset = torch.nn.Parameter(torch.zeros(2))
    version("0.19.3")
    for gate in gates:
        with pytest.raises(compat.UnverifiedMegatronCoreError, match=gate.name):
            compat.require(gate)
    with pytest.raises(compat.UnverifiedMegatronCoreError, match="softmax-offset-unmarked"):
        compat.mark_softmax_offsets([attention])
    assert not getattr(attention.core_attention.softmax_offset, "tensor_model_parallel", False)  # untouched
    version("0.19.2")
    assert compat.mark_softmax_offsets([attention]) == [attention]
    offset = attention.core_attention.softmax_offset
    assert (offset.tensor_model_parallel, offset.partition_dim, offset.partition_stride) == (True, 0, 1)
