"""Exceptions the persistent world raises in the parent process."""
from __future__ import annotations


class WorldError(RuntimeError):
    """The world could not do what was asked (start failed, a rank died or hung)."""


class WorldStartError(WorldError):
    """Rank processes did not all come up (import error, rendezvous failure, start timeout)."""


class RankDied(WorldError):
    """A rank process exited while a call was in flight."""

    def __init__(self, message: str, rank: int, exitcode: int | None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class WorldTimeout(WorldError, TimeoutError):
    """A call did not finish on every rank within its timeout; the message holds every stack."""

    def __init__(self, message: str, hung_ranks: list[int]):
        super().__init__(message)
        self.hung_ranks = hung_ranks


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the `__cause__` of a re-raised exception
    (the pattern of concurrent.futures.process)."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class RankError(WorldError):
    """A rank raised an exception that could not be sent back as itself (not picklable)."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank
