"""Training a Mixture-of-Experts policy is invariant to the expert layout: loss, grad norm (every
expert's gradient in it) and the updated weights of every expert equal the single-process HF ground
truth's, whether the experts sit on one rank, are split over ranks (ep), or split their own width
(etp). CI runs the two expert-parallel layouts; the nightly run the others too."""
from __future__ import annotations

import pytest

from harness.pytest_plugin.worlds import skip_unless_converted

from suites.training.test_policy import _check

MODEL = "tiny-qwen3-moe"
EXPERT_PARALLEL = ["dp2ep2", "tp2ep2etp1-sp"]


def _check_family(policy, layout, report, model: str) -> None:
    """A family's check where this stack's bridge converts it (skipped, saying why, where it does not)."""
    skip_unless_converted(model)
    _check(policy, layout, report, model=model)


@pytest.mark.layouts(cpu=EXPERT_PARALLEL, cuda=["tp1"] + EXPERT_PARALLEL)
def test_moe_policy_steps_match_ground_truth(policy, device, layout, report):
    _check(policy, layout, report, model=MODEL)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "pp2", "pp2vpp2", "tp2-sp"])
def test_moe_policy_steps_match_ground_truth_without_expert_parallelism(policy, device, layout, report):
    _check(policy, layout, report, model=MODEL)


# Qwen2-MoE (stack A: Megatron-Bridge 0.6.2 has no Qwen2-MoE bridge): its shared expert and sigmoid gate
# train too (the gate's weight is replicated over TP and reduced there under sequence parallelism).
# CI: tp2ep2etp1-sp, where the shared expert is split over TP and the routed experts over EP; nightly
# the rest.
QWEN2_MOE = "tiny-qwen2-moe"


@pytest.mark.layouts(cpu=["tp2ep2etp1-sp"], cuda=["tp1", "tp2ep2etp1-sp"])
def test_qwen2_moe_policy_steps_match_ground_truth(policy, device, layout, report):
    _check_family(policy, layout, report, QWEN2_MOE)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "dp2ep2", "tp2-sp", "pp2"], cuda=["dp2ep2", "tp2-sp", "pp2"])
def test_qwen2_moe_policy_steps_match_ground_truth_at_every_layout(policy, device, layout, report):
    _check_family(policy, layout, report, QWEN2_MOE)


# GLM-4.5-MoE (issue 37; stack A: the harness does not build Megatron-Bridge 0.6.2's GLM45Bridge): a dense
# first layer beside sparse ones, the sigmoid router with its expert bias (a buffer: no gradient, and
# megatron-core's bias update rate 0, as HF keeps it fixed) and the routed scaling in the backward, the
# ungated shared expert. Nightly only (CI's budget: the first GLM training case costs ~15 s on 2 cores, most of
# it the single-process HF ground truth): tp1, dp2ep2, tp2-sp, tp2ep2etp1-sp and pp2, on both stacks.
GLM4_MOE = "tiny-glm4-moe"


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "dp2ep2", "tp2-sp", "tp2ep2etp1-sp", "pp2"],
                     cuda=["tp1", "dp2ep2", "tp2-sp", "tp2ep2etp1-sp", "pp2"])
def test_glm4_moe_policy_steps_match_ground_truth(policy, device, layout, report):
    _check_family(policy, layout, report, GLM4_MOE)


def test_expert_grads_over_dp_is_refused_where_the_two_groups_are_one():
    """The variant shows only where the DP group is not the expert-DP group: at tp2ep2etp1-sp on two
    ranks both are one rank (dp 1, expert dp 1), so it is one clear error there, before any rank works."""
    from harness.variants import VariantError
    from harness.variants.repro import preflight

    with pytest.raises(VariantError, match="differ from the expert data-parallel group"):
        preflight("expert-grads-over-dp", "tp2ep2etp1-sp", "fp32")
    assert preflight("expert-grads-over-dp", "dp2ep2", "fp32")[1] == "dp2ep2"

# Megatron-LM #5916's uncommon case (EP 1, ETP != TP): at tp2etp1-sp the experts are whole on both
# ranks (etp 1) and replicated over the expert-DP group (the TP ranks, each feeding its own
# sequence-parallel tokens), so their gradients must be reduced over it. megatron-core 0.16.1's layers
# mark expert parameters `allreduce=False` only at ep > 1 (the replicas then diverge: 2e-3 after one
# step); 0.19.2 has the fix, and on 0.16.1 the harness applies the same marking
# (harness.compat.megatron_core.EXPERTS_AT_EP1_ETP_NE_TP; without it the divergence is measured by
# suites/checkpoint/test_upstream_workarounds.py).


