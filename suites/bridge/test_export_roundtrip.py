"""HF -> Megatron -> HF is exact: `export_hf_state_dict(load_megatron_model(ckpt))` gives back the
checkpoint's tensors, the same key set and every tensor `torch.equal` (in bf16: equal to the
checkpoint's float32 weights rounded to bf16), for every tiny zoo model, under every layout.

CI cost: every tiny model (MoE ones included) in one dtype is ONE world call per layout that loads
and exports all of them: 2 to 17 s per layout and dtype on 2 shared CPU cores (tp2pp2, 4 ranks, is the
slowest), plus the worlds' start-up where no earlier suite started them. CI runs the layouts whose
export code differs: tp2pp2 (TP shards gathered within each pipeline stage, the stages joined) in fp32,
pp2vpp2 (virtual stages) in bf16, and the two expert layouts in both dtypes. What a dtype changes is the
load's cast, not the gather or the stage join (dtype-blind: the same collectives and reshapes), so each
of the two dense layouts runs in one dtype and every model is still exported in both dtypes in CI; the
other dtype of each runs nightly (`--mrh-nightly`), as do tp1, tp2, pp2 and dp2 (the parts of tp2pp2
alone) and tp2-sp: sequence parallelism shards no weight (its export is tp2's: the TP gather runs at
tp2pp2, an SP export at tp2ep2etp1-sp, an SP model build in the MoE families' tp2-sp parity cases).
`cuda="all"` adds every valid layout of the machine's GPUs.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.models import list_models, load_hf_config, resolve_model
from harness.models.zoo import VLLM_CPU_TWINS
from harness.parallel.layout import LayoutError, resolve, validate
from harness.parallel.state import as_layout, run_in_layout

# DeepSeek-V3 and Moonlight have their own (nightly) tests below: the CI budget (issue 37). The vLLM CPU tier's
# twins of issue 37's families (VLLM_CPU_TWINS) convert by their tiny model's bridge code; the nightly syncs of
# suites/rollout/test_vllm_families.py export them.
OWN_TESTS = ("tiny-deepseek-v3", "tiny-moonlight", *VLLM_CPU_TWINS)
TINY_MODELS = [name for name in list_models() if name.startswith("tiny-") and name not in OWN_TESTS]
NIGHTLY = pytest.mark.nightly
CPU_LAYOUTS = [pytest.param(name, marks=NIGHTLY) for name in ("tp1", "tp2", "pp2", "dp2", "tp2-sp")] + [
    "pp2vpp2", "tp2pp2", "dp2ep2", "tp2ep2etp1-sp"]  # the last two: MoE models only
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The CPU tier's one dtype at a dense multi-stage layout (module docstring); the other dtype there runs
# nightly (test_export_in_the_other_dtype_gives_back_the_checkpoint_exactly).
CI_DTYPE = {"tp2pp2": "fp32", "pp2vpp2": "bf16"}


def _compare(exported: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict:
    """Which tensors are missing, extra, of another dtype/shape, or not bit-equal (with max |Δ|)."""
    common = sorted(exported.keys() & expected.keys())
    wrong_kind = [k for k in common if (exported[k].dtype, exported[k].shape) != (expected[k].dtype, expected[k].shape)]
    unequal = {k: (exported[k].double() - expected[k].double()).abs().max().item()
               for k in common if k not in wrong_kind and not torch.equal(exported[k], expected[k])}
    return {"tensors": len(expected), "missing": sorted(expected.keys() - exported.keys()),
            "extra": sorted(exported.keys() - expected.keys()), "wrong_kind": wrong_kind, "unequal": unequal}


def _as_saved(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What an export in `dtype` must give back: the tensor in `dtype`, but DeepSeek-V3's router bias,
    which HF and megatron-core both keep in float32 whatever the model's dtype."""
    from harness.models.randomize import EXPERT_BIAS_BUFFERS

    return tensor if name.endswith(EXPERT_BIAS_BUFFERS) else tensor.to(dtype)


def _roundtrip_all(layout, models: dict[str, str], dtypes: tuple[str, ...]) -> dict[tuple[str, str], dict]:
    """Rank-side: load and export every (model, dtype); compare with the checkpoint on this rank."""
    from safetensors.torch import load_file

    from harness.bridge import export_hf_state_dict, load_megatron_model

    results = {}
    for name, path in models.items():
        checkpoint: dict[str, torch.Tensor] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            checkpoint.update(load_file(file))
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            chunks = load_megatron_model(path, dtype=dtype, sequence_parallel=layout.sequence_parallel)
            exported = export_hf_state_dict(chunks)
            del chunks
            results[(name, dtype_name)] = _compare(exported, {k: _as_saved(k, v, dtype) for k, v in checkpoint.items()})
    return results


def _mismatches(result: dict) -> int:
    return len(result["missing"]) + len(result["extra"]) + len(result["wrong_kind"]) + len(result["unequal"])


