"""The bridge is a dimension, chosen or found, never guessed: `auto` is the one usable bridge
(installed with a megatron-core of its line), a named one that cannot run here is one clear error."""
from __future__ import annotations

import pytest

from harness.bridge import backends


def _installed(**versions):
    return lambda: {"mbridge": None, "megatron-bridge": None, "megatron-core": None, **versions}


def test_auto_is_the_one_bridge_usable_here(monkeypatch):
    monkeypatch.setattr(backends, "installed", _installed(mbridge="0.15.1", **{"megatron-core": "0.16.1"}))
    assert backends.for_world(None) == backends.for_world("auto") == "mbridge"
    monkeypatch.setattr(backends, "installed", _installed(**{"megatron-bridge": "0.6.2", "megatron-core": "0.19.2"}))
    assert backends.for_world("auto") == "megatron-bridge"


@pytest.mark.parametrize("versions, choice, message", [
    ({"mbridge": "0.15.1", "megatron-core": "0.19.2"}, "auto", "0 usable here"),
    ({"mbridge": "0.15.1", "megatron-core": "0.19.2"}, "mbridge", "needs megatron-core 0.16.x"),
    ({"mbridge": "0.15.1", "megatron-core": "0.16.1"}, "megatron-bridge", "megatron-bridge not installed"),
    ({}, "nope", "unknown bridge"),
])
def test_a_bridge_that_cannot_run_here_is_one_clear_error(monkeypatch, versions, choice, message):
    monkeypatch.setattr(backends, "installed", _installed(**versions))
    with pytest.raises(backends.BridgeChoiceError, match=message):
        backends.for_world(choice)


def test_this_environment_has_exactly_one_usable_bridge():
    """Each environment `make setup` builds has one bridge: mbridge on megatron-core 0.16, Megatron-Bridge
    on 0.19."""
    line = ".".join(backends.installed()["megatron-core"].split(".")[:2])
    expected = {"0.16": "mbridge", "0.19": "megatron-bridge"}[line]
    assert backends.usable() == [expected]
    assert backends.current() == expected
