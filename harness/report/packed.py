"""Committed reports, packed: `mrh report pack PATH...`, and the readers that take both forms.

A lent GPU machine receives at most 64 MiB per command: the tracked tree plus what the command
carries (one of ../shared/vllm, 38.4 MB, or ../shared/te, 27.8 MB). Committed run reports are mostly
JSON that gzip shrinks 20-30 fold, so every `*.json` (and `*.log`) over THRESHOLD under a committed
reports folder is stored as `NAME.json.gz` instead (gzip level 9, mtime 0 and no file name in the
header: packing the same file again gives the same bytes). The renderings beside a run's
results.json (report.html, results.csv) are dropped: `mrh report render RUN_DIR` rebuilds them.

Every reader goes through `resolve`: a path names the plain file (`.../results.json`), and when that
is absent its packed form `.../results.json.gz` is read. So the paths that name committed reports
(harness.evidence, the Makefile's BASELINE, docs) keep naming `results.json`. New runs
(reports/runs/, written by the pytest plugin) stay plain; only committed files are packed.

Standard library only: ci/device_run.sh packs a GPU run's files on a machine where only torch and
the harness are installed (`python3 -m harness.report.packed PATH...`).
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

GZ = ".gz"
THRESHOLD = 64 * 1024  # bytes: files over this are packed
PACKED_SUFFIXES = (".json", ".log")  # what is packed when over THRESHOLD
RENDERINGS = ("report.html", "results.csv")  # dropped beside a results.json: `mrh report render` rebuilds them
RESULTS_FORMS = ("results.json", "results.json" + GZ)


def packed_path(path: str | os.PathLike) -> Path:
    """`results.json` -> `results.json.gz`."""
    path = Path(path)
    return path.with_name(path.name + GZ)


def resolve(path: str | os.PathLike) -> Path:
    """The file that holds `path`: the path itself when it exists, else its packed form PATH.gz when
    that exists, else `path` unchanged (so a "no such file" error names what was asked for)."""
    path = Path(path)
    if path.exists() or path.name.endswith(GZ):
        return path
    packed = packed_path(path)
    return packed if packed.is_file() else path


def is_file(path: str | os.PathLike) -> bool:
    """True when `path` or its packed form is a file."""
    return resolve(path).is_file()


def unpack(data: bytes, source: str | os.PathLike) -> bytes:
    """The contents of a packed file; ValueError naming `source` when it is not readable gzip."""
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{source}: not a readable gzip file ({exc})") from exc


def read_bytes(path: str | os.PathLike) -> bytes:
    """The bytes of `path`, or of its packed form unpacked. OSError when neither exists, ValueError
    (naming the file) when the packed form is corrupt."""
    source = resolve(path)
    data = source.read_bytes()
    return unpack(data, source) if source.name.endswith(GZ) else data


def read_text(path: str | os.PathLike, encoding: str = "utf-8", errors: str = "strict") -> str:
    return read_bytes(path).decode(encoding, errors)


def read_json(path: str | os.PathLike) -> Any:
    """The JSON document at `path` or its packed form. OSError when neither exists; ValueError naming
    the file when it is not readable gzip or not JSON."""
    source = resolve(path)
    text = read_bytes(source)
    try:
        return json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{source}: not a readable JSON document ({exc})") from exc


def gzip_bytes(data: bytes) -> bytes:
    """Deterministic gzip: level 9, mtime 0, no file name (the same input gives the same bytes)."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as f:
        f.write(data)
    return buffer.getvalue()


def _write_durably(path: Path, data: bytes) -> None:
    """Temp file beside `path`, fsync, rename: readers see the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_packed(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `data` packed to PATH.gz (`path` names the plain file) and remove a plain PATH, which
    would otherwise be read instead. Returns the .gz path."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    target = packed_path(path)
    _write_durably(target, gzip_bytes(raw))
    path.unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class Action:
    """What `pack` did to one file: "packed" (to `target`) or "dropped" (a rendering)."""

    kind: str
    path: Path
    before: int  # bytes
    after: int  # bytes (0 for a dropped file)
    target: Path | None = None

    def line(self) -> str:
        if self.kind == "packed":
            return f"packed  {self.path} -> {self.target.name}: {self.before} -> {self.after} bytes"
        return f"dropped {self.path} ({self.before} bytes; `mrh report render` rebuilds it)"


def _files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())
        elif path.is_file():
            found.append(path)
        elif not packed_path(path).is_file():  # already packed: nothing to do
            raise ValueError(f"{path}: no such file or directory")
    return found


def pack(paths: Iterable[str | os.PathLike], threshold: int = THRESHOLD) -> list[Action]:
    """Pack every `*.json` / `*.log` over `threshold` bytes under `paths` (files or folders) into
    NAME.gz, and drop report.html / results.csv beside a results.json (either form). Idempotent:
    packed files are left alone. Each file is written to a temp file, fsynced and renamed, checked
    to unpack to the original, and only then is the original removed."""
    actions = []
    for file in _files(paths):
        if file.name in RENDERINGS and any((file.parent / name).is_file() for name in RESULTS_FORMS):
            size = file.stat().st_size
            file.unlink()
            actions.append(Action("dropped", file, size, 0))
        elif file.suffix in PACKED_SUFFIXES and file.stat().st_size > threshold:
            data = file.read_bytes()
            target = packed_path(file)
            _write_durably(target, gzip_bytes(data))
            if unpack(target.read_bytes(), target) != data:
                raise ValueError(f"{target}: does not unpack to {file} (left both in place)")
            file.unlink()
            actions.append(Action("packed", file, len(data), target.stat().st_size, target))
    return actions


def main_pack(argv: list[str] | None = None) -> int:
    """Exit 0 when done (or nothing to do), 2 when a path does not exist or a file cannot be packed."""
    parser = argparse.ArgumentParser(
        prog="mrh report pack",
        description="gzip committed report files over a threshold (*.json, *.log -> *.gz, readers take both "
                    "forms) and drop the renderings beside a results.json (report.html, results.csv)")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (searched recursively)")
    parser.add_argument("--threshold", type=int, default=THRESHOLD,
                        help=f"pack files over this many bytes (default {THRESHOLD})")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    # A missing path is reported, and the others are still packed (ci/device_run.sh passes the
    # report of a run whose summary may have failed to be written).
    missing = [p for p in args.paths if not Path(p).exists() and not packed_path(p).is_file()]
    for path in missing:
        print(f"mrh report pack: {path}: no such file or directory", file=sys.stderr)
    try:
        actions = pack([p for p in args.paths if p not in missing], args.threshold)
    except (OSError, ValueError) as exc:
        print(f"mrh report pack: {exc}", file=sys.stderr)
        return 2
    for action in actions:
        print(action.line())
    before = sum(a.before for a in actions)
    after = sum(a.after for a in actions)
    packed = sum(a.kind == "packed" for a in actions)
    print(f"{packed} packed, {len(actions) - packed} dropped: {before} -> {after} bytes"
          if actions else "nothing to pack")
    return 2 if missing else 0


if __name__ == "__main__":  # python3 -m harness.report.packed PATH... (ci/device_run.sh)
    raise SystemExit(main_pack())
