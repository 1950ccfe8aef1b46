"""The tracked tree fits a lent GPU machine's command: at most 64 MiB per command, the tree plus
../shared/vllm (38.4 MB) or ../shared/te (27.8 MB). Large committed reports are packed
(`mrh report pack`, harness.report.packed); these checks fail when the tree grows past its budget
or a committed report is left unpacked. Skipped outside a git checkout (a GPU machine's tree)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from harness.report import packed

REPO = Path(__file__).resolve().parents[2]
TREE_BUDGET = 24 * 2**20  # bytes of tracked files; a GPU command carries 64 MiB, ../shared/vllm takes 38.4 MB


def _tracked() -> list[Path]:
    if shutil.which("git") is None:
        pytest.skip("needs git")
    done = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if done.returncode != 0 or not (REPO / ".git").exists():
        pytest.skip("not a git checkout (a GPU machine's tree comes without .git)")
    return [REPO / name for name in done.stdout.decode().split("\0") if name and (REPO / name).is_file()]


def test_the_tracked_tree_fits_a_gpu_command_with_a_bundle() -> None:
    """A lent GPU machine receives at most 64 MiB per command: the tracked tree plus ../shared/vllm
    (38.4 MB) or ../shared/te (27.8 MB). Past the budget, pack what is large."""
    files = _tracked()
    sizes = sorted(((path.stat().st_size, path.relative_to(REPO).as_posix()) for path in files), reverse=True)
    total = sum(size for size, _ in sizes)
    largest = "\n".join(f"  {size / 2**20:6.2f} MiB  {name}" for size, name in sizes[:10])
    assert total < TREE_BUDGET, (
        f"the tracked files take {total / 2**20:.1f} MiB, over the {TREE_BUDGET / 2**20:.0f} MiB budget "
        f"(a GPU command carries 64 MiB: the tree plus one bundle). Pack committed reports with "
        f"`mrh report pack reports/...` (docs/reports.md), or keep large files out. The largest:\n{largest}")


def test_committed_reports_are_packed() -> None:
    """What `mrh report pack reports` would still change in the tracked tree: nothing."""
    files = [p for p in _tracked() if p.relative_to(REPO).parts[0] == "reports"]
    unpacked = [p.relative_to(REPO).as_posix() for p in files
                if (p.suffix in packed.PACKED_SUFFIXES and p.stat().st_size > packed.THRESHOLD)
                or (p.name in packed.RENDERINGS and any((p.parent / n).is_file() for n in packed.RESULTS_FORMS))]
    assert not unpacked, (f"{len(unpacked)} committed report files are not packed, e.g. {unpacked[:5]}: "
                          f"run `mrh report pack {' '.join(sorted({u.rsplit('/', 1)[0] for u in unpacked})[:3])}` "
                          f"and commit the result (docs/reports.md)")
