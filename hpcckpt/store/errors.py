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


class CallMismatch(RuntimeError):
    """The ranks are not making the same collective call of the Checkpointer (or not at
    the same step): the message names the ranks and the call each is in. Raised on
    every rank (one that was in ``due()`` at its next call); the Checkpointer is
    unusable afterwards."""


class CallTimeout(CallMismatch):
    """Some ranks never entered the collective call the others waited in for
    ``call_timeout`` seconds: the message names them and where they last were."""
