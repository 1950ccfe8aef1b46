"""CUDA variants run only when the `-m` expression asks for `gpu`: a plain run, `-m "not slow"`,
`-m nightly` or `-m upstream` stays the CPU tier; `-m gpu`, `-m "gpu and not slow"` or
`-m "nightly and gpu"` select them (and pytest's own `-m` picks among them). Nightly sweeps run
only when `-m` names `nightly` or `--mrh-nightly` is given."""
from __future__ import annotations

import pytest

from harness.pytest_plugin.collection import selects_gpu

INNER = """
import pytest

def test_plain(device):
    pass

@pytest.mark.slow
def test_slow(device):
    pass

@pytest.mark.nightly
def test_nightly(device):
    pass

@pytest.mark.upstream
def test_upstream(device):
    pass
"""
ALL = ("plain", "slow", "nightly", "upstream")


def _ids(names, device: str) -> set[str]:
    """The ids under --mrh-spec local: the CPU tier's stays `cpu`, CUDA's names its layer spec."""
    backend = "cuda-local" if device == "cuda" else device
    return {f"test_{name}[{backend}]" for name in names}


DAILY = ("plain", "slow", "upstream")  # what a run that does not ask for nightly keeps
CASES = {
    None: _ids(DAILY, "cpu"),
    "not slow": _ids(("plain", "upstream"), "cpu"),
    "nightly": _ids(("nightly",), "cpu"),
    "not nightly": _ids(DAILY, "cpu"),
    "upstream": _ids(("upstream",), "cpu"),
    "not gpu": _ids(DAILY, "cpu"),
    "gpu": _ids(DAILY, "cuda"),
    "gpu and not slow": _ids(("plain", "upstream"), "cuda"),
    "nightly and gpu": _ids(("nightly",), "cuda"),
    "(not slow) and gpu": _ids(("plain", "upstream"), "cuda"),
    "gpu or slow": _ids(DAILY, "cuda") | _ids(("slow",), "cpu"),
}
# --mrh-nightly adds the nightly sweeps to whatever -m keeps.
WITH_NIGHTLY = {None: _ids(ALL, "cpu"), "gpu": _ids(ALL, "cuda"), "not slow": _ids(("plain", "nightly", "upstream"), "cpu")}


@pytest.mark.parametrize("markexpr", list(CASES), ids=lambda e: f"m={e}")
def test_cuda_variants_only_when_the_expression_selects_gpu(pytester, markexpr):
    pytester.makepyfile(test_inner=INNER)
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "--mrh-spec=local",
            f"--mrh-report-dir={pytester.path / 'reports'}"]
    result = pytester.runpytest(*args, *(["-m", markexpr] if markexpr else []))
    selected = {line.split("::", 1)[1] for line in result.outlines if line.startswith("test_inner.py::")}
    assert selected == CASES[markexpr]


@pytest.mark.parametrize("markexpr", list(WITH_NIGHTLY), ids=lambda e: f"m={e}")
def test_mrh_nightly_adds_the_nightly_sweeps(pytester, markexpr):
    pytester.makepyfile(test_inner=INNER)
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "--mrh-nightly", "--mrh-spec=local",
            f"--mrh-report-dir={pytester.path / 'reports'}"]
    result = pytester.runpytest(*args, *(["-m", markexpr] if markexpr else []))
    selected = {line.split("::", 1)[1] for line in result.outlines if line.startswith("test_inner.py::")}
    assert selected == WITH_NIGHTLY[markexpr]


@pytest.mark.parametrize(("markexpr", "expected"), [
    ("", False), ("   ", False), ("slow", False), ("not slow", False), ("not gpu", False),
    ("nightly or upstream", False), ("gpu", True), ("gpu and not slow", True), ("not (not gpu)", True),
    ("slow and (nightly or gpu)", True), ("(a or b) and (c or gpu)", True), ("gpu and not gpu", False),
])
def test_selects_gpu(markexpr, expected):
    assert selects_gpu(markexpr) is expected


def test_a_malformed_expression_is_a_usage_error():
    with pytest.raises(pytest.UsageError, match="not a valid marker expression"):
        selects_gpu("gpu and")


