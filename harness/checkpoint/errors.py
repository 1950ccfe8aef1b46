"""The one error a caller of the checkpoint manager needs to catch."""


class CheckpointError(Exception):
    """A checkpoint cannot be written or read as asked: raised before any state changes."""
