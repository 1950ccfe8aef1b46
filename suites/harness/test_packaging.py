"""The distribution ships every harness package and registers the pytest plugin."""
from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_harness_package_is_in_the_distribution():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "harness").rglob("__init__.py")
    } | {"harness.fixtures"}
    assert on_disk - listed == set(), "add these packages to [tool.setuptools] packages"
    assert listed - on_disk == set(), "these listed packages do not exist"


def test_pytest_plugin_entry_point_loads_the_fixtures():
    points = [ep for ep in metadata.entry_points(group="pytest11") if ep.name == "megatron_rl_harness"]
    assert len(points) == 1
    plugin = points[0].load()
    assert plugin.__name__ == "harness.fixtures.plugin" and hasattr(plugin, "world")


def test_console_script_is_mrh():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("mrh") == "harness.cli:main"