def _expert_replicas(worker):
    """This rank's expert weights (float64 copies) and whether each is marked expert-parallel."""
    from harness.bridge import unwrap_model

    params = [(n, p) for n, p in unwrap_model(worker.models)[0].named_parameters() if ".experts." in n]
    return {n: p.detach().double().cpu() for n, p in params}, [not getattr(p, "allreduce", True) for _, p in params]


def replica_divergence(worker) -> tuple[float, list[bool]]:
    """After one training step of a 2-rank policy whose ranks both hold every expert whole: the
    largest difference between the two ranks' expert weights, and rank 0's expert-parallel marks."""
    from harness.training import make_rl_train_batch

    worker.step(make_rl_train_batch(251, batch_size=4, seed=0, prompt_lengths=[3, 6, 2, 5],
                                    response_lengths=[5, 4, 6, 3]))
    (first, marked), (second, _) = worker.apply(_expert_replicas)
    return max((first[n] - second[n]).abs().max().item() for n in first), marked


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp2etp1-sp"], cuda=["tp2etp1-sp"])
def test_expert_replicas_at_ep1_with_etp_below_tp(policy, device, layout, report):
    from harness.bridge.versions import mcore_version
    from harness.training.invariance import policy_config

    diff, marked = replica_divergence(policy(layout, MODEL, **policy_config()))
    report.add("expert_replica_max_abs_diff", diff, tolerance=0.0, passed=diff == 0.0, claim="exact",
               layout=layout, model=MODEL, mcore=mcore_version())
    assert marked and all(marked), "the experts are not marked expert-parallel (allreduce=False)"
    assert diff == 0.0, f"megatron-core {mcore_version()}: the expert replicas differ by {diff:g}"


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp2etp1-sp"])
def test_moe_policy_steps_match_ground_truth_at_ep1_with_etp_below_tp(policy, device, layout, report):
    _check(policy, layout, report, model=MODEL)


# gpt-oss (stack B: mbridge 0.15.1 has no gpt-oss bridge): the sinks (a per-head parameter, split over TP),
# the expert and attention biases and the clamped SwiGLU train as HF's do. CI: tp2ep2etp1-sp; nightly the rest
# (etp 1 everywhere: megatron-core supports expert biases only there).
GPT_OSS = "tiny-gpt-oss"


@pytest.mark.layouts(cpu=["tp2ep2etp1-sp"], cuda=["tp1", "tp2ep2etp1-sp"])
def test_gpt_oss_policy_steps_match_ground_truth(policy, device, layout, report):
    _check_family(policy, layout, report, GPT_OSS)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "dp2ep2", "tp2etp1-sp", "pp2"], cuda=["dp2ep2", "tp2etp1-sp", "pp2"])
def test_gpt_oss_policy_steps_match_ground_truth_at_every_layout(policy, device, layout, report):
    _check_family(policy, layout, report, GPT_OSS)


# DeepSeek-V3 (both stacks): MLA, the dense first layer, the sigmoid router (its expert bias fixed:
# compat override 16 sets moe_router_bias_update_rate 0, as HF keeps it) and the shared experts train
# across layouts as in one process; under TP with megatron-core's MLA rope-key gradient summed over the TP
# ranks (harness.compat.megatron_core.MLA_ROPE_KEY_GRAD: stock, tp2-sp's step-0 grad norm was 3.4% off on
# 0.16.1 and on 0.19.2). Nightly (CI's MoE training slice is Qwen3-MoE's and Qwen2-MoE's).
DEEPSEEK_V3 = "tiny-deepseek-v3"


@pytest.mark.nightly
# Left out where one weight ends past the 1e-5 bound after 2 steps while loss and grad norm hold theirs:
# tp2ep2etp1-sp on the CPU tier (layer 0's kv_b_proj, 1.14e-5) and tp1 on an H100 (layer 0's o_proj, 1.38e-5 on
# stack A, 1.12e-5 on stack B; reports/gpu/2026-12-07-h100-session53). Both are held by the gradient check below,
# which passes there: the gap is Adam's first update at an element whose gradient sits near eps (measured on the
# CPU tier, docs/moe.md; on CUDA the element is not yet measured: ci/probes/test_fp64_training.py, cuda tp1).
@pytest.mark.layouts(cpu=["tp1", "dp2ep2", "tp2-sp", "pp2"], cuda=["dp2ep2", "tp2-sp", "pp2"])
def test_deepseek_v3_policy_steps_match_ground_truth(policy, device, layout, report):

    _check_family(policy, layout, report, DEEPSEEK_V3)


