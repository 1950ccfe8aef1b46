"""Save and load a resident policy's whole state (parent side; synchronous).

    manifest = save_checkpoint(policy, "ckpts/step-2")     # complete or absent, never partial
    info = load_checkpoint(other_policy, "ckpts/step-2")  # any layout of the same model

Saving writes into a hidden sibling directory and renames it into place after every rank has
written and the manifest (files, sizes, sha256) is down, so a crash leaves no directory under the
target name. Loading validates the manifest, every file, the model, the layout and whether this
megatron-core reads the checkpoint's format in this process first; only then do the ranks replace
their state. A refused load changes nothing. The rank side
is the policy worker's: `PolicyWorker.save_checkpoint` / `load_checkpoint` (harness.training.policy).
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.manifest import Manifest, file_table, model_fingerprint, read_manifest, \
    verify_files, write_manifest
from harness.checkpoint.sharded import OPTIMIZER_FORMATS
from harness.checkpoint.shared_fs import require_shared
from harness.parallel.layout import parse_layout
from harness.variants import VariantError, require

# The checkpoint variants of the catalog (harness.variants) the load implements:
# shared-adam-step: the ranks skip our un-sharing of the Adam step (harness.compat.megatron_core);
# rng-not-restored: the RNG streams are never restored (load_rng forced off);
# dp-reshardable: the refusal of a dp_reshardable optimizer at another TP/PP is skipped, so the
#   ranks attempt it and show what megatron-core does.
IMPLEMENTED = ("shared-adam-step", "rng-not-restored", "dp-reshardable")


def _megatron_version() -> str:
    from harness.bridge.versions import mcore_version  # the release, as the version gates read it

    return mcore_version()


def policy_manifest(policy, partial: Path, position: dict[str, Any], optimizer_format: str, started: float,
                    **fields: Any) -> Manifest:
    """The manifest of a checkpoint of `policy` written into `partial` (its files as they are now);
    `fields` are the optional Manifest fields (iteration, async_save, blocking_s)."""
    from harness.models import load_hf_config

    manifest = Manifest(
        model=str(policy.path), model_config=model_fingerprint(load_hf_config(policy.path)),
        layout=policy.layout.name, world_size=policy.world.size, dtype=policy.config.get("dtype", "fp32"),
        spec=policy.world.spec,
        optimizer_format=optimizer_format, steps_done=position["steps_done"],
        consumed_samples=position["consumed_samples"], megatron_core=_megatron_version(),
        files=file_table(partial), **fields)
    manifest.save_s = round(time.perf_counter() - started, 4)
    return manifest


def save_checkpoint(policy, directory: str | os.PathLike, *, optimizer_format: str = "fully_reshardable",
                    fully_parallel_save: bool = True) -> Manifest:
    """Write `policy`'s model, optimizer, scheduler, RNG and data position to `directory`, which
    must not exist. `optimizer_format="dp_reshardable"` is the shipped buggy variant (reshards
    across DP only)."""
    from harness.checkpoint.durable import fsync_path, fsync_tree

    directory = Path(directory)
    if optimizer_format not in OPTIMIZER_FORMATS:
        raise CheckpointError(f"unknown optimizer format {optimizer_format!r}; choose from {OPTIMIZER_FORMATS}")
    if directory.exists():
        raise CheckpointError(f"{directory} exists; refusing to overwrite it (nothing was written)")
    directory.parent.mkdir(parents=True, exist_ok=True)
    require_shared(policy.world, directory.parent, "the checkpoint")
    partial = directory.parent / f".{directory.name}.partial-{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        started = time.perf_counter()
        position = policy.call("save_checkpoint", str(partial), optimizer_format=optimizer_format,
                               fully_parallel=fully_parallel_save)[0]
        manifest = policy_manifest(policy, partial, position, optimizer_format, started)
        write_manifest(partial, manifest)
        fsync_tree(partial)
        os.rename(partial, directory)  # atomic: the checkpoint appears whole
        fsync_path(directory.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return manifest


# megatron-core lines that read a checkpoint's common state (scheduler, data position, optimizer
# param groups) only from `common.pt`. megatron-core 0.19 writes no common.pt: it keeps that state as
# a `common_state` object inside the torch_dist files (NVIDIA/Megatron-LM#5160) and reads either
# form. Measured (harness.checkpoint.cross_stack): a 0.16.1 checkpoint resumes on 0.19.2 exactly; a
# 0.19.2 one on 0.16.1 fails on every rank inside dist_checkpointing.load (FileNotFoundError for
# common.pt, after the load template was built from the live state).
COMMON_PT_ONLY = ("0.16",)


def _line(version: str) -> str:
    return ".".join(version.split(".")[:2])


def check_format_readable(directory: str | os.PathLike, manifest: Manifest) -> None:
    """Refuse a checkpoint whose format the megatron-core here cannot read (COMMON_PT_ONLY)."""
    here = _megatron_version()
    if "common.pt" in manifest.files or _line(here) not in COMMON_PT_ONLY:
        return
    raise CheckpointError(
        f"{directory}: written by megatron-core {manifest.megatron_core}, which keeps the checkpoint's "
        "common state (scheduler, data position, optimizer param groups) inside its torch_dist files and "
        f"writes no common.pt; megatron-core {here} here reads the common state only from common.pt, so "
        f"every rank would fail half-way into the load. Resume it with megatron-core "
        f"{_line(manifest.megatron_core)}.x (nothing was loaded)")


def _same_model_parallelism(a, b) -> bool:
    return (a.tp, a.pp, a.vpp, a.cp, a.ep, a.expert_tp) == (b.tp, b.pp, b.vpp, b.cp, b.ep, b.expert_tp)


def check_loadable(policy, directory: str | os.PathLike, *, load_rng: bool | None = None,
                   verify_checksums: bool = True, variant: str | None = None) -> tuple[Manifest, bool]:
    """Everything `load_checkpoint` checks before touching state: (manifest, restore RNG?).
    variant="dp-reshardable" skips the dp_reshardable layout check (the buggy variant)."""
    from harness.models import load_hf_config

    try:
        require(variant, check="checkpoint")
    except VariantError as exc:
        raise CheckpointError(str(exc)) from None
    manifest = read_manifest(directory)
    verify_files(directory, manifest, checksums=verify_checksums)
    check_format_readable(directory, manifest)
    require_shared(policy.world, directory, "loading it")
    want = model_fingerprint(load_hf_config(policy.path))
    if manifest.model_config != want:
        differing = {k: (manifest.model_config.get(k), v) for k, v in want.items()
                     if manifest.model_config.get(k) != v}
        raise CheckpointError(f"{directory}: a checkpoint of another model ({manifest.model}); "
                              f"(checkpoint, policy) differ in {differing}")
    if manifest.spec != policy.world.spec:
        # The two specs' state dicts name and lay out the norms differently (TE fuses each layer
        # norm into the linear layer after it): a load would miss keys half-way through the ranks.
        raise CheckpointError(
            f"{directory}: saved from a {manifest.spec}-spec policy, loading into a {policy.world.spec}-spec one: "
            "the two specs keep the layer norms under other names (Transformer Engine fuses them into "
            "the linear layers), so a dist checkpoint does not cross them. Export HF weights "
            "(policy.hf_state_dict()) to move a model between specs")
    dtype = policy.config.get("dtype", "fp32")
    if manifest.dtype != dtype:
        raise CheckpointError(f"{directory}: saved from a {manifest.dtype} policy, loading into {dtype}")
    saved = parse_layout(manifest.layout)
    same_layout = saved == policy.layout and manifest.world_size == policy.world.size
    if (manifest.optimizer_format == "dp_reshardable" and variant != "dp-reshardable"
            and not _same_model_parallelism(saved, policy.layout)):
        raise CheckpointError(
            f"{directory}: its optimizer state is in the dp_reshardable format (flat buffers of the "
            f"{manifest.layout} layout), which reshards across data parallelism only; it cannot be "
            f"loaded at {policy.layout}. Save with optimizer_format='fully_reshardable'.")
    if load_rng and not same_layout:
        raise CheckpointError(
            f"{directory}: RNG states are per rank of layout {manifest.layout} on {manifest.world_size} "
            f"ranks; they cannot be restored at {policy.layout} on {policy.world.size} (load_rng=False "
            "keeps the current RNG)")
    return manifest, same_layout if load_rng is None else bool(load_rng)


def load_checkpoint(policy, directory: str | os.PathLike, *, load_rng: bool | None = None,
                    fully_parallel_load: bool = True, verify_checksums: bool = True,
                    variant: str | None = None) -> dict[str, Any]:
    """Replace `policy`'s whole state by the checkpoint's. load_rng: True restores the RNG states
    (same layout only), False keeps the current ones, None restores them when the layout matches.
    `variant` is a checkpoint variant of the catalog (`IMPLEMENTED`). Returns the data position,
    whether the RNG was restored and the load time."""
    manifest, restore_rng = check_loadable(policy, directory, load_rng=load_rng,
                                           verify_checksums=verify_checksums, variant=variant)
    restore_rng = restore_rng and variant != "rng-not-restored"
    started = time.perf_counter()
    position = policy.call("load_checkpoint", str(directory), optimizer_format=manifest.optimizer_format,
                           fully_parallel=fully_parallel_load, load_rng=restore_rng,
                           unshare_adam_steps=variant != "shared-adam-step")[0]
    return {**position, "rng_restored": restore_rng, "load_s": round(time.perf_counter() - started, 4),
            "manifest": manifest}
