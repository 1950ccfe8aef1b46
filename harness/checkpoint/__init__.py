"""Checkpoint manager: save/load a resident policy's whole state with megatron.core.dist_checkpointing.

Parent side: `save_checkpoint`, `load_checkpoint`, `check_loadable` (harness.checkpoint.manager);
rank side: the policy worker's methods (`PolicyWorker.sharded_state_dict`, `save_checkpoint`,
`load_checkpoint`) with harness.checkpoint.sharded; the manifest: harness.checkpoint.manifest. A run's checkpoints in one root (numbered checkpoints,
tracker, rotation, async saves, resume): harness.checkpoint.checkpointer.Checkpointer
(`policy.checkpointer(root, ...)`); crash injection: harness.checkpoint.faults and .crash.
"""
from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.knobs import CheckpointKnobs
from harness.checkpoint.manager import IMPLEMENTED, OPTIMIZER_FORMATS, check_loadable, load_checkpoint, \
    save_checkpoint
from harness.checkpoint.manifest import Manifest, read_manifest

__all__ = ["CheckpointError", "CheckpointKnobs", "IMPLEMENTED", "Manifest", "OPTIMIZER_FORMATS", "check_loadable", "load_checkpoint",
           "read_manifest", "save_checkpoint"]
