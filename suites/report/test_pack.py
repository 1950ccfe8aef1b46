"""`mrh report pack` gzips large JSON (and logs) of committed reports and drops the renderings beside
a results.json; every reader takes both forms (harness.report.packed). No process but one import
check. The tracked tree's budget: test_tree.py."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import _parser
from harness.report import cli, packed
from harness.report.compare import compare_runs
from harness.report.results import load_run
from suites.report.runs import make_run, parity_rows, write_run

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = ("tp1", "tp2", "pp2", "dp2", "tp2pp2", "dp2pp2", "tp4", "pp4")  # enough rows to pass the threshold


def big_run(directory: Path) -> Path:
    """A run directory whose results.json is over the threshold, with its renderings beside it."""
    run = write_run(directory, make_run(parity_rows(models=("tiny-qwen3", "tiny-llama", "tiny-qwen2"),
                                                    layouts=LAYOUTS)))
    assert (run / "results.json").stat().st_size > packed.THRESHOLD
    (run / "report.html").write_text("<html></html>")
    (run / "results.csv").write_text("suite\n")
    (run / "summary.md").write_text("# summary\n")
    return run


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A reports folder: a run, a GPU report over the threshold, a small JSON, a small log, a loop's
    iterations.csv (no results.json beside it: not a rendering)."""
    root = tmp_path / "reports"
    big_run(root / "gpu" / "day" / "run")
    (root / "gpu" / "day" / "name.json").write_text(json.dumps({"rows": [{"value": i} for i in range(9000)]}))
    (root / "gpu" / "day" / "name.log").write_text("PASSED\n")
    (root / "gpu" / "day" / "small.json").write_text('{"a": 1}')
    (root / "gpu" / "day" / "loop").mkdir()
    (root / "gpu" / "day" / "loop" / "iterations.csv").write_text("iteration\n")
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------- pack
def test_pack_gzips_what_is_large_and_drops_the_renderings(tree: Path, capsys) -> None:
    before = snapshot(tree)
    assert cli.main(_parser().parse_args(["report", "pack", str(tree)])) == 0
    after = snapshot(tree)
    assert sorted(after) == ["gpu/day/loop/iterations.csv", "gpu/day/name.json.gz", "gpu/day/name.log",
                             "gpu/day/run/results.json.gz", "gpu/day/run/summary.md", "gpu/day/small.json"]
    for name in ("gpu/day/name.json", "gpu/day/run/results.json"):  # the originals are gone, the contents kept
        assert gzip.decompress(after[name + ".gz"]) == before[name]
        assert len(after[name + ".gz"]) < len(before[name]) / 5
    for name in ("gpu/day/small.json", "gpu/day/name.log", "gpu/day/run/summary.md", "gpu/day/loop/iterations.csv"):
        assert after[name] == before[name]  # under the threshold, or not packed at all: untouched
    out = capsys.readouterr().out
    assert "dropped" in out and "report.html" in out and "results.csv" in out
    total = sum(len(before[n]) for n in ("gpu/day/name.json", "gpu/day/run/results.json", "gpu/day/run/report.html",
                                         "gpu/day/run/results.csv"))
    packed_bytes = len(after["gpu/day/name.json.gz"]) + len(after["gpu/day/run/results.json.gz"])
    assert out.splitlines()[-1] == f"2 packed, 2 dropped: {total} -> {packed_bytes} bytes"
    assert not list(tree.rglob(".*"))  # no temp file left behind


