"""The distribution ships every harness package and registers the pytest plugin."""
from __future__ import annotations

import importlib
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_harness_package_is_in_the_distribution():
    """Packages are found, not listed: find(include=harness*) takes every folder with an __init__.py,
    so a folder of modules without one (a namespace package, which find() leaves out) is the only
    way to ship a package short. (setuptools itself is not imported: 3.12 venvs lack it.)"""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config == {"packages": {"find": {"include": ["harness*"]}}}
    packages = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "harness").rglob("__init__.py")
                if "__pycache__" not in init.parts}
    assert {"harness", "harness.pytest_plugin", "harness.report"} <= packages
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "harness").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders - packages == set(), "add an __init__.py to these folders"


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
