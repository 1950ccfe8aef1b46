"""The distribution ships every harness package and registers the pytest plugin."""
from __future__ import annotations

import importlib
import tomllib
from importlib import metadata
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]


def test_every_harness_package_is_in_the_distribution():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in config and set(config["packages"]) == {"find"}, "packages are found, not listed"
    found = set(find_packages(ROOT, **config["packages"]["find"]))
    on_disk = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "harness").rglob("__init__.py")
               if "__pycache__" not in init.parts}
    assert {"harness", "harness.pytest_plugin"} <= on_disk
    assert found == on_disk
    # A folder of modules without __init__.py is a namespace package, which find() leaves out.
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "harness").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders - on_disk == set(), "add an __init__.py to these folders"


def test_pytest_plugin_entry_point_loads_the_fixtures():
    points = [ep for ep in metadata.entry_points(group="pytest11") if ep.name == "megatron_rl_harness"]
    assert len(points) == 1
    plugin = points[0].load()
    assert plugin.__name__ == "harness.pytest_plugin.plugin"
    parts = [importlib.import_module(name) for name in plugin.pytest_plugins]
    defined = {name for part in parts for name in vars(part)}
    assert {"world_pool", "world", "fresh_world", "report", "report_dir", "policy", "reference",
            "pytest_addoption", "pytest_generate_tests", "pytest_collection_modifyitems"} <= defined


def test_pytest_registers_every_part_of_the_plugin(pytestconfig):
    plugin = importlib.import_module("harness.pytest_plugin.plugin")
    for name in plugin.pytest_plugins:
        assert pytestconfig.pluginmanager.is_registered(importlib.import_module(name)), name


def test_console_script_is_mrh():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("mrh") == "harness.cli:main"
