"""The store's files on the file system: modes, links, leftovers and full disks.

- :func:`check_regular_file`: a checkpoint is read only when it is a regular file in
  its own right: a symbolic link (which may point anywhere) or a FIFO/device (which
  would hang or flood the reader) named ``ckpt-*.h5`` is a corrupt checkpoint.
- :func:`remove_leftover`: deletes one ``*.partial`` leftover *name*: a link is
  unlinked, never followed, and a directory is left alone.
- :func:`create_private` / :func:`write_private`: files are created with
  ``O_EXCL | O_NOFOLLOW`` and their final mode set by ``fchmod`` (the umask does not
  widen or narrow them), so a planted link cannot redirect a write outside the
  directory.
- :func:`check_free_space` / :func:`explain_write_error`: a save that cannot fit is
  refused before HDF5 writes, and a failed write into a full file system (MPI-IO
  reports only "file write failed") becomes a message naming ENOSPC and the directory.

A file's contents are checked elsewhere: HDF5's global heaps by :mod:`.file.heap_check`,
state trees by :mod:`.tree.checks`.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import stat
from pathlib import Path

from hpcckpt.store.errors import CorruptCheckpoint

log = logging.getLogger("hpcckpt.store")

FILE_MODE, DIR_MODE = 0o600, 0o700
GROUP_FILE_MODE, GROUP_DIR_MODE = 0o640, 0o750


def modes(share_group: bool) -> tuple[int, int]:
    """(file mode, directory mode): owner-only, or readable by the group."""
    return (GROUP_FILE_MODE, GROUP_DIR_MODE) if share_group else (FILE_MODE, DIR_MODE)


# -- files ---------------------------------------------------------------------------------
def check_regular_file(path: Path) -> None:
    """Raise CorruptCheckpoint unless ``path`` itself (not a link's target) is a regular file."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise CorruptCheckpoint(f"{path.name}: unreadable ({exc})") from exc
    if stat.S_ISLNK(st.st_mode):
        raise CorruptCheckpoint(
            f"{path.name} is a symbolic link (to {os.readlink(path)!r}); hpcckpt writes regular "
            "files only and does not follow links in a checkpoint directory"
        )
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpoint(f"{path.name} is not a regular file (mode {oct(st.st_mode)})")


def remove_leftover(path: Path) -> None:
    """Delete a leftover name: a file or a link (the link only), never a directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        log.warning("%s is a directory, not a leftover of hpcckpt: leaving it alone", path)
        return
    path.unlink(missing_ok=True)


def create_private(path: Path, mode: int = FILE_MODE) -> None:
    """Create ``path`` empty with exactly ``mode``; fails if any file or link has that name."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        _exact_mode(fd, mode)
    finally:
        os.close(fd)


def _exact_mode(fd: int, mode: int) -> None:
    """Give a file just created with ``mode`` exactly that mode, whatever the umask took.

    Only when the umask took bits: a chmod is an inode update that waits for the
    file system's journal (measured up to 6 ms on a restore's path here).
    """
    if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
        os.fchmod(fd, mode)


def write_private(path: Path, text: str, mode: int = FILE_MODE, *, replace: bool = True) -> None:
    """Write ``text`` to a fresh file ``path``, never through a link.

    With ``replace`` an old file or link of that name is unlinked first; without it an
    existing name raises FileExistsError (how a lock file is taken).
    """
    if replace:
        path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        _exact_mode(fd, mode)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def set_mode(path: Path, mode: int) -> None:
    """chmod a file we wrote (never following a link)."""
    if not path.is_symlink():
        os.chmod(path, mode)


def make_directory(directory: Path, mode: int = DIR_MODE) -> None:
    """Create the checkpoint directory with ``mode`` (whatever the umask); an existing one
    keeps the mode its owner gave it."""
    if directory.is_dir():
        return
    directory.mkdir(mode=mode, parents=True, exist_ok=True)
    os.chmod(directory, mode)


# -- a full disk ---------------------------------------------------------------------------
def free_bytes(directory: Path) -> int | None:
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def _enospc(directory: Path, free: int, needed: int, cause: str = "") -> OSError:
    return OSError(
        errno.ENOSPC,
        f"no space left on the file system of {directory} (ENOSPC: {free} bytes free, this "
        f"checkpoint needs about {needed}); the previous checkpoints are intact. Free space "
        f"or point the checkpoint directory elsewhere{cause}",
    )


def check_free_space(directory: Path, needed: int) -> None:
    """Raise OSError before writing when ``directory`` cannot hold ``needed`` bytes
    (ENOSPC), or the process may not write a file that large (EFBIG: ``ulimit -f``).

    Checked before the file exists because HDF5 (1.10) does not survive a file it cannot
    write to the end: the failed close leaves the library in a state where the next HDF5
    call, or the garbage collector, crashes the process (measured: a save under a 3 KB
    ``ulimit -f`` raised, then the next ``gc.collect()`` segfaulted). ``needed`` is the
    state's bytes; a margin is added for the HDF5 metadata.
    """
    want = needed + needed // 100 + (1 << 20)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < want:
        raise OSError(
            errno.EFBIG,
            f"this process may not write files larger than {limit} bytes (the file size "
            f"limit, ulimit -f), and the checkpoint file in {directory} needs about {want}; "
            f"the previous checkpoints are intact. Raise the limit (ulimit -f unlimited in "
            f"the batch script, before srun or mpirun)",
        )
    free = free_bytes(directory)
    if free is not None and free < want:
        raise _enospc(directory, free, want)


def explain_write_error(
    error: BaseException | None, directory: Path, needed: int
) -> BaseException | None:
    """``error`` as is, or an OSError naming ENOSPC when the file system is (nearly) full.

    MPI-IO and HDF5 report a full disk as "Can't write data (file write failed)"
    without errno; the free space of ``directory`` tells. ``needed`` is the bytes the
    save is to write (all ranks).
    """
    if error is None:
        return None
    code = getattr(error, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return error
    free = free_bytes(directory)
    if free is None or free >= max(needed, 1 << 20):
        return error
    exc = _enospc(directory, free, needed, f" [{type(error).__name__}: {error}]")
    exc.__cause__ = error
    return exc


__all__ = [
    "check_regular_file",
    "create_private",
    "check_free_space",
    "explain_write_error",
    "make_directory",
    "modes",
    "remove_leftover",
    "set_mode",
    "write_private",
]