def test_pack_is_idempotent_and_its_bytes_deterministic(tree: Path, tmp_path: Path, capsys) -> None:
    packed.pack([tree])
    first = snapshot(tree)
    assert packed.main_pack([str(tree), str(tree / "gpu" / "day" / "run" / "results.json")]) == 0  # old paths too
    assert capsys.readouterr().out.strip() == "nothing to pack"
    assert snapshot(tree) == first
    # The same file packed elsewhere, later: the same bytes (mtime 0, no name in the gzip header).
    other = tmp_path / "other"
    other.mkdir()
    data = gzip.decompress(first["gpu/day/name.json.gz"])
    (other / "name.json").write_bytes(data)
    os.utime(other / "name.json", (time.time() + 3600,) * 2)
    packed.pack([other / "name.json"])
    assert (other / "name.json.gz").read_bytes() == first["gpu/day/name.json.gz"] == packed.gzip_bytes(data)
    header = first["gpu/day/name.json.gz"][:10]
    assert header[3] == 0 and header[4:8] == b"\0\0\0\0"  # no FNAME flag, mtime 0


def test_pack_repacks_a_plain_file_written_over_a_packed_one(tree: Path) -> None:
    """A run rewritten plain beside its packed form: the plain one is read (it is the newer), and
    packing replaces the .gz with it."""
    run = tree / "gpu" / "day" / "run"
    packed.pack([run])
    newer = make_run(parity_rows(models=("tiny-qwen3", "tiny-llama", "tiny-qwen2"),
                                 layouts=LAYOUTS, scale=2.0))
    write_run(run, newer)
    assert load_run(run)["source"] == str(run / "results.json")
    packed.pack([run])
    assert sorted(p.name for p in run.iterdir()) == ["results.json.gz", "summary.md"]
    assert packed.read_json(run / "results.json") == newer


def test_a_missing_path_is_reported_and_the_others_still_packed(tree: Path, capsys) -> None:
    """ci/device_run.sh names the run's report, which a failed summary may not have written."""
    assert packed.main_pack([str(tree / "nope.json"), str(tree)]) == 2
    assert "nope.json: no such file or directory" in capsys.readouterr().err
    assert (tree / "gpu" / "day" / "run" / "results.json.gz").is_file()


def test_the_packer_imports_only_the_standard_library() -> None:
    """ci/device_run.sh packs on a bare GPU machine (torch and the harness, maybe no pandas)."""
    code = ("import sys, harness.report.packed; "
            "print(sorted(m for m in ('torch', 'pandas', 'numpy', 'megatron') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------- readers
def test_readers_take_the_plain_and_the_packed_form_alike(tree: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(tree / "gpu" / "day" / "run", plain)
    run = tree / "gpu" / "day" / "run"
    packed.pack([run])
    expected = load_run(plain)
    for name in (run, run / "results.json", run / "results.json.gz"):
        loaded = load_run(name)
        assert loaded["rows"] == expected["rows"] and loaded["source"] == str(run / "results.json.gz")
    assert not compare_runs(plain, run / "results.json").regressed
    assert compare_runs(run, plain).unchanged == len(expected["rows"])
    assert packed.read_json(tree / "gpu" / "day" / "name.json")["rows"][-1] == {"value": 8999}
    assert packed.resolve(tree / "gpu" / "day" / "small.json") == tree / "gpu" / "day" / "small.json"
    assert packed.resolve(tree / "nope.json") == tree / "nope.json"  # errors name what was asked for


@pytest.mark.parametrize("spoil", [lambda data: b"not gzip at all", lambda data: data[:len(data) // 2]],
                         ids=["garbage", "truncated"])
def test_a_corrupt_packed_file_is_a_clear_error_naming_it(tree: Path, spoil) -> None:
    run = tree / "gpu" / "day" / "run"
    packed.pack([run])
    target = run / "results.json.gz"
    target.write_bytes(spoil(target.read_bytes()))
    with pytest.raises(ValueError, match=rf"{target}: not a readable gzip file"):
        packed.read_json(run / "results.json")
    with pytest.raises(ValueError, match=rf"{target}: not a readable gzip file"):
        load_run(run)


def test_packed_json_that_is_not_json_is_a_clear_error(tmp_path: Path) -> None:
    packed.write_packed(tmp_path / "results.json", "{not json")
    with pytest.raises(ValueError, match=r"results\.json\.gz: not a readable JSON document"):
        load_run(tmp_path)
