"""Why tiny-deepseek-v3's weights at tp2ep2etp1-sp end 1.14e-5 off the fp32 ground truth (bound 1e-5): float64.

Not collected by `pytest suites`: the measurement behind docs/moe.md's DeepSeek-V3 finding and
harness.training.grad_check (reports/cpu/2026-12-07-fp64-gradients). The same steps three ways on the same
batches: the policy (fp32, the layout's reduction orders), the single-process ground truth in fp32 (the
training test's reference) and the same ground truth in float64 (the model converted after its fp32 draw and
its trainer's fp32 check: the same start). Then layer 0's kv_b_proj, the tensor the weight bound trips on: its
first gradient against float64, and Adam's first update lr * g / (|g| + eps) of each element from it. Run by hand:

    .venv/bin/pytest ci/probes/test_fp64_training.py --mrh-report-dir DIR -s
"""
from __future__ import annotations

import functools

import pytest
import torch

from harness.training.invariance import LOSS, OPTIM, STEPS, compare_to_ground_truth, ground_truth, policy_config

MODEL = "tiny-deepseek-v3"
NAME = "model.layers.0.self_attn.kv_b_proj.weight"  # where the bound trips on the CPU tier (tp2ep2etp1-sp)
TENSORS = (NAME, "model.layers.0.self_attn.o_proj.weight")  # and on CUDA (tp1, both stacks, session 53)
LAYOUTS = ["tp1", "dp2ep2", "pp2", "tp2-sp", "tp2ep2etp1-sp"]


@functools.lru_cache(maxsize=2)
def float64_ground_truth(model: str) -> dict[str, torch.Tensor]:
    """The fp32 ground truth's STEPS steps in float64 (ground_truth.policy_logprobs runs a float64 model unpadded)."""
    from harness.models import build_hf_model
    from harness.models.zoo import checkpoint_state_dict
    from harness.training.ground_truth import GroundTruthTrainer

    batches, _, _ = ground_truth(model)
    hf = build_hf_model(model, dtype=torch.float32, seed=0)
    trainer = GroundTruthTrainer(hf, **OPTIM, **LOSS)
    hf.double()  # after the fp32 check: the parameters keep their identity (the optimizer's), their data float64
    hf.set_experts_implementation("eager")  # torch's grouped_mm takes no float64
    for tb in batches[:STEPS]:
        trainer.step(tb, micro_batches=2)
    hf.zero_grad(set_to_none=True)
    return checkpoint_state_dict(hf)


def _distances(state, ref) -> dict[str, float]:
    return {n: (state[n].double() - ref[n].double()).abs().max().item() for n in ref if n in state}


@pytest.mark.layouts(cpu=LAYOUTS, cuda=["tp1"])
def test_the_policys_weights_against_float64(policy, device, layout, report):
    handle = policy(layout, MODEL, **policy_config())
    result = compare_to_ground_truth(handle, model=MODEL)
    got = handle.hf_state_dict()  # after its STEPS steps
    _, _, fp32 = ground_truth(MODEL)
    to32, to64, truth_to64 = _distances(got, fp32), _distances(got, float64_ground_truth(MODEL)), \
        _distances(fp32, float64_ground_truth(MODEL))
    print(f"\n{layout}: {result.summary()}")
    for name in sorted(to32, key=to32.get, reverse=True)[:5]:
        print(f"  {name:52s} policy-fp32 {to32[name]:.3g}  policy-fp64 {to64[name]:.3g}  "
              f"fp32 truth-fp64 {truth_to64[name]:.3g}")
    for name in TENSORS:
        for metric, value in (("policy_vs_fp32_truth", to32[name]), ("policy_vs_fp64_truth", to64[name]),
                              ("fp32_truth_vs_fp64_truth", truth_to64[name])):
            report.add(metric, value, tolerance=None, passed=True, claim="observed", layout=layout, model=MODEL,
                       tensor=name)
    assert truth_to64[NAME] > 0  # the float64 run moved off the fp32 one: it is another arithmetic


@pytest.mark.parametrize("name", TENSORS)
@pytest.mark.layouts(cpu=["tp1", "tp2-sp", "tp2ep2etp1-sp"], cuda=["tp1"])
def test_the_first_gradient_of_a_layer_0_projection(policy, device, layout, name, report):
    from harness.training.grad_check import hf_gradients, policy_gradients

    batches, _, _ = ground_truth(MODEL)
    got = policy_gradients(policy(layout, MODEL, **policy_config()), batches[0])[name]
    g64, g32 = hf_gradients(MODEL, batches[0], torch.float64)[name], hf_gradients(MODEL, batches[0], torch.float32)[name]
    norm = g64.norm().item()
    print(f"\n{layout} {name}: |g| {norm:.4g}; relative error policy {(got - g64).norm().item() / norm:.3g}, "
          f"fp32 truth {(g32 - g64).norm().item() / norm:.3g}; max |d| policy {(got - g64).abs().max().item():.3g}, "
          f"fp32 truth {(g32 - g64).abs().max().item():.3g}")
    # Adam's first update of an element is lr * g / (|g| + eps) (m and v bias-corrected): its sensitivity to g is
    # lr * eps / (|g| + eps)^2, 1e3 where |g| << eps.
    lr, eps = OPTIM["lr"], OPTIM["eps"]
    update = lambda g: lr * g / (g.abs() + eps)  # noqa: E731
    for who, g in (("policy", got), ("fp32_truth", g32)):
        du = (update(g) - update(g64)).abs()
        at = int(du.argmax())
        print(f"  {who}: first Adam update max |d| {du.max().item():.3g} at element {at} "
              f"(g64 {g64.flatten()[at].item():.3g}, g {g.flatten()[at].item():.3g}, "
              f"sensitivity {lr * eps / (g64.flatten()[at].abs().item() + eps) ** 2:.3g})")
        report.add(f"{who}_first_adam_update_max_abs_diff_vs_fp64", du.max().item(), tolerance=None, passed=True,
                   claim="observed", layout=layout, model=MODEL, tensor=name, element=at,
                   grad_fp64=g64.flatten()[at].item(), grad=g.flatten()[at].item())
        report.add(f"{who}_grad_rel_error_vs_fp64", (g - g64).norm().item() / norm, tolerance=None, passed=True,
                   claim="observed", layout=layout, model=MODEL, tensor=name)
    assert got.shape == g64.shape
