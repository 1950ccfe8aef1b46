"""The plain-tensor diff of two checkpoints: every sharded tensor as one full tensor, compared key by key.

Checkpoints of one model saved under different TP/PP layouts hold the same full tensors (model
weights, fully_reshardable optimizer state), so a correct reshard diffs equal, exactly.

Reading needs no process group: `megatron.core.dist_checkpointing.load_plain_tensors` calls
`torch.distributed.get_rank()` and fails without one, so the torch_dist files are read here with
`torch.distributed.checkpoint` itself (`no_dist=True`), into full tensors allocated from the
global shapes in `.metadata`; DCP's planner assembles each from its shards. Keys are the
checkpoint's sharded-tensor keys (``embedding.word_embeddings.weight``,
``optimizer.state.exp_avg.<param key>``...), the same at every layout. Sharded objects (rng_state,
``_extra_state``) are per-rank pickles: listed, never compared. The common state (``common.pt``:
scheduler, position, optimizer param groups, content metadata) is compared value by value.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.manifest import read_manifest

_ABSENT = "<absent>"  # a common entry one side lacks


# ------------------------------------------------------------------------------------------- reading
def _check_directory(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    missing = [name for name in (".metadata", "metadata.json") if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"{path}: not a dist checkpoint (no {' or '.join(missing)})")
    try:
        backend = json.loads((path / "metadata.json").read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}/metadata.json: unreadable ({exc})") from exc
    if backend != "torch_dist":
        raise CheckpointError(f"{path}: sharded backend {backend!r}, only torch_dist is supported")
    return path


def _read_metadata(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(path))
    try:
        return reader, reader.read_metadata()
    except Exception as exc:  # a corrupt .metadata fails anywhere in unpickling
        raise CheckpointError(f"{path}/.metadata: unreadable ({type(exc).__name__}: {exc})") from exc


def _split_entries(metadata) -> tuple[dict[str, Any], list[str]]:
    """(tensor key -> TensorStorageMetadata, sorted sharded-object names without their shard suffix)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors, objects = {}, set()
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            tensors[key] = meta
        else:  # BytesStorageMetadata: one entry per shard, "rng_state/shard_0.1.0_1.2.1"
            objects.add(key.split("/shard_")[0])
    return tensors, sorted(objects)


def _cause(exc: BaseException) -> str:
    """The first rank failure inside DCP's CheckpointException, as one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    return f"{type(exc).__name__}: {exc}".strip()


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns that it assumes one process (it is one) and DEBUG-logs every load step, which
    pytest would print with any failure: silence both for the load."""
    from torch.distributed.checkpoint import logger as dcp_logger

    log = getattr(dcp_logger, "_dcp_logger", None)
    was_disabled = log.disabled if log else False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if log:
            log.disabled = True
        try:
            yield
        finally:
            if log:
                log.disabled = was_disabled


def _load(path: Path, tensors: dict[str, Any], reader) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    for key, meta in tensors.items():
        # A missing shard would leave part of a full tensor as allocated: refuse it instead.
        covered = sum(chunk.sizes.numel() for chunk in meta.chunks)
        if covered != meta.size.numel():
            raise CheckpointError(f"{path}: {key} has {covered} of {meta.size.numel()} elements in its shards")
    state = {key: torch.zeros(meta.size, dtype=meta.properties.dtype) for key, meta in tensors.items()}
    try:
        with _quiet_dcp():
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"{path}: shard data unreadable ({_cause(exc)})") from exc
    return state


