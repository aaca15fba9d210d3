"""The store's exceptions, importable without MPI (the CLI reads checkpoints in one process)."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint cannot be written or does not match the application."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file failed a structural or checksum check."""
