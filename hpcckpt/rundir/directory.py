"""The checkpoint directory as a place to write: what is wrong with it, and the fix.

The wrapper (``--ckpt-dir``) and the Checkpointer (its directory, or ``HPCCKPT_DIR``)
say the same thing when they cannot use it: that the path exists and is not a
directory, or that the directory exists but this user cannot write it, with its mode,
owner and group, and what to do, instead of the errno of whichever file the first write
happened to try (``File exists``, ``Permission denied: '.../.hpcckpt.lock.1f2e...'``).
Stdlib only.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
import tempfile
from pathlib import Path

#: The errnos that mean "this user may not create files here".
REFUSED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def probe(directory: Path) -> None:
    """Create and delete one private file in ``directory``: OSError when it cannot be
    written (the truth on every file system, where ``os.access`` may guess)."""
    fd, name = tempfile.mkstemp(prefix=".hpcckpt-probe.", dir=directory)
    os.close(fd)
    os.unlink(name)


def _name(number: int, kind: str) -> str:
    try:
        name = (pwd.getpwuid(number) if kind == "uid" else grp.getgrgid(number))[0]
    except KeyError:
        return f"{kind} {number}"
    return f"{name} ({kind} {number})"


def _kind(st: os.stat_result) -> str:
    """What a path that is not a directory is (links followed)."""
    mode = st.st_mode
    for test, what in (
        (stat.S_ISREG, "file"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISFIFO, "named pipe"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return what
    return "file"


def _not_a_directory(path: Path, option: str) -> str | None:
    """The message for a path that exists and is not a directory, or None."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        try:
            target = os.readlink(path)
        except OSError:
            return None
        return (
            f"the checkpoint directory {path} is a symbolic link to {target}, which does not "
            f"exist: create {target}, or choose another {option}"
        )
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return None
    kind = _kind(st)
    article = "a regular" if kind == "file" else "a"
    return (
        f"the checkpoint directory {path} exists and is not a directory (it is {article} "
        f"{kind}): choose another {option}, or move the {kind} away"
    )


def _cannot_write(
    directory: Path, error: OSError, option: str, what: str = "the checkpoint directory"
) -> str:
    """The message for an existing directory that refused a new file with ``error``."""
    try:
        st = os.stat(directory)
        perms = (
            f" (mode {stat.S_IMODE(st.st_mode):04o}, owner {_name(st.st_uid, 'uid')}, "
            f"group {_name(st.st_gid, 'gid')})"
        )
    except OSError:
        perms = ""
    user = _name(os.geteuid(), "uid")
    head = f"{what} {directory} exists but cannot be written by user {user}"
    if error.errno == errno.EROFS:
        return (
            f"{head}: it is on a read-only file system. Choose a {option} on a writable file system"
        )
    cause = os.strerror(error.errno) if error.errno else str(error)
    if error.errno == errno.EPERM:
        return (
            f"{head}: {cause}{perms}: it may be immutable (lsattr -d {directory} shows an i; "
            f"chattr -i {directory} undoes it) or on a file system that refuses writes. "
            f"Choose a writable {option}, or have it fixed"
        )
    return (
        f"{head}: {cause}{perms}. Choose a writable {option}, or fix its permissions (as its "
        f"owner: chmod u+rwx {directory})"
    )


def _existing_ancestor(path: Path) -> Path | None:
    for parent in path.parents:
        if os.path.lexists(parent):
            return parent
    return None


def explain(path: Path, error: OSError, *, option: str = "--ckpt-dir") -> str:
    """What is wrong with the checkpoint directory ``path``, now that creating or writing
    it failed with ``error``, and the fix; ``option`` is how the user chose it."""
    path = Path(path)
    wrong = _not_a_directory(path, option)
    if wrong is not None:
        return wrong
    if os.path.isdir(path):
        try:
            probe(path)
        except OSError as refused:
            if refused.errno in REFUSED:
                return _cannot_write(path, refused, option)
        return f"cannot use the checkpoint directory {path}: {error}"
    # Missing: creating it (or a parent) failed. Say what is wrong with the nearest
    # ancestor that exists.
    above = _existing_ancestor(path)
    if above is not None and error.errno in REFUSED | {errno.EEXIST, errno.ENOTDIR}:
        if not os.path.isdir(above):
            return (
                f"cannot create the checkpoint directory {path}: {above} exists and is not a "
                f"directory; choose another {option}"
            )
        try:
            probe(above)
        except OSError as refused:
            if refused.errno in REFUSED:
                which = "its parent" if above == path.parent else "the directory above it"
                what = f"cannot create the checkpoint directory {path}: {which}"
                return _cannot_write(above, refused, option, what)
    return f"cannot create the checkpoint directory {path}: {error.strerror or error}"
