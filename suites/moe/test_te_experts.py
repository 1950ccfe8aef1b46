"""Transformer Engine's grouped experts, as megatron-core 0.16.1 leaves them, reproduced on the local
spec: the experts' weights not marked tensor-parallel (TEGroupedLinear hands TE parallel_mode=None
whenever the experts communicate explicitly, so neither marks them; SequentialMLP's linears are
marked). On 2x H200 with TE this broke two things on stack A (reports/gpu/2026-11-26-h200x2-moe/):
the grad norm left out TP rank 1's experts (Megatron-LM #5916), and mbridge exported experts split
over etp 2 as one rank's half. The version-gated workaround
`harness.compat.megatron_core.TE_GROUPED_EXPERTS_UNMARKED` marks split expert weights as 0.19.2 does
and gives the expert optimizer the expert-TP group to filter over. These tests strip the marks as TE
leaves them and show each consequence with and without the workaround, on both stacks (0.19.2 needs
none). The end-to-end proof on TE itself is the GPU run of suites/moe/test_training.py and
test_checkpoint.py at tp2ep2etp1-sp and tp2-sp."""
from __future__ import annotations

import pytest

MODEL = "tiny-qwen3-moe"


def _expert_main_params(worker):
    """The expert-parallel parts of the policy's chained optimizer and their (main) parameters."""
    from harness.compat.megatron_core import expert_parallel_parts

    parts = expert_parallel_parts(worker.optimizer)
    return parts, [param for part in parts for param in part.get_parameters()]


def _grad_norm_keeps(worker) -> dict[str, int]:
    """Rank function, after a step: strip `tensor_model_parallel` from the expert optimizer's
    parameters (as TE leaves grouped experts on 0.16.1); how many expert grads the grad norm keeps
    filtered over the dense TP group (0.16.1's stock filter), and as the policy was built (the
    workaround, where it applies)."""
    from megatron.core import parallel_state

    parts, params = _expert_main_params(worker)
    grads = [getattr(part, "get_main_grads_for_grad_norm", None) or part.get_grads_for_grad_norm  # 0.19 renamed it
             for part in parts]
    for param in params:
        param.tensor_model_parallel = False
    built = sum(len(get()) for get in grads)
    kept_group = [part.tp_group for part in parts]
    for part in parts:
        part.tp_group = parallel_state.get_tensor_model_parallel_group()
    stock = sum(len(get()) for get in grads)
    for part, group in zip(parts, kept_group, strict=True):
        part.tp_group = group
    return {"experts": len(params), "kept_as_built": built, "kept_over_dense_tp": stock}


@pytest.mark.layouts(cpu=["tp2ep2etp1-sp"], cuda=["tp2ep2etp1-sp"])
def test_unmarked_experts_stay_in_the_grad_norm_on_every_tp_rank(policy, device, layout, report):
    """At tp2ep2etp1-sp each TP rank holds its own experts (ep over the TP ranks): every rank's expert
    gradients belong in the grad norm. Filtered over the dense TP group, unmarked experts leave it on
    TP rank 1 (0.16.1's bug); as built (0.16.1 with the workaround, or 0.19.2's own filter) every
    rank keeps all of them (0.19.2: whatever the optimizer's tp_group)."""
    from harness.bridge.versions import mcore_version
    from harness.training import make_rl_train_batch
    from harness.training.invariance import policy_config

    worker = policy(layout, MODEL, **policy_config())
    worker.step(make_rl_train_batch(251, batch_size=4, seed=0, prompt_lengths=[3, 6, 2, 5],
                                    response_lengths=[5, 4, 6, 3]))
    counts = worker.apply(_grad_norm_keeps)
    for rank, count in enumerate(counts):
        report.add("expert_grads_left_out", count["experts"] - count["kept_as_built"], tolerance=0,
                   passed=count["kept_as_built"] == count["experts"], claim="exact", layout=layout, model=MODEL,
                   rank=rank, mcore=mcore_version(), unmarked=True)
    assert all(c["experts"] > 0 for c in counts), counts
    assert all(c["kept_as_built"] == c["experts"] for c in counts), counts
    if mcore_version().startswith("0.16."):
        # The bug the workaround is for, shown by the stock filter on the same unmarked params: TP
        # rank 1 (here global rank 1) drops every expert grad over the dense TP group.
        assert counts[1]["kept_over_dense_tp"] == 0 and counts[0]["kept_over_dense_tp"] == counts[0]["experts"], counts
    else:  # 0.19.2 filters expert params over the expert-TP group whatever the optimizer's tp_group
        assert all(c["kept_over_dense_tp"] == c["experts"] for c in counts), counts