def test_every_cuda_variant_runs_once_per_selected_layer_spec(pytester, monkeypatch):
    """The spec is a dimension: --mrh-spec names it (auto: both where TE is installed), each CUDA
    test runs once per spec; the CPU tier is local whatever is asked (TE has no CPU kernels)."""
    from harness.bridge import specs

    pytester.makepyfile(test_inner=INNER)
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu or not slow",
            f"--mrh-report-dir={pytester.path / 'reports'}", "-k", "plain"]
    monkeypatch.setattr(specs, "installed", lambda: True)  # the pytester run is in this process
    both = pytester.runpytest(*args, "--mrh-spec=both")
    assert {l.split("::", 1)[1] for l in both.outlines if l.startswith("test_inner.py::")} == {
        "test_plain[cpu]", "test_plain[cuda-te]", "test_plain[cuda-local]"}
    monkeypatch.setattr(specs, "installed", lambda: False)
    auto = pytester.runpytest(*args)  # auto without TE: local only, no silent TE
    assert {l.split("::", 1)[1] for l in auto.outlines if l.startswith("test_inner.py::")} == {
        "test_plain[cpu]", "test_plain[cuda-local]"}
    refused = pytester.runpytest(*args, "--mrh-spec=te")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*--mrh-spec te needs Transformer Engine*not installed*"])


SWEEP = """
import pytest

NIGHTLY = pytest.mark.nightly

@pytest.mark.layouts(cpu=["tp2", pytest.param("pp2", marks=NIGHTLY)], cuda=["tp2", "pp2"])
def test_layout(device, layout):
    pass

@pytest.mark.layout_pairs(cpu=[("tp2", "dp2"), pytest.param("dp2", "pp2", marks=NIGHTLY)], cuda=[("tp2", "pp2")])
def test_pair(device, source, target):
    pass
"""


def test_a_layout_entry_may_carry_the_nightly_marker(pytester):
    """`layouts`/`layout_pairs` entries may be pytest.param(..., marks=...): a sweep keeps its CI point
    and runs the rest nightly, on that device only, its test ids unchanged."""
    pytester.makepyfile(test_inner=SWEEP)
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "--mrh-spec=local",
            f"--mrh-report-dir={pytester.path / 'reports'}"]

    def ids(*extra):
        done = pytester.runpytest(*args, *extra)
        return {l.split("::", 1)[1] for l in done.outlines if l.startswith("test_inner.py::")}

    daily = {"test_layout[cpu-tp2]", "test_pair[cpu-tp2-to-dp2]"}
    assert ids() == daily
    assert ids("--mrh-nightly") == daily | {"test_layout[cpu-pp2]", "test_pair[cpu-dp2-to-pp2]"}
    assert ids("-m", "nightly") == {"test_layout[cpu-pp2]", "test_pair[cpu-dp2-to-pp2]"}
    assert ids("-m", "gpu") == {"test_layout[cuda-local-tp2]", "test_layout[cuda-local-pp2]",
                                "test_pair[cuda-local-tp2-to-pp2]"}


CRASHING = """
import pytest

@pytest.mark.crash_injection
def test_crash(device):
    pass
"""


def test_cuda_crash_injection_runs_on_te_in_the_tier_and_on_local_nightly(pytester, monkeypatch):
    """With both specs selected, `-m gpu` crashes CUDA jobs on TE's spec only; --mrh-nightly adds
    the local spec's; a run of the local spec alone keeps them (CRASH_INJECTION_ON_CUDA)."""
    from harness.bridge import specs

    pytester.makepyfile(test_inner=CRASHING)
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu or not slow",
            f"--mrh-report-dir={pytester.path / 'reports'}"]
    monkeypatch.setattr(specs, "installed", lambda: True)

    def ids(*extra):
        done = pytester.runpytest(*args, *extra)
        return {l.split("::", 1)[1] for l in done.outlines if l.startswith("test_inner.py::")}

    assert ids("--mrh-spec=both") == {"test_crash[cpu]", "test_crash[cuda-te]"}
    assert ids("--mrh-spec=both", "--mrh-nightly") == {"test_crash[cpu]", "test_crash[cuda-te]", "test_crash[cuda-local]"}
    assert ids("--mrh-spec=local") == {"test_crash[cpu]", "test_crash[cuda-local]"}


def test_the_bridge_is_named_or_the_one_usable_here(pytester, monkeypatch):
    """The bridge is a dimension of a run: --mrh-bridge names it, auto takes the one this environment
    can run (its megatron-core line), and a bridge it cannot run is a usage error before collection,
    never a silent fallback. The choice reaches the worlds through the environment."""
    import os

    from harness.bridge import backends

    pytester.makepyfile(test_inner=INNER)
    args = ["--collect-only", "-q", "-p", "no:cacheprovider", f"--mrh-report-dir={pytester.path / 'reports'}"]
    here = backends.for_world("auto")
    other = next(b for b in backends.BACKENDS if b != here)
    monkeypatch.delenv(backends.ENV, raising=False)
    assert pytester.runpytest(*args).ret == pytest.ExitCode.OK
    assert os.environ[backends.ENV] == here
    monkeypatch.delenv(backends.ENV)
    refused = pytester.runpytest(*args, f"--mrh-bridge={other}")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines([f"*--mrh-bridge: bridge {other!r} cannot run here*"])
    assert backends.ENV not in os.environ
