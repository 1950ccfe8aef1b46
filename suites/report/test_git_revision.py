"""The commit of a run, in its fingerprint (results.json meta) and in a GPU report (JSON + Markdown):
from $MRH_GIT_COMMIT (and $MRH_GIT_DIRTY) when the caller sets them, since a copied tree may carry
a stale .git (the lent GPU machines' copies did: they reported the session's first commit);
otherwise from git; "unknown" only when neither has it."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.report.fingerprint import environment_fingerprint, git_revision
from harness.report.summary import summary_markdown
from suites.report.runs import make_run, parity_rows

REPO = Path(__file__).resolve().parents[2]
SHA = "0123456789abcdef0123456789abcdef01234567"
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="1"><testcase classname="suites.parity.test_parity"
 name="test_x[cuda-tp2]" time="1.5"/></testsuite></testsuites>"""


@pytest.fixture
def no_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory without .git (as the GPU machines get it) and no commit variables."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "no-such-git-dir"))
    for name in ("MRH_GIT_COMMIT", "MRH_GIT_DIRTY"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_without_git_or_variable_the_commit_is_unknown(no_git):
    assert git_revision() == {"git_commit": "unknown", "git_dirty": None}
    assert environment_fingerprint()["git_commit"] == "unknown"


@pytest.mark.parametrize(("dirty", "expected"), [(None, None), ("0", False), ("1", True), ("maybe", None)])
def test_without_git_the_variables_give_the_commit(no_git, monkeypatch, dirty, expected):
    monkeypatch.setenv("MRH_GIT_COMMIT", f" {SHA}\n")
    if dirty is not None:
        monkeypatch.setenv("MRH_GIT_DIRTY", dirty)
    assert git_revision() == {"git_commit": SHA, "git_dirty": expected}
    fingerprint = environment_fingerprint()
    assert (fingerprint["git_commit"], fingerprint["git_dirty"]) == (SHA, expected)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_variable_wins_over_a_stale_git_and_git_sees_a_dirty_tree(tmp_path, monkeypatch):
    monkeypatch.delenv("GIT_DIR", raising=False)
    for name in ("MRH_GIT_COMMIT", "MRH_GIT_DIRTY"):
        monkeypatch.delenv(name, raising=False)
    _git("init", "-q", cwd=tmp_path)
    (tmp_path / "f.txt").write_text("a")
    _git("add", "f.txt", cwd=tmp_path)
    _git("commit", "-q", "-m", "one", cwd=tmp_path)
    head = _git("rev-parse", "HEAD", cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    assert git_revision() == {"git_commit": head, "git_dirty": False}
    (tmp_path / "f.txt").write_text("b")
    assert git_revision() == {"git_commit": head, "git_dirty": True}
    monkeypatch.setenv("MRH_GIT_COMMIT", SHA)
    monkeypatch.setenv("MRH_GIT_DIRTY", "0")
    assert git_revision() == {"git_commit": SHA, "git_dirty": False}


def test_the_summary_shows_the_commit_and_whether_the_tree_was_dirty():
    run = make_run(parity_rows())
    run["meta"]["fingerprint"].update(git_commit=SHA, git_dirty=True)
    assert "| 0123456789+dirty |" in summary_markdown(run)
    run["meta"]["fingerprint"].update(git_commit="unknown", git_dirty=None)
    assert "| unknown |" in summary_markdown(run)


def _gpu_report():
    spec = importlib.util.spec_from_file_location("gpu_report", REPO / "ci" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("commit", [SHA, None])
def test_gpu_report_records_the_commit_in_json_and_markdown(no_git, monkeypatch, commit):
    if commit:
        monkeypatch.setenv("MRH_GIT_COMMIT", commit)
        monkeypatch.setenv("MRH_GIT_DIRTY", "1")
    (no_git / "run.junit.xml").write_text(JUNIT)
    (no_git / "run.log").write_text("")
    _gpu_report().main(["--name", "run", "--junit", "run.junit.xml", "--log", "run.log", "--started", "now",
                        "--command", "pytest suites -m gpu", "--out", str(no_git), "--wall-s", "2"])
    environment = json.loads((no_git / "run.json").read_text())["environment"]
    markdown = (no_git / "run.md").read_text()
    if commit:
        assert (environment["git_commit"], environment["git_dirty"]) == (SHA, True)
        assert f"- commit: `{SHA}` +dirty" in markdown
    else:
        assert (environment["git_commit"], environment["git_dirty"]) == ("unknown", None)
        assert "- commit: `unknown`\n" in markdown


def test_gpu_report_counts_no_test_for_an_interrupted_run(no_git):
    """A run stopped by its time limit (SIGINT) leaves a nameless testcase in pytest's JUnit file: not a
    test (it was counted as a passed "None::None" once); the report says the run was interrupted."""
    junit = JUNIT.replace("</testsuite>", '<testcase time="0.0" /></testsuite>')
    assert junit != JUNIT
    (no_git / "run.junit.xml").write_text(junit)
    (no_git / "run.log").write_text("!!! KeyboardInterrupt !!!\n")
    _gpu_report().main(["--name", "run", "--junit", "run.junit.xml", "--log", "run.log", "--started", "now",
                        "--command", "pytest suites -m gpu", "--out", str(no_git), "--wall-s", "2"])
    report = json.loads((no_git / "run.json").read_text())
    assert report["interrupted"] is True and all("None" not in t["test"] for t in report["tests"])
    assert sum(report["counts"].values()) == len(report["tests"]) >= 1
    assert "interrupted (SIGINT" in (no_git / "run.md").read_text()


# ------------------------------------------------------------------------------ ci/device_run.sh
def _device_run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """ci/device_run.sh in a tree without .git, with a stub python3 that records the commit variables
    it is started with (so nothing is installed and no test runs)."""
    (tmp_path / "ci").mkdir()
    shutil.copy(REPO / "ci" / "device_run.sh", tmp_path / "ci")
    (tmp_path / "bin").mkdir()
    seen = tmp_path / "seen.txt"
    stub = tmp_path / "bin" / "python3"
    stub.write_text(f'#!/bin/sh\necho "${{MRH_GIT_COMMIT:-}} ${{MRH_GIT_DIRTY:-}}" >> {seen}\n')
    stub.chmod(0o755)
    (tmp_path / "out").mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("MRH_GIT")}
    done = subprocess.run(["bash", "ci/device_run.sh", "name", "suites"], cwd=tmp_path, text=True, capture_output=True,
                          env={**base, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
                               "GIT_DIR": str(tmp_path / "no-such-git-dir"), **env})
    return done, seen


def test_device_run_passes_the_commit_through(tmp_path):
    done, seen = _device_run(tmp_path, MRH_GIT_COMMIT=SHA, MRH_GIT_DIRTY="0")
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr
    assert set(seen.read_text().splitlines()) == {f"{SHA} 0"}  # the install check, pytest, gpu_report


def test_device_run_warns_without_a_commit(tmp_path):
    done, seen = _device_run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "WARNING: no .git here and MRH_GIT_COMMIT is unset" in done.stderr and "ci/git_env.sh" in done.stderr


@pytest.mark.parametrize(("env", "message"), [({"MRH_GIT_COMMIT": "not-a-sha"}, "is not a git sha"),
                                              ({"MRH_GIT_COMMIT": SHA, "MRH_GIT_DIRTY": "yes"}, "must be 0 or 1")])
def test_device_run_refuses_bad_commit_variables_before_any_work(tmp_path, env, message):
    done, seen = _device_run(tmp_path, **env)
    assert done.returncode == 2 and message in done.stderr
    assert not seen.exists()  # python3 never started


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_env_prints_this_checkouts_commit():
    printed = subprocess.run(["bash", str(REPO / "ci" / "git_env.sh")], capture_output=True, text=True, check=True).stdout
    commit, dirty = (part.split("=", 1) for part in printed.split())
    assert commit == ["MRH_GIT_COMMIT", _git("rev-parse", "HEAD", cwd=REPO)] and dirty[0] == "MRH_GIT_DIRTY"
    assert dirty[1] in ("0", "1")