def load_full_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every sharded tensor of the checkpoint at `path`, unsharded, on CPU (no process group needed)."""
    path = _check_directory(path)
    reader, metadata = _read_metadata(path)
    return _load(path, _split_entries(metadata)[0], reader)


def load_common(path: str | Path) -> dict[str, Any]:
    """The checkpoint's common state, loaded the way Megatron loads it (weights_only): `common.pt`
    (megatron-core 0.16's format), or the `common_state` object inside the torch_dist files, where
    megatron-core 0.19 writes it (no common.pt; megatron-core's own reader takes both)."""
    return _load_common(_check_directory(path))


def _load_common(path: Path) -> dict[str, Any]:
    legacy = path / "common.pt"
    try:
        if legacy.is_file():
            return torch.load(legacy, map_location="cpu", weights_only=True)
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        return load_common_state_dict(str(path))
    except Exception as exc:
        where = legacy if legacy.is_file() else f"{path} (its common state)"
        raise CheckpointError(f"{where}: unreadable ({type(exc).__name__}: {exc})") from exc


# ----------------------------------------------------------------------------------------- comparing
def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists -> {"scheduler.num_steps": 1, "optimizer.optimizer.param_groups.0.lr": ...}."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in items:
        flat.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # e.g. numpy arrays: == is elementwise
        return False


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64; positions NaN on both sides count as equal."""
    a, b = a.double(), b.double()
    delta = (a - b).abs()
    delta[a.isnan() & b.isnan()] = 0.0
    delta[(a == b)] = 0.0  # equal infinities give inf - inf = nan
    return float(delta.max()) if delta.numel() else 0.0


def compare_tensor(a: torch.Tensor, b: torch.Tensor, *, rtol: float = 0.0, atol: float = 0.0) -> dict | None:
    """None when `a` and `b` agree (same shape and dtype, |a-b| <= atol + rtol*|b|), else what differs."""
    info = {"max_abs": None, "shape_a": list(a.shape), "shape_b": list(b.shape),
            "dtype_a": str(a.dtype).removeprefix("torch."), "dtype_b": str(b.dtype).removeprefix("torch.")}
    if a.shape != b.shape:
        return info  # nothing to subtract
    if a.dtype == b.dtype and torch.equal(a, b):
        return None  # the common case, without float64 copies
    info["max_abs"] = _max_abs(a, b)
    close = torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True).all()
    if a.dtype == b.dtype and bool(close):
        return None
    return info


def _selected(key: str, include: Iterable[str] | None, exclude: Iterable[str]) -> bool:
    if include is not None and not any(key.startswith(p) for p in include):
        return False
    return not any(key.startswith(p) for p in exclude)


@dataclass
class CheckpointDiff:
    """What differs between checkpoint A and checkpoint B (tensor keys are sharded-tensor keys)."""

    a: str = "A"
    b: str = "B"
    missing: list[str] = field(default_factory=list)  # tensors in A, not in B
    extra: list[str] = field(default_factory=list)  # tensors in B, not in A
    mismatched: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> compare_tensor's info
    equal: int = 0  # tensors that agree
    common: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # common entry -> (A's, B's)
    objects_a: list[str] = field(default_factory=list)  # sharded objects: listed, not compared
    objects_b: list[str] = field(default_factory=list)
    vocab_trimmed: list[str] = field(default_factory=list)  # compared on the true-vocab rows only
    rtol: float = 0.0
    atol: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.mismatched or self.common)

    def largest(self, n: int | None = None) -> list[tuple[str, dict[str, Any]]]:
        """Mismatched tensors, largest |Δ| first (shape mismatches, which have none, lead)."""
        def order(item):
            value = item[1]["max_abs"]
            return -math.inf if value is None or math.isnan(value) else -value

        return sorted(self.mismatched.items(), key=order)[:n]

    def summary(self) -> str:
        return (f"{self.equal} equal, {len(self.mismatched)} mismatched, {len(self.missing)} missing, "
                f"{len(self.extra)} extra tensors; {len(self.common)} common entries differ")

    def to_rows(self) -> list[dict[str, Any]]:
        """Report rows (`report.add(**row)`): one "max_abs_diff" per mismatched tensor, then a summary
        "tensors_mismatched" row counting every difference (missing, extra and common included)."""
        tolerance = self.atol
        rows = [{"metric": "max_abs_diff", "value": math.inf if info["max_abs"] is None else info["max_abs"],
                 "tolerance": tolerance, "passed": False, "claim": "observed", "key": key, "shape_a": info["shape_a"],
                 "shape_b": info["shape_b"]} for key, info in self.largest()]
        differences = len(self.mismatched) + len(self.missing) + len(self.extra) + len(self.common)
        rows.append({"metric": "tensors_mismatched", "value": float(differences), "tolerance": 0.0,
                     "passed": self.ok, "claim": "exact", "n_equal": self.equal, "n_mismatched": len(self.mismatched),
                     "n_missing": len(self.missing), "n_extra": len(self.extra), "n_common": len(self.common)})
        return rows

    def as_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "ok": self.ok, "equal": self.equal, "missing": self.missing,
                "extra": self.extra, "mismatched": dict(self.largest()),
                "common": {k: [_jsonable(v) for v in pair] for k, pair in self.common.items()},
                "objects_a": self.objects_a, "objects_b": self.objects_b,
                "vocab_trimmed": self.vocab_trimmed, "rtol": self.rtol, "atol": self.atol}


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)


def _vocab_rows(a: torch.Tensor, b: torch.Tensor, vocab_size: int | None):
    """Megatron pads the vocab dimension to a multiple of 128 * TP, so embedding / output-layer
    tensors (and their optimizer state) of two layouts can differ in rows past the true vocab. Those
    rows are no model state: compare the first `vocab_size` rows only. None: not such a pair."""
    if (vocab_size is None or a.dim() == 0 or a.shape[1:] != b.shape[1:] or a.shape[0] == b.shape[0]
            or min(a.shape[0], b.shape[0]) < vocab_size):
        return None
    return a[:vocab_size], b[:vocab_size]


def diff_state(tensors_a: dict[str, torch.Tensor], tensors_b: dict[str, torch.Tensor],
               common_a: dict[str, Any] | None = None, common_b: dict[str, Any] | None = None, *,
               rtol: float = 0.0, atol: float = 0.0, include: Iterable[str] | None = None,
               exclude: Iterable[str] = (), vocab_size: int | None = None) -> CheckpointDiff:
    """The comparison itself, on loaded tensors and common dicts (see `diff_checkpoints`)."""
    include = None if include is None else tuple(include)
    exclude = tuple(exclude)
    keys_a = {k for k in tensors_a if _selected(k, include, exclude)}
    keys_b = {k for k in tensors_b if _selected(k, include, exclude)}
    result = CheckpointDiff(missing=sorted(keys_a - keys_b), extra=sorted(keys_b - keys_a), rtol=rtol, atol=atol)
    for key in sorted(keys_a & keys_b):
        pair = _vocab_rows(tensors_a[key], tensors_b[key], vocab_size)
        if pair is not None:
            result.vocab_trimmed.append(key)
        a, b = pair if pair is not None else (tensors_a[key], tensors_b[key])
        info = compare_tensor(a, b, rtol=rtol, atol=atol)
        if info is None:
            result.equal += 1
        else:
            result.mismatched[key] = info
    flat_a, flat_b = _flatten(common_a or {}), _flatten(common_b or {})
    for key in sorted(set(flat_a) | set(flat_b)):
        value_a, value_b = flat_a.get(key, _ABSENT), flat_b.get(key, _ABSENT)
        if _selected(key, include, exclude) and not _same_value(value_a, value_b):
            result.common[key] = (value_a, value_b)
    return result


def _manifest_vocab(a: str | Path, b: str | Path) -> int | None:
    """The true vocab size both manifests agree on (None without manifests or when they differ)."""
    try:
        sizes = {read_manifest(path).model_config.get("vocab_size") for path in (a, b)}
    except CheckpointError:  # a plain dist checkpoint, without our manifest
        return None
    return sizes.pop() if len(sizes) == 1 else None


def diff_checkpoints(a: str | Path, b: str | Path, *, rtol: float = 0.0, atol: float = 0.0,
                     include: Iterable[str] | None = None, exclude: Iterable[str] = (),
                     vocab_size: int | None | str = "auto") -> CheckpointDiff:
    """Diff checkpoints `a` and `b` as full tensors plus common state; exact unless rtol/atol are set.

    `include` / `exclude` are key prefixes (e.g. ``exclude=["optimizer."]`` compares the model only);
    they apply to tensor keys and to flattened common keys alike. `vocab_size` ("auto": from the
    manifests) limits vocab-padded tensors of different TP sizes to the true vocab rows. Raises
    CheckpointError on a path that is not a readable torch_dist checkpoint.
    """
    if vocab_size == "auto":
        vocab_size = _manifest_vocab(a, b)
    loaded = []
    for path in (a, b):
        directory = _check_directory(path)
        reader, metadata = _read_metadata(directory)
        tensor_meta, objects = _split_entries(metadata)
        loaded.append((_load(directory, tensor_meta, reader), _load_common(directory), objects))
    (tensors_a, common_a, objects_a), (tensors_b, common_b, objects_b) = loaded
    result = diff_state(tensors_a, tensors_b, common_a, common_b, rtol=rtol, atol=atol,
                        include=include, exclude=exclude, vocab_size=vocab_size)
    result.a, result.b, result.objects_a, result.objects_b = str(a), str(b), objects_a, objects_b
    return result


# -------------------------------------------------------------------------------------- mrh ckpt diff
def add_arguments(parser) -> None:
    parser.add_argument("a", help="checkpoint directory A")
    parser.add_argument("b", help="checkpoint directory B")
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: exact)")
    parser.add_argument("--include", action="append", default=None, metavar="PREFIX",
                        help="compare only keys with this prefix (repeatable)")
    parser.add_argument("--exclude", action="append", default=[], metavar="PREFIX",
                        help="skip keys with this prefix (repeatable), e.g. optimizer.")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help="compare vocab-padded tensors on their first N rows (default: the "
                             "manifests' vocab size, when both agree)")
    parser.add_argument("--show", type=int, default=20, metavar="N", help="list at most N keys per section (default 20)")
    parser.add_argument("--json", action="store_true", help="print the diff as JSON instead of a table")


def main(args) -> int:
    """Exit 0 when A and B are equal, 1 when they differ, 2 when either is not a readable checkpoint."""
    try:
        result = diff_checkpoints(args.a, args.b, rtol=args.rtol, atol=args.atol, include=args.include,
                                  exclude=args.exclude, vocab_size=args.vocab_size or "auto")
    except CheckpointError as exc:
        print(f"mrh ckpt diff: {' '.join(str(exc).split())}", file=sys.stderr)  # one line
        return 2
    print(json.dumps(result.as_dict(), indent=1) if args.json else _table(result, args.show))
    return 0 if result.ok else 1


def _listing(title: str, keys: list[str], show: int) -> list[str]:
    if not keys:
        return []
    lines = [f"{title} ({len(keys)}):"] + [f"  {key}" for key in keys[:show]]
    return lines + ([f"  ... {len(keys) - show} more"] if len(keys) > show else [])


def _table(result: CheckpointDiff, show: int) -> str:
    lines = [f"A: {result.a}", f"B: {result.b}", result.summary()]
    lines += _listing("missing from B", result.missing, show)
    lines += _listing("extra in B", result.extra, show)
    if result.mismatched:
        width = max(len(key) for key, _ in result.largest(show))
        lines.append(f"mismatched ({len(result.mismatched)}), largest |Δ| first:")
        lines.append(f"  {'key':<{width}} {'max |Δ|':>11}  shape A -> shape B")
        for key, info in result.largest(show):
            value = "-" if info["max_abs"] is None else f"{info['max_abs']:.4g}"
            dtypes = "" if info["dtype_a"] == info["dtype_b"] else f"  {info['dtype_a']} -> {info['dtype_b']}"
            lines.append(f"  {key:<{width}} {value:>11}  {info['shape_a']} -> {info['shape_b']}{dtypes}")
        if len(result.mismatched) > show:
            lines.append(f"  ... {len(result.mismatched) - show} more")
    lines += _listing("common state differs", [f"{k}: {a!r} -> {b!r}" for k, (a, b) in result.common.items()], show)
    objects = sorted(set(result.objects_a) | set(result.objects_b))
    if objects:
        lines.append(f"not compared (sharded objects): {', '.join(objects[:show])}" + (" ..." if len(objects) > show else ""))
    lines.append("EQUAL" if result.ok else "DIFFERENT")
    return "\n".join(lines)
