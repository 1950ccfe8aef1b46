"""`manifest.json`: what a checkpoint directory holds, written last, read first.

A directory is a complete checkpoint only if its manifest exists and every file it lists is there
with the recorded size and sha256. Loading checks that, and the model and layout, in the parent
before any rank touches its state.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness.checkpoint.errors import CheckpointError

# 2: the model fingerprint holds the whole RoPE configuration ("rope"), not a top-level rope_theta
# (None under transformers 5, which keeps it in rope_parameters with the scaling type).
FORMAT = "megatron-rl-harness/checkpoint/2"
MANIFEST = "manifest.json"
# The HF config fields that decide whether a checkpoint's tensors belong to a model.
_MODEL_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                 "rms_norm_eps", "attention_bias")


@dataclass
class Manifest:
    model: str  # the HF checkpoint dir the policy was built from
    model_config: dict[str, Any]  # `model_fingerprint` of its config
    layout: str
    world_size: int
    dtype: str
    optimizer_format: str
    steps_done: int
    consumed_samples: int
    megatron_core: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> size, sha256
    save_s: float = 0.0  # from the save call to the checkpoint's commit
    created: str = ""
    iteration: int | None = None  # in a checkpoint root (harness.checkpoint.root)
    async_save: bool = False
    blocking_s: float | None = None  # an async save: how long training waited for it
    spec: str = "local"  # the layer spec of the model saved (harness.bridge.specs); "local" before it was recorded
    format: str = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)


def model_fingerprint(hf_config) -> dict[str, Any]:
    """The config fields that decide whether tensors belong to a model, and its RoPE (base, type
    and scaling: a tiny-llama checkpoint is not a tiny-llama3 one)."""
    from harness.bridge.preflight import rope_parameters

    rope = {k: v for k, v in sorted(rope_parameters(hf_config).items()) if isinstance(v, (int, float, str))}
    return {**{name: getattr(hf_config, name, None) for name in _MODEL_FIELDS}, "rope": rope}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sha256_all(paths: list[Path]) -> list[str]:
    """`_sha256` of each path, several files at once: hashlib releases the GIL on large blocks, and a
    commit hashes every rank's shard (qwen3-0.6b-shape at tp2pp2: 8.3 GB, most of a 33 s sync save on
    one thread, 4x H100 2026-11-27)."""
    from concurrent.futures import ThreadPoolExecutor

    if len(paths) < 2:
        return [_sha256(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(len(paths), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(_sha256, paths))


def file_table(directory: Path) -> dict[str, dict[str, Any]]:
    """Every file of the checkpoint (recursively, manifest excluded): size and sha256."""
    paths = [p for p in sorted(directory.rglob("*")) if p.is_file() and p.relative_to(directory).as_posix() != MANIFEST]
    return {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": digest}
            for p, digest in zip(paths, _sha256_all(paths))}


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Atomically and durably (the fault point `manifest-write` is half-way into its temp file)."""
    from harness.checkpoint.durable import atomic_write_text
    from harness.checkpoint.faults import fault

    manifest.created = manifest.created or datetime.now(timezone.utc).isoformat(timespec="seconds")
    atomic_write_text(directory / MANIFEST, manifest.to_json(),
                      midway=lambda: fault("manifest-write", manifest.iteration))


def read_manifest(directory: str | os.PathLike) -> Manifest:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a complete checkpoint (no {MANIFEST}; an interrupted "
                              "save leaves none)")
    try:
        data = json.loads(path.read_text())
        manifest = Manifest(**data)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc})") from None
    if manifest.format != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.format!r}, this harness reads {FORMAT!r}")
    return manifest


def verify_files(directory: str | os.PathLike, manifest: Manifest, *, checksums: bool = True) -> None:
    """Raise one CheckpointError naming every missing, truncated, corrupt or unexpected file."""
    directory = Path(directory)
    problems, sized = [], []
    for name, want in sorted(manifest.files.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != want["size"]:
            problems.append(f"{name}: {path.stat().st_size} bytes, the manifest says {want['size']} (truncated?)")
        else:
            sized.append(name)
    if checksums:
        digests = _sha256_all([directory / name for name in sized])
        problems += [f"{name}: sha256 differs from the manifest (corrupt)"
                     for name, digest in zip(sized, digests) if digest != manifest.files[name]["sha256"]]
    problems.sort()  # by file name, whatever the problem
    if problems:
        raise CheckpointError(f"{directory}: damaged checkpoint: " + "; ".join(problems))
