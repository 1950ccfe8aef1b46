"""Zoo models on disk, and the one entry point that turns a zoo name or a user path into a dir.

`materialize` writes `<cache_dir>/<name>-seed<k>/` (config.json + safetensors, float32) once and
reuses it. Several rank processes may call it at the same moment: each writes a private temp dir
and renames it into place, so a reader never sees a half-written checkpoint, and a manifest written
last marks the dir complete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from harness.models.zoo import ZOO, build_hf_model, is_zoo_name, list_models

MANIFEST = "zoo-manifest.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CACHE_ENV = "HARNESS_MODEL_CACHE"


class ModelNotFoundError(ValueError):
    """A name is neither a zoo model nor a usable local HF checkpoint dir."""


def default_cache_dir() -> Path:
    """$HARNESS_MODEL_CACHE, else ~/.cache/megatron-rl-harness/models."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "megatron-rl-harness" / "models"


def _zoo_names_text() -> str:
    return "zoo models: " + ", ".join(list_models())


def check_checkpoint_dir(path: Path) -> Path:
    """`path` if it is an HF checkpoint dir (config.json plus safetensors weights), else raise."""
    if not path.is_dir():
        raise ModelNotFoundError(
            f"unknown model {str(path)!r}: not a zoo name and not a directory "
            f"({_zoo_names_text()}; or pass a local HF checkpoint dir)")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{path} is not an HF checkpoint dir: config.json is missing ({_zoo_names_text()})")
    missing = _missing_weight_files(path)
    if missing:
        raise ModelNotFoundError(
            f"{path} is not an HF checkpoint dir: {missing} ({_zoo_names_text()})")
    return path


def _missing_weight_files(path: Path) -> str:
    """'' when the weights are complete, else what is missing."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        absent = [shard for shard in shards if not (path / shard).is_file()]
        return f"safetensors shards listed in {SAFETENSORS_INDEX} are missing: {absent}" if absent else ""
    if not any(path.glob("*.safetensors")):
        return "no *.safetensors weights (only safetensors checkpoints are supported)"
    return ""


def zoo_dir(name: str, cache_dir: str | os.PathLike, seed: int = 0) -> Path:
    return Path(cache_dir) / f"{name}-seed{seed}"


def is_complete(path: Path) -> bool:
    """A materialized dir is complete when its manifest exists and every file it lists has the
    recorded size (guards against a dir copied or deleted in part after it was written)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return False
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return False
    return all((path / f).is_file() and (path / f).stat().st_size == size for f, size in files.items())


def materialize(name: str, cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Write zoo model `name` with weights `seed` to `<cache_dir>/<name>-seed<seed>/` and return
    that path; an existing complete dir is reused as is. Weights are stored in float32."""
    if name not in ZOO:
        raise ModelNotFoundError(f"unknown zoo model {name!r} ({_zoo_names_text()})")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = zoo_dir(name, cache, seed)
    if is_complete(final):
        return final
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache))
    try:
        _write(name, seed, tmp)
        _move_into_place(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not is_complete(final):
        raise RuntimeError(f"materialize({name!r}): {final} is incomplete after writing it")
    return final


def _write(name: str, seed: int, out: Path) -> None:
    model = build_hf_model(name, dtype=torch.float32, seed=seed)
    model.save_pretrained(out)
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    manifest = {"name": name, "seed": seed, "dtype": "float32", "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: marks the dir complete


def _move_into_place(tmp: Path, final: Path) -> None:
    if final.exists() and not is_complete(final):
        # A stale partial dir (e.g. copied in part). Move it aside first so that the rename below
        # stays atomic; a concurrent writer may have done the same, hence ignore_errors.
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}")
        try:
            final.rename(stale)
        except OSError:
            pass
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(final)
    except OSError:
        if not is_complete(final):  # lost the race only if the winner's dir is complete
            raise


def resolve_model(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  seed: int = 0) -> Path:
    """The checkpoint dir for a zoo name (materialized under `cache_dir` with `seed`) or for a local
    HF checkpoint dir (returned as is after checking it has config.json and safetensors weights).

    Raises ModelNotFoundError, whose message lists the zoo names, for anything else.
    """
    if is_zoo_name(name_or_path):
        return materialize(str(name_or_path), cache_dir, seed)
    return check_checkpoint_dir(Path(name_or_path).expanduser())
