"""The store's exceptions, importable without MPI (the CLI reads checkpoints in one process)."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint cannot be written or does not match the application."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file failed a structural or checksum check.

    ``culprit`` is the file actually at fault when it is not the checkpoint being
    read: a file of an incremental checkpoint's chain (its base or a delta).
    """

    def __init__(self, message: str, culprit: object = None) -> None:
        super().__init__(message)
        self.culprit = culprit
