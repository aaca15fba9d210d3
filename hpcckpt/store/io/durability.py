"""Making bytes and names durable: fsync of files and of the directory that names them."""

from __future__ import annotations

import os
from pathlib import Path

from hpcckpt.store.io.faults import fault_point


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or directory by path."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_rename(src: Path, dst: Path) -> None:
    """Atomically give ``src`` the name ``dst`` and make the new name survive a power loss."""
    os.replace(src, dst)
    fsync_path(dst.parent)


def publish(partial: Path, final: Path) -> None:
    """Give a finished file its final name durably.

    Only for a file every writer has fsynced after its last change (data, metadata and
    mode): a checkpoint's ranks each fsync the shared file before they agree, so a
    further fsync here would only cost the device another flush.
    """
    fault_point("commit.fsynced")
    durable_rename(partial, final)
