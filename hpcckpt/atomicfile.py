"""A file published whole or not at all: the one "temporary name, then rename" of hpcckpt.

Stdlib only, a leaf every layer may import (the store, the Checkpointer, the run
directory, the wrapper, the local cluster): a file is written under a temporary name in
its own directory, fsynced, renamed over its final name (``os.replace``, atomic within
a file system) and the directory fsynced, so a reader finds the old file or the new
one, whole, even after a crash of the node. On any error the temporary name is removed
and the old file stays as it was.

- :func:`atomic_write`: bytes or text in memory;
- :func:`atomic_file`: a binary file object to stream into (no extra pass over the data);
- :func:`atomic_path`: the temporary *name*, for writers that open files themselves
  (h5py, boto3, ``shutil.copy2``);
- :func:`rename`: an existing file given a new name (durably unless asked not to).

``durable=False`` skips both fsyncs, never the rename: only for files whose loss in a
crash of the node costs nothing (each caller says why). ``mode``: the file's exact mode
whatever the umask, or None for what ``open()`` gives (0o666 less the umask).
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or directory by path."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, durable: bool) -> None:
    """Give the file ``src`` the name ``dst`` atomically (replacing a file there); with
    ``durable``, fsync ``dst``'s directory so the new name survives a power loss."""
    os.replace(src, dst)
    if durable:
        fsync_path(Path(dst).parent)


def _temp_name(path: Path) -> str:
    return f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"


@contextmanager
def _renamed_over(path: Path, temp: str | None, durable: bool) -> Iterator[Path]:
    """The temporary name beside ``path``: renamed over ``path`` when the block ends,
    removed when it raises."""
    tmp = path.with_name(temp or _temp_name(path))
    try:
        yield tmp
        rename(tmp, path, durable=durable)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def _exact_mode(fd: int, mode: int) -> None:
    """Give a file just created with ``mode`` exactly that mode, whatever the umask took
    (a chmod only when needed: it is an inode update the journal waits for)."""
    if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
        os.fchmod(fd, mode)


@contextmanager
def atomic_file(
    path: str | os.PathLike[str],
    *,
    mode: int | None,
    durable: bool = True,
    temp: str | None = None,
) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new contents into; published when the block ends.

    The file is created fresh under ``temp`` (a name in ``path``'s directory; a hidden
    unique one by default) without following a link, with exactly ``mode``.
    """
    with _renamed_over(Path(path), temp, durable) as tmp:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        create = 0o666 if mode is None else mode
        try:
            fd = os.open(tmp, flags, create)
        except FileExistsError:  # a leftover of a crash, or a planted link: never followed
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, flags, create)
        with os.fdopen(fd, "wb") as out:
            if mode is not None:
                _exact_mode(fd, mode)
            yield out
            out.flush()
            if durable:
                os.fsync(fd)


@contextmanager
def atomic_path(
    path: str | os.PathLike[str],
    *,
    mode: int | None,
    durable: bool = True,
    temp: str | None = None,
) -> Iterator[Path]:
    """The temporary name for a writer that creates the file itself; when the block
    ends the file there gets ``mode`` (None: as its writer made it), is fsynced and
    published as ``path``. A file the block did not create is an error (FileNotFoundError)."""
    with _renamed_over(Path(path), temp, durable) as tmp:
        tmp.unlink(missing_ok=True)  # a leftover, or a link its writer would follow
        yield tmp
        if mode is not None or durable:
            fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if mode is not None:
                    _exact_mode(fd, mode)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | str,
    *,
    mode: int | None,
    durable: bool = True,
    temp: str | None = None,
) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8), whole or not at all."""
    with atomic_file(path, mode=mode, durable=durable, temp=temp) as out:
        out.write(data.encode() if isinstance(data, str) else data)