# The layouts the test above leaves out, held where rounding cannot pass for a bug: the first step's gradient of
# every tensor, as close to HF's float64 gradient as HF's own fp32 one is (harness.training.grad_check). The
# weight gap at tp2ep2etp1-sp is Adam's first update at an element whose gradient sits near eps (g = 2.8e-6
# against 1e-6: lr * eps / (|g| + eps)^2 = 69 turns 1e-7 of fp32 rounding into 7e-6 of weight),
# reports/cpu/2026-12-07-fp64-gradients. CUDA tp1 passed on both stacks (2.10, 2.03; session 53).
@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "tp2-sp", "tp2ep2etp1-sp"], cuda=["tp1", "tp2-sp", "tp2ep2etp1-sp"])
def test_deepseek_v3_gradients_are_as_exact_as_hfs_own_fp32(policy, device, layout, report):
    from harness.training.grad_check import compare_gradients_to_float64
    from harness.training.invariance import policy_config

    skip_unless_converted(DEEPSEEK_V3)
    result = compare_gradients_to_float64(policy(layout, DEEPSEEK_V3, **policy_config()), DEEPSEEK_V3)
    result.record(report)
    assert result.passed, result.summary()


# Every other MoE family at the expert layout that splits both attention and experts (tp2ep2etp1-sp): the same
# gradient check, which no Adam conditioning can trip (gpt-oss on stack B; Gemma 3 has no experts and its
# zero-centered norms no gradient export). Nightly: the float64 HF model costs a few seconds each.
@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp2ep2etp1-sp"], cuda=["tp2ep2etp1-sp"])
@pytest.mark.parametrize("model", [MODEL, QWEN2_MOE, GLM4_MOE, GPT_OSS, "tiny-moonlight", "tiny-mixtral"])
def test_every_moe_familys_gradients_are_as_exact_as_hfs_own_fp32(policy, device, layout, model, report):
    from harness.training.grad_check import compare_gradients_to_float64
    from harness.training.invariance import policy_config

    skip_unless_converted(model)
    result = compare_gradients_to_float64(policy(layout, model, **policy_config()), model)
    result.record(report)
    assert result.passed, result.summary()


_stock_path: list = []  # rank side: the open compat.trial of a policy built on megatron-core's own MLA gather


def _mla_gather_stock(begin: bool) -> None:
    from harness.compat import megatron_core as compat

    if begin:
        _stock_path.append(compat.trial(compat.MLA_ROPE_KEY_GRAD))
        _stock_path[-1].__enter__()
    while not begin and _stock_path:
        _stock_path.pop().__exit__(None, None, None)


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp2ep2etp1-sp"])
def test_the_gradient_check_catches_megatron_cores_own_mla_rope_key_gradient(world, policy, device, layout, report):
    """The control: built on megatron-core's own gather of the kv down projection (MLA_ROPE_KEY_GRAD left out),
    the shared rope key's gradient is one TP rank's part, far past fp32's rounding in the tensors before it."""
    from harness.training.grad_check import bound, compare_gradients_to_float64
    from harness.training.invariance import policy_config

    skip_unless_converted(DEEPSEEK_V3)
    world.run(_mla_gather_stock, True)
    try:
        handle = policy(layout, DEEPSEEK_V3, **policy_config())
    finally:
        world.run(_mla_gather_stock, False)
    assert handle.world is world, "the policy was built on another world than the one on the stock path"
    result = compare_gradients_to_float64(handle, DEEPSEEK_V3)
    limit, ratio = bound().limit, result.ratio(result.worst)
    report.add("grad_error_over_hf_fp32_stock_mla_gather", ratio, tolerance=limit, passed=ratio > 3 * limit,
               claim="control", layout=layout, model=DEEPSEEK_V3, dtype="fp32", tensor=result.worst)
    assert ratio > 3 * limit, f"megatron-core's own MLA gather is not caught: {result.summary()}"


# Moonlight (both stacks): DeepSeek-V3's architecture with one q_proj (no q LoRA), plain RoPE and no expert
# groups trains as in one process; under TP with the same MLA rope-key workaround (MLA_ROPE_KEY_GRAD: the kv
# down projection is DeepSeek-V3's, whatever the query). Nightly (CI's budget).
MOONLIGHT = "tiny-moonlight"


@pytest.mark.nightly
@pytest.mark.layouts(cpu=["tp1", "tp2-sp", "dp2ep2", "pp2"], cuda=["tp1", "tp2-sp", "dp2ep2", "pp2"])
def test_moonlight_policy_steps_match_ground_truth(policy, device, layout, report):
    _check_family(policy, layout, report, MOONLIGHT)
