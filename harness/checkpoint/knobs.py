"""The checkpoint knobs, as data: what NeMo-RL hard-codes (PR 2390/2391) is a choice here.

    knobs = CheckpointKnobs(async_save=True, keep=2)
    for save_knobs in CheckpointKnobs.save_combinations(): ...   # every combination of the save knobs

Save knobs change how a checkpoint is written, never what it holds: suites/checkpoint/test_knobs.py
proves every combination writes the same tensors (plain-tensor diff) and resumes to the same next
step. Load knobs change how it is read (and whether the RNG streams come back).
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.sharded import OPTIMIZER_FORMATS


@dataclass(frozen=True)
class CheckpointKnobs:
    async_save: bool = False  # write in forked writers while training continues
    fully_parallel_save: bool = True  # spread replicated shards' writes over the DP ranks
    fully_parallel_load: bool = True  # spread the reads over the DP ranks, then exchange
    load_rng: bool | None = None  # restore the RNG streams: None = when the layout matches
    keep: int = 2  # complete checkpoints kept (the newest ones), >= 1
    optimizer_format: str = "fully_reshardable"

    SAVE = ("async_save", "fully_parallel_save")
    LOAD = ("fully_parallel_load", "load_rng")

    def __post_init__(self) -> None:
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise CheckpointError(f"keep must be an integer >= 1 (the newest checkpoints kept), got {self.keep!r}")
        if self.optimizer_format not in OPTIMIZER_FORMATS:
            raise CheckpointError(f"unknown optimizer format {self.optimizer_format!r}; "
                                  f"choose from {OPTIMIZER_FORMATS}")
        for name in ("async_save", "fully_parallel_save", "fully_parallel_load"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.load_rng not in (None, True, False):
            raise CheckpointError(f"load_rng must be True, False or None, got {self.load_rng!r}")

    def replace(self, **changes) -> "CheckpointKnobs":
        return dataclasses.replace(self, **changes)

    @classmethod
    def save_combinations(cls, base: "CheckpointKnobs | None" = None) -> list["CheckpointKnobs"]:
        base = base or cls()
        return [base.replace(**dict(zip(cls.SAVE, values)))
                for values in itertools.product((False, True), repeat=len(cls.SAVE))]

    def describe(self) -> str:
        return (f"{'async' if self.async_save else 'sync'} keep={self.keep}"
                f"{'' if self.fully_parallel_save else ' serial-save'}"
                f"{'' if self.fully_parallel_load else ' serial-load'}")
