"""The harness's export walk is mbridge's, faster: on stack A `export_weights` exchanges the pipeline
stages' names once per export (mbridge_compat override 18) where stock mbridge 0.15.1 exchanges them with
three object collectives per tensor. The claim: both walks yield the same items, in the same order, with
the same names, dtypes, shapes and bits, on every rank, at the layouts whose walk differs (pipeline
stages and virtual stages with a tied embedding, experts over EP, experts over ETP under TP with
sequence parallelism, a router's expert-bias buffer). The export round trip
(test_export_roundtrip.py) then holds the new walk against the checkpoint at every CI layout.

Stack B's Megatron-Bridge has its own walk (one name exchange per export already): skipped there.
"""
from __future__ import annotations

import pytest
import torch

from harness.models import resolve_model
from harness.parallel.state import run_in_layout

# The tied model (an embedding on the first and the last stage), a MoE model (experts over EP and ETP),
# and a router expert-bias buffer (GLM-4.5-MoE: a state-dict entry, not a parameter).
MODELS = {"tiny-qwen3-tied": ("pp2", "pp2vpp2"), "tiny-qwen3-moe": ("pp2", "dp2ep2", "tp2ep2etp1-sp"),
          "tiny-glm4-moe": ("pp2", "dp2ep2")}


def _walks(layout, models: dict[str, str]) -> dict[str, dict]:
    """Rank-side: each model's items by both walks, compared here (the tensors stay on the rank)."""
    from harness.bridge import load_megatron_model, unwrap_model
    from harness.bridge.load import hf_bridge

    results = {}
    for name, path in models.items():
        chunks = load_megatron_model(path, dtype=torch.float32, sequence_parallel=layout.sequence_parallel)
        bridge = hf_bridge(chunks)
        walked = [(n, t.detach().clone()) for n, t in bridge.export_weights(unwrap_model(chunks))]
        stock = [(n, t.detach().clone()) for n, t in bridge.stock_export_weights(unwrap_model(chunks))]
        results[name] = {
            "items": len(stock),
            "names_differ": [n for n, _ in walked] != [n for n, _ in stock],
            "tensors_differ": sorted({a for (a, x), (_, y) in zip(walked, stock)
                                      if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y)}),
        }
        del chunks
    return results


@pytest.mark.layouts(cpu=["pp2", "pp2vpp2", "dp2ep2", "tp2ep2etp1-sp"], cuda=["pp2", "dp2ep2"])
def test_the_harness_export_walk_yields_mbridges_items(world, device, layout, report):
    from harness.bridge.backends import current

    if current() != "mbridge":
        pytest.skip(f"override 18 is mbridge's; the {current()} bridge walks its own way")
    models = {name: str(resolve_model(name)) for name, layouts in MODELS.items() if str(layout) in layouts}
    per_rank = run_in_layout(world, layout, _walks, models)
    failures = []
    for name in models:
        for rank, results in enumerate(per_rank):
            result = results[name]
            if result["names_differ"] or result["tensors_differ"] or not result["items"]:
                failures.append(f"{name} rank {rank}: {result}")
        worst = max(len(r[name]["tensors_differ"]) + r[name]["names_differ"] for r in per_rank)
        report.add("export_walk_items_differing", worst, tolerance=0, passed=worst == 0, claim="exact",
                   layout=str(layout), model=name, items=per_rank[0][name]["items"])
    assert not failures, "\n".join(failures)
