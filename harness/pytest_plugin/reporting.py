"""The run report of a session: its directory, the hooks that keep results.json current (every
test's outcome, the rows recorded during each test), the `report` and `report_dir` fixtures, and
pytest-xdist's workers writing beside the controller."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from harness.launch.base import INTERRUPTED
from harness.report import Row
from harness.report import buffer as report_buffer
from harness.report.session import RunReport, as_row, claim_run_dir

_REPORT_KEY = pytest.StashKey[RunReport]()
_MOVED_KEY = pytest.StashKey["Path | None"]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_REPORT_KEY] = _run_report(config)
    config.pluginmanager.register(_ReportHooks(config.stash[_REPORT_KEY]), "megatron-rl-harness-report")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(), "megatron-rl-harness-xdist")


def _run_report(config: pytest.Config) -> RunReport:
    from harness.report.fingerprint import environment_fingerprint

    worker_input = getattr(config, "workerinput", None)
    args = list(config.invocation_params.args)
    if worker_input and "mrh_run_dir" in worker_input:  # an xdist worker: write beside the controller
        return RunReport(Path(worker_input["mrh_run_dir"]), args=args, worker=worker_input["workerid"])
    directory = config.getoption("--mrh-run-dir")
    if directory is None:
        directory = Path(config.getoption("--mrh-report-dir")) / _run_name()
    else:
        try:
            config.stash[_MOVED_KEY] = claim_run_dir(Path(directory))
        except ValueError as exc:
            raise pytest.UsageError(f"--mrh-run-dir: {exc}") from exc
    return RunReport(Path(directory), args=args, fingerprint=environment_fingerprint())


def _run_name() -> str:
    import time
    import uuid

    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


class _XdistHooks:
    """Registered only with pytest-xdist: tells each worker where the run's report lives."""

    @pytest.hookimpl
    def pytest_configure_node(self, node) -> None:
        node.workerinput["mrh_run_dir"] = str(node.config.stash[_REPORT_KEY].directory)


def _suite(item_or_path) -> str:
    return Path(str(getattr(item_or_path, "fspath", item_or_path))).parent.name


def _spec(item: pytest.Item) -> dict:
    """The row's layer-spec column: the test's backend parameter, where it has one."""
    spec = getattr(getattr(item, "callspec", None), "params", {}).get("spec")
    return {"spec": spec} if spec else {}


def _bridge() -> dict:
    """The row's bridge column: the session's (collection.selected_bridge put it in the environment
    the worlds hand their ranks), on every row, so rows of two stacks never pair up by accident."""
    from harness.bridge import backends

    bridge = os.environ.get(backends.ENV, "")
    return {"bridge": bridge} if bridge else {}


def _generated(item: pytest.Item) -> dict:
    """Fields for the rows of a hypothesis test: its examples differ from run to run, so
    `mrh report compare` must never pair one run's rows with another's."""
    return {"generated": True} if getattr(getattr(item, "obj", None), "is_hypothesis_test", False) else {}


class _ReportHooks:
    """Keeps the run report current: outcomes of every test, rows recorded during each test."""

    def __init__(self, run_report: RunReport):
        self.run_report = run_report
        self._render_run = None
        if run_report.worker is None:
            # Imported now, not at session end: pytester restores sys.modules after each test,
            # and numpy (under pandas) cannot be imported twice in one process.
            from harness.report.render import render_run

            self._render_run = render_run

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.run_report.collected((item.nodeid, _suite(item)) for item in session.items)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        yield
        fields = _generated(item)
        rows = [as_row({**_bridge(), **_spec(item), **record, **fields}, _suite(item), item.nodeid)
                for record in report_buffer.drain()]
        self.run_report.add_rows(rows)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        message = str(report.longrepr)[-2000:] if report.longrepr else ""
        self.run_report.outcome(report.nodeid, _suite(report.fspath), report.when, report.outcome,
                                report.duration, message)
        if report.when == "teardown":
            self.run_report.flush()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from harness.pytest_plugin.worlds import session_worlds

        # What every world computed with: its layer spec, TF32 policy, TE version... (launch.facts)
        self.run_report.meta["worlds"] = session_worlds(session.config)
        if INTERRUPTED:
            self.run_report.meta["interrupted_calls"] = [dataclasses.asdict(i) for i in INTERRUPTED]
        self.run_report.finish()
        if self._render_run is not None:
            self._render_run(self.run_report.directory)

    def pytest_terminal_summary(self, terminalreporter, config: pytest.Config) -> None:
        moved = config.stash.get(_MOVED_KEY, None)
        if moved is not None:
            terminalreporter.write_line(f"megatron-rl-harness: the previous run there was moved to {moved}")
        for interrupted in INTERRUPTED:  # a run cut at its limit: where the ranks were
            for line in f"megatron-rl-harness: {interrupted.describe()}".splitlines():
                terminalreporter.write_line(line)
        if self.run_report.worker is None:
            rows = self.run_report.document()["rows"]
            expected = sum(not r["passed"] and r["outcome"] == "passed" for r in rows)
            unexpected = sum(not r["passed"] for r in rows) - expected
            terminalreporter.write_line(
                f"megatron-rl-harness: {len(rows)} report rows, {unexpected} over tolerance in failing "
                f"tests, {expected} in passing tests (negative controls); report in {self.run_report.directory}")


class ReportHandle:
    """A test's handle on the run report: rows get the test's suite and node id filled in."""

    def __init__(self, run_report: RunReport, node: pytest.Item):
        self._run_report = run_report
        self.suite = _suite(node)
        self.test = node.nodeid
        self._generated = _generated(node)
        self._spec = _spec(node)

    def add(self, metric: str, value: float, *, tolerance: float | None, passed: bool, claim: str,
            layout: str = "", **fields) -> Row:
        """One row; `claim` says what kind of claim it is (harness.report.claims)."""
        row = as_row({**_bridge(), **self._spec, "metric": metric, "value": value, "tolerance": tolerance, "passed": passed,
                      "claim": claim, "layout": layout, **fields, **self._generated}, self.suite, self.test)
        self._run_report.add_rows([row])
        return row

    def extend(self, rows: list[Row]) -> None:
        for row in rows:
            row.suite, row.test = self.suite, self.test
            row.spec = row.spec or self._spec.get("spec", "")
            row.bridge = row.bridge or _bridge().get("bridge", "")
            row.extra.update(self._generated)
        self._run_report.add_rows(rows)


@pytest.fixture
def report(request: pytest.FixtureRequest) -> ReportHandle:
    """Record comparison rows (suite, test, layout, metric, value, tolerance, pass) for the run report."""
    return ReportHandle(request.config.stash[_REPORT_KEY], request.node)


@pytest.fixture(scope="session")
def report_dir(pytestconfig: pytest.Config) -> Path:
    """Where this run writes its reports (created on demand): the folder holding the run's own
    directory (--mrh-report-dir, or the parent of --mrh-run-dir)."""
    path = pytestconfig.stash[_REPORT_KEY].directory.parent
    path.mkdir(parents=True, exist_ok=True)
    return path
