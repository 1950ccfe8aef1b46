"""Every checkpoint variant of the catalog fails the resume check (harness.checkpoint.resume_check)
in fp32 and in bf16, under tensor, pipeline and data parallelism, by at least SENSITIVITY_MARGIN,
while the fixed path passes the same check on the same checkpoint; both runs' figures are report
rows, the variant's margin a "separation" row.

Same-layout resumes are checked bit for bit, so any drift shows, in bf16 too. Across layouts the
training tolerance table applies: fp32 sees shared-adam-step's 2.5e-4 weight drift there, bf16's
rounding noise (bound 0.02) does not, so that case runs in fp32 only.
"""
from __future__ import annotations

import pytest

from harness.checkpoint.resume_check import resume_and_compare, train_and_save
from harness.tolerance import SENSITIVITY_MARGIN
from harness.variants import for_components, get

CHECKPOINT_VARIANTS = {v.id for v in for_components("checkpoint")}
SAME = [("tp2", "tp2"), ("pp2", "pp2"), ("dp2", "dp2")]
OTHER = [("tp2", "pp2"), ("pp2", "tp2"), ("dp2", "tp2")]
# (variant, [(source layout, target layout)], dtypes); what each needs (dropout, the optimizer
# format) comes from its catalog entry's options.
CASES = [
    ("shared-adam-step", SAME, ("fp32", "bf16")),
    ("shared-adam-step", [("tp2", "pp2")], ("fp32",)),
    ("rng-not-restored", SAME, ("fp32", "bf16")),
    ("dp-reshardable", OTHER, ("fp32", "bf16")),
]
PARAMS = [pytest.param(v, a, b, dtype, id=f"{v}-{a}-to-{b}-{dtype}")
          for v, pairs, dtypes in CASES for a, b in pairs for dtype in dtypes]


def test_every_checkpoint_variant_has_cases():
    assert {case[0] for case in CASES} == CHECKPOINT_VARIANTS


@pytest.fixture(scope="session")
def _sources():
    return {}


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"),
                                    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("variant, source, target, dtype", PARAMS)
def test_checkpoint_variant_fails_the_resume_check_by_a_margin(policy, device, variant, source, target,
                                                               dtype, tmp_path_factory, _sources, report):
    options = dict(get(variant).options)
    key = (device, source, dtype, tuple(sorted(options.items())))
    if key not in _sources:
        directory = tmp_path_factory.mktemp(f"src-{source}-{dtype}") / "ckpt"
        _sources[key] = train_and_save(policy, source, directory, dtype=dtype, deterministic=True,
                                       **options)
    src = _sources[key]
    fixed = resume_and_compare(policy, src, target)
    buggy = resume_and_compare(policy, src, target, variant=variant)
    report.extend(fixed.rows() + buggy.rows())
    ok = buggy.separation >= SENSITIVITY_MARGIN
    worst = max(buggy.checks, key=lambda c: c.margin)
    report.add("separation", buggy.separation, tolerance=SENSITIVITY_MARGIN, passed=ok, layout=buggy.pair,
               dtype=dtype, device=device, variant=variant, worst_metric=worst.metric, tolerance_kind="min",
               load_error=buggy.load_error)
    assert fixed.passed, fixed.summary()
    assert not buggy.passed, f"variant {variant} went unnoticed: {buggy.summary()}"
    assert ok, buggy.summary()
