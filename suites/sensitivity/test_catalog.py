"""The catalog of wrong variants is one source of truth: every entry is implemented by its
component, nothing is implemented that the catalog does not list, every entry says what it is,
and `mrh repro` lists and reproduces them (exit 0 reproduced, 2 bad input)."""
from __future__ import annotations

import json

import pytest

from harness.checkpoint.checkpointer import IMPLEMENTED as ROTATION
from harness.checkpoint.manager import IMPLEMENTED as CHECKPOINT
from harness.offload import IMPLEMENTED as OFFLOAD
from harness.parity.fp8 import IMPLEMENTED as FP8
from harness.parity.variants import IMPLEMENTED as PARITY
from harness.rollout import IMPLEMENTED as SYNC
from harness.training.policy import IMPLEMENTED as TRAINING
from harness.training.routing_replay import IMPLEMENTED as ROUTING_REPLAY
from harness.variants import CATALOG, COMPONENTS, VariantError, for_components, require

def test_each_component_implements_exactly_its_entries():
    ids = {c: {v.id for v in for_components(c)} for c in COMPONENTS}
    assert set(PARITY) == ids["bridge"] | ids["logprobs"] | ids["precision"]
    assert set(TRAINING) == ids["training"]
    assert set(CHECKPOINT) == ids["checkpoint"]
    assert set(ROTATION) == ids["rotation"]
    assert set(OFFLOAD) == ids["offload"]
    assert set(SYNC) == ids["weight-sync"]
    assert set(FP8) == ids["fp8"]
    assert set(ROUTING_REPLAY) == ids["routing-replay"]


def test_every_entry_says_what_it_is():
    for variant in CATALOG.values():
        assert variant.component in COMPONENTS and variant.kind in ("negative-control", "upstream-bug")
        assert min(len(variant.description), len(variant.symptom), len(variant.caught_by)) > 20, variant.id
        if variant.kind == "upstream-bug":
            assert variant.upstream, f"{variant.id}: an upstream bug names its report"


def test_a_megatron_core_bug_says_per_version_whether_megatron_core_still_has_it():
    """An entry for a megatron-core bug the harness works around names its workaround, whose gate
    was measured per megatron-core version (test_upstream_workarounds): the catalog says so."""
    from harness.compat.megatron_core import WORKAROUNDS

    linked = [v for v in CATALOG.values() if v.workaround]
    assert linked, "no catalog entry names a megatron-core workaround"
    for variant in linked:
        gate = next((w for w in WORKAROUNDS if w.name == variant.workaround), None)
        assert gate is not None, f"{variant.id}: no workaround {variant.workaround!r} in harness.compat.megatron_core"
        assert all(version in variant.versions() for version in gate.verified_on + gate.not_needed_on)
    assert all(v.versions() is None for v in CATALOG.values() if not v.workaround)


def test_a_check_takes_only_its_own_components_variants():
    assert require("scaled-norm", check="parity").id == "scaled-norm"
    with pytest.raises(VariantError, match="is a training variant"):
        require("no-finalize-grads", check="parity")
    with pytest.raises(VariantError, match="unknown variant"):
        require("nope", check="checkpoint")


def test_repro_lists_the_catalog(capsys):
    """In process (`mrh` itself starts in the end-to-end run below): the JSON and the text listing."""
    from harness.cli import main

    assert main(["repro", "--list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [row["id"] for row in listed] == list(CATALOG)
    assert all(row["caught_by"] and row["component"] for row in listed)
    assert main(["repro", "--list"]) == 0
    text = capsys.readouterr().out
    assert "mbridge PR 14" in text and "NeMo-RL PR 1426" in text


def test_repro_reproduces_a_bf16_norm_scale_and_its_fix_holds(cli_on_session_worlds, capsys):
    """`mrh repro`'s main in process, on the session's worlds (cli_on_session_worlds: the command's
    code, output and exit code without a fresh world, ~17 s on the CI machine; the `mrh` console script
    itself runs in test_preflight's exit-2 case)."""
    from harness.cli import main

    capsys.readouterr()
    code = main(["repro", "scaled-norm", "--layout", "tp2"])
    out, err = capsys.readouterr()
    assert code == 0, out + err[-3000:]
    assert "REPRODUCED" in out and "separating metric" in out


@pytest.mark.parametrize("args, message", [
    (["nope"], "unknown variant"),
    ([], "name a catalog entry"),
    (["swapped-tp-shards", "--layout", "pp2"], "does not apply"),
    (["shared-adam-step", "--layout", "tp2"], "source->target"),
    (["scaled-norm", "--layout", "tp3"], "layout 'tp3'"),
    (["no-finalize-grads", "--layout", "pp2"], "needs a gradient reduced across ranks"),
])
def test_repro_bad_input_is_one_clear_error_with_exit_2(args, message, capsys):
    """In process (the end-to-end CLI runs above): the exit code and the one line on stderr."""
    from harness.cli import main

    assert main(["repro", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert "running the check" not in err, "nothing may start before the input is validated"