@pytest.mark.layouts(cpu=CPU_LAYOUTS, cuda="all")
def test_export_gives_back_the_checkpoint_exactly(world, device, layout, report, models=TINY_MODELS, dtypes=None):
    from harness.bridge.backends import current
    from harness.bridge.preflight import bridge_converts

    valid, skipped = {}, {}
    for name in models:
        if not bridge_converts(name):  # Mixtral on Megatron-Bridge
            skipped[name] = f"the {current()} bridge does not convert it"
            continue
        try:
            validate(resolve(as_layout(layout), world.size), world.size, load_hf_config(name))
        except LayoutError as exc:  # e.g. tp4 on a model with 2 query groups
            skipped[name] = str(exc).replace("\n", " ")
            continue
        valid[name] = str(resolve_model(name))  # materialized once, here in the parent
    if not valid:
        pytest.skip(f"{layout} is valid for no tiny model: {skipped}")
    if dtypes is None:  # the CPU tier's CI: one dtype at tp2pp2 and pp2vpp2 (CI_DTYPE), both elsewhere
        dtypes = (CI_DTYPE[str(layout)],) if device == "cpu" and str(layout) in CI_DTYPE else tuple(DTYPES)
    per_rank = run_in_layout(world, layout, _roundtrip_all, valid, dtypes)
    failures = []
    for (name, dtype), result in per_rank[0].items():
        worst = max(_mismatches(r[(name, dtype)]) for r in per_rank)
        max_abs = max((max(r[(name, dtype)]["unequal"].values(), default=0.0) for r in per_rank))
        report.add("export_mismatched_tensors", worst, tolerance=0, passed=worst == 0, claim="exact", layout=str(layout),
                   model=name, dtype=dtype, tensors=result["tensors"], max_abs=max_abs)
        failures += [f"{name} {dtype} rank {rank}: {r[(name, dtype)]}" for rank, r in enumerate(per_rank)
                     if _mismatches(r[(name, dtype)])]
    assert len(per_rank[0]) == len(dtypes) * len(valid)
    assert not failures, "\n".join(failures)


# Nightly: the dtype CI leaves out at tp2pp2 and pp2vpp2. CI still exports every model in that dtype at
# the other of the two layouts (the gather and the stage join are dtype-blind): tp2pp2's bf16 is held by
# test_export_gives_back_the_checkpoint_exactly[cpu-pp2vpp2], pp2vpp2's fp32 by [cpu-tp2pp2].
@pytest.mark.nightly
@pytest.mark.layouts(cpu=list(CI_DTYPE))
def test_export_in_the_other_dtype_gives_back_the_checkpoint_exactly(world, device, layout, report):
    other = tuple(d for d in DTYPES if d != CI_DTYPE[str(layout)])
    test_export_gives_back_the_checkpoint_exactly(world, device, layout, report, dtypes=other)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "tp2-sp", "pp2vpp2", "dp2ep2", "tp2ep2etp1-sp"], cuda="all")
def test_deepseek_v3_export_gives_back_the_checkpoint_exactly(world, device, layout, report):
    """DeepSeek-V3 (both stacks): MLA's projections and norms, the dense first layer, the router's
    float32 expert bias and the shared experts, HF -> Megatron -> HF bit for bit."""
    test_export_gives_back_the_checkpoint_exactly(world, device, layout, report, models=["tiny-deepseek-v3"],
                                                  dtypes=tuple(DTYPES))


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp2-sp", "dp2ep2", "pp2"], cuda="all")
def test_moonlight_export_gives_back_the_checkpoint_exactly(world, device, layout, report):
    """Moonlight (both stacks): MLA's one q_proj (no q LoRA: megatron-core's linear_q_proj, split over TP by
    heads) with the rest of DeepSeek-V3's tensors, HF -> Megatron -> HF bit for bit."""
    test_export_gives_back_the_checkpoint_exactly(world, device, layout, report, models=["tiny-moonlight"],
                                                  dtypes=tuple(DTYPES))


def test_the_comparison_sees_one_ulp_a_missing_an_extra_and_a_wrong_dtype_tensor():
    """_compare is what makes the test above able to fail."""
    expected = {"a": torch.tensor([1.0, 2.0]), "b": torch.ones(2), "c": torch.zeros(3)}
    exported = {"a": torch.tensor([1.0, torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item()]),
                "b": torch.ones(2, dtype=torch.bfloat16), "d": torch.zeros(1)}
    result = _compare(exported, expected)
    assert result["missing"] == ["c"] and result["extra"] == ["d"] and result["wrong_kind"] == ["b"]
    assert list(result["unequal"]) == ["a"] and 0 < result["unequal"]["a"] < 1e-6
    assert _mismatches(result) == 4 and _mismatches(_compare(expected, dict(expected))) == 0
