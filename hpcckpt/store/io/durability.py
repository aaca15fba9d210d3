"""Making bytes and names durable: fsync of files and of the directory that names them,
the atomic write (:mod:`hpcckpt.atomicfile`, shared with the layers outside the store)
and the commit's publish of a checkpoint file."""

from __future__ import annotations

from pathlib import Path

from hpcckpt.atomicfile import atomic_file, atomic_path, atomic_write, fsync_path, rename
from hpcckpt.store.io.faults import fault_point

__all__ = ["atomic_file", "atomic_path", "atomic_write", "fsync_path", "publish", "rename"]


def publish(partial: Path, final: Path) -> None:
    """Give a finished file its final name durably.

    Only for a file every writer has fsynced after its last change (data, metadata and
    mode): a checkpoint's ranks each fsync the shared file before they agree, so a
    further fsync here would only cost the device another flush.
    """
    fault_point("commit.fsynced")
    rename(partial, final, durable=True)