def _strip_and_remark(worker) -> dict[str, object]:
    """Rank function: strip the experts' tensor-parallel marks (as TE's grouped linears are left on
    0.16.1), then apply the marking workaround; whether it restored megatron-core's own marks
    (tensor_model_parallel, partition_dim) on every expert weight. The stride is 0.19.2's for TE's
    grouped experts (1; SequentialMLP's gated linear_fc1 says 2, which nothing downstream reads for experts)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from harness.bridge import unwrap_model
    from harness.compat.megatron_core import mark_split_expert_weights

    chunk = unwrap_model(worker.models)[0]
    experts = {f"{name}.experts.{n}": p for name, m in chunk.named_modules() if isinstance(m, MoELayer)
               for n, p in m.experts.named_parameters()}
    attrs = ("tensor_model_parallel", "partition_dim")
    original = {n: tuple(getattr(p, a, None) for a in attrs) for n, p in experts.items()}
    for param in experts.values():
        param.tensor_model_parallel = False
    marked = mark_split_expert_weights(chunk, chunk.config)
    restored = {n: tuple(getattr(p, a, None) for a in attrs) for n, p in experts.items()}
    for param, attr in zip(experts.values(), original.values(), strict=True):  # leave the policy as built
        param.tensor_model_parallel = attr[0]
    return {"experts": len(experts), "marked": len(marked), "same": restored == original,
            "original_marked": all(attr[0] for attr in original.values())}


@pytest.mark.layouts(cpu=["tp2-sp"], cuda=["tp2-sp"])
def test_split_expert_weights_are_marked_as_megatron_marks_its_own(policy, device, layout, report):
    """At tp2-sp (etp 2) every expert weight is split: the workaround marks exactly what megatron-core
    marks on SequentialMLP's linears (row or column split). On 0.19.2 it is not applied
    (0.19.2 marks TE's grouped experts itself): nothing is marked and the weights stay unmarked."""
    from harness.bridge.versions import mcore_version
    from harness.compat.megatron_core import TE_GROUPED_EXPERTS_UNMARKED, applies
    from harness.training.invariance import policy_config

    worker = policy(layout, MODEL, **policy_config())
    results = worker.apply(_strip_and_remark)
    applied = applies(TE_GROUPED_EXPERTS_UNMARKED)
    assert applied == mcore_version().startswith("0.16."), (mcore_version(), applied)
    for rank, result in enumerate(results):
        report.add("expert_weights_marked", result["marked"], tolerance=result["experts"] if applied else 0,
                   passed=result["marked"] == (result["experts"] if applied else 0), claim="exact", layout=layout,
                   model=MODEL, rank=rank, mcore=mcore_version())
        assert result["original_marked"] and result["experts"] > 0, result
        assert result["marked"] == (result["experts"] if applied else 0), result
        assert result["same"] == applied, result


def _replicas_with_experts_unmarked(worker) -> float:
    """Rank function: the policy's replica check (`replica_divergence`) with the experts' weights
    unmarked as TE leaves them on 0.16.1 (the marks put back after)."""
    from harness.bridge import unwrap_model

    experts = [p for chunk in unwrap_model(worker.models) for n, p in chunk.named_parameters() if ".experts." in n]
    kept = [getattr(p, "tensor_model_parallel", False) for p in experts]
    for param in experts:
        param.tensor_model_parallel = False
    try:
        return worker.replica_divergence()
    finally:
        for param, mark in zip(experts, kept, strict=True):
            param.tensor_model_parallel = mark


@pytest.mark.layouts(cpu=["tp2ep2etp1-sp"], cuda=["tp2ep2etp1-sp"])
def test_the_replica_check_does_not_take_unmarked_experts_for_tp_replicas(policy, device, layout, report):
    """At tp2ep2etp1-sp each TP rank holds other experts: they are not replicas of each other. The
    policy's replica check compares what TP does not split over the TP group; an expert parameter
    (allreduce=False) it compares over the expert-TP group (here one rank) instead. The 2x H200 run
    showed why: with TE's unmarked experts the check compared rank 0's experts with rank 1's (1.04)."""
    from harness.training import make_rl_train_batch
    from harness.training.invariance import policy_config

    worker = policy(layout, MODEL, **policy_config())
    worker.step(make_rl_train_batch(251, batch_size=4, seed=0, prompt_lengths=[3, 6, 2, 5],
                                    response_lengths=[5, 4, 6, 3]))
    spread = worker.apply(_replicas_with_experts_unmarked)[0]
    report.add("replica_max_abs_diff", spread, tolerance=0.0, passed=spread == 0.0, claim="exact", layout=layout,
               model=MODEL, unmarked_experts=True)
    assert spread == 0.0, f"replicas differ by {spread:g} with the experts unmarked"
