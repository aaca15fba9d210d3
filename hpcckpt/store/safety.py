"""Defences of the store against hostile or foreign files, full disks and loose permissions.

- :func:`check_regular_file`: a checkpoint is read only when it is a regular file in
  its own right: a symbolic link (which may point anywhere) or a FIFO/device (which
  would hang or flood the reader) named ``ckpt-*.h5`` is a corrupt checkpoint.
- :func:`remove_leftover`: deletes one ``*.partial`` leftover *name*: a link is
  unlinked, never followed, and a directory is left alone.
- :func:`create_private` / :func:`write_private`: files are created with
  ``O_EXCL | O_NOFOLLOW`` and their final mode set by ``fchmod`` (the umask does not
  widen or narrow them), so a planted link cannot redirect a write outside the
  directory.
- :func:`check_tree`: a state tree read from a file is checked node by node before
  anything is built from it (no unknown tags, only real numpy bit generators, no
  dtypes with sub-arrays or objects), so a crafted tree can neither call arbitrary
  functions nor ask for a huge allocation.
- :func:`check_global_heaps`: the HDF5 library (1.10) can loop forever reading a
  variable-length string attribute whose global heap collection is damaged (one
  flipped bit in an object's size does it); the collections are parsed and checked
  here before any attribute is read, so a damaged one is a CorruptCheckpoint, not a
  hung restore.
- :func:`explain_write_error`: a failed write into a full file system (MPI-IO reports
  only "file write failed") becomes a message naming ENOSPC and the directory.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import logging
import os
import re
import resource
import stat
import struct
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcckpt.store.errors import CorruptCheckpoint

log = logging.getLogger("hpcckpt.store")

FILE_MODE, DIR_MODE = 0o600, 0o700
#: What h5py and the reader's checks raise on a damaged file (HDF5 errors come as
#: OSError, KeyError, ValueError or RuntimeError, depending on where they happen).
DAMAGE_ERRORS = (OSError, KeyError, ValueError, TypeError, IndexError, RecursionError, RuntimeError)
GROUP_FILE_MODE, GROUP_DIR_MODE = 0o640, 0o750

#: The bit generators a checkpoint may name (numpy's own; never any other attribute).
BIT_GENERATORS = frozenset({"MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64"})
_HEX = re.compile(r"^-?[0-9a-fA-F]+$")
_TORCH_DTYPE = re.compile(r"^[a-z][a-z0-9_]{1,31}$")
_NODE_TAGS = frozenset(
    {
        "dict",
        "tuple",
        "bytes",
        "int",
        "complex",
        "npscalar",
        "array",
        "generator",
        "randomstate",
        "tensor",
        "kdict",
        "stateful",
    }
)


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


# -- HDF5 global heaps --------------------------------------------------------------------
_GCOL = b"GCOL"
_MAX_SCAN = 256 << 20  # bytes of metadata scanned for heap collections, at most


def datasets(f: Any) -> dict[str, Any]:
    """Every dataset of the open file ``f`` by path, opened with HDF5's low-level calls
    (``h5py.h5d.DatasetID``): a third of the cost of h5py's objects, which a file of
    thousands of arrays pays per array."""
    names: list[bytes] = []

    def visit(name: bytes, info: Any) -> None:
        if info.type == h5py.h5o.TYPE_DATASET:
            names.append(name)

    h5py.h5o.visit(f.id, visit, info=True)
    return {n.decode("utf-8", "surrogateescape"): h5py.h5d.open(f.id, n) for n in names}


def _raw_ranges(found: dict[str, Any]) -> list[tuple[int, int]]:
    """(offset, end) of every contiguous dataset's raw data: bytes that are not metadata."""
    ranges: list[tuple[int, int]] = []
    for dsid in found.values():
        off = dsid.get_offset()
        if off is not None:
            ranges.append((off, off + dsid.get_storage_size()))
    return sorted(ranges)


def _check_collection(raw: bytes, at: int, name: str) -> None:
    """Objects of the global heap collection at ``raw[at:]`` must tile it exactly.

    A tail too short for an object header is free space without one (HDF5's own
    reader takes it so): a collection filled to within 16 bytes of its end.
    """
    size = struct.unpack_from("<Q", raw, at + 8)[0]
    end, q, seen = at + size, at + 16, set()
    while q + 16 <= end:
        index, _refs, _res, osize = struct.unpack_from("<HHIQ", raw, q)
        if index == 0:  # the free space: the rest of the collection
            if osize != end - q:
                raise CorruptCheckpoint(f"{name}: HDF5 global heap at {at} is damaged (free space)")
            return
        if index in seen or q + 16 + (osize + 7) // 8 * 8 > end:
            raise CorruptCheckpoint(
                f"{name}: HDF5 global heap at {at} is damaged (object {index}, {osize} bytes)"
            )
        seen.add(index)
        q += 16 + (osize + 7) // 8 * 8


def check_global_heaps(f: Any, path: Path, file_size: int, fd: int | None = None) -> dict[str, Any]:
    """Raise CorruptCheckpoint if a global heap collection (variable-length strings) is
    damaged; else return the file's :func:`datasets`, which the check opens anyway.

    Reads only the bytes outside the datasets' raw data (the metadata), at most
    ``_MAX_SCAN`` of them; through ``fd`` (open on ``path``) when given.
    """
    gaps, pos = [], 0
    try:
        found = datasets(f)
        ranges = _raw_ranges(found)
    except (RuntimeError, OSError, KeyError, ValueError) as exc:  # a damaged group or header
        raise CorruptCheckpoint(f"{path.name}: unreadable HDF5 structure ({exc})") from exc
    for lo, hi in ranges:
        if lo > pos:
            gaps.append((pos, lo))
        pos = max(pos, hi)
    if pos < file_size:
        gaps.append((pos, file_size))
    budget = _MAX_SCAN
    with contextlib.ExitStack() as stack:
        if fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            stack.callback(os.close, fd)
        for lo, hi in gaps:
            n = min(hi - lo, budget)
            if n <= 0:
                break
            budget -= n
            raw = _pread(fd, n, lo)
            at = raw.find(_GCOL)
            while at >= 0:
                header_ok = (
                    at + 16 <= len(raw)
                    and raw[at + 4] == 1
                    and raw[at + 5 : at + 8] == b"\0\0\0"
                    and 4096 <= struct.unpack_from("<Q", raw, at + 8)[0] <= file_size - lo - at
                )
                if header_ok:  # a collection (data that merely contains "GCOL" never gets here)
                    if at + struct.unpack_from("<Q", raw, at + 8)[0] > len(raw):
                        raise CorruptCheckpoint(
                            f"{path.name}: HDF5 global heap at {lo + at} runs into raw data"
                        )
                    _check_collection(raw, at, path.name)
                at = raw.find(_GCOL, at + 4)
    return found


def _pread(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file)."""
    parts, got = [], 0
    while got < n:
        part = os.pread(fd, n - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


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


# -- state trees read from a file ----------------------------------------------------------
def _dtype(text: Any, kinds: str, where: str) -> np.dtype:
    if not isinstance(text, str) or len(text) > 16:
        raise ValueError(f"{where}: dtype {text!r:.40} is not a short dtype string")
    dtype = np.dtype(text)
    if dtype.kind not in kinds or dtype.fields is not None or dtype.shape != ():
        raise ValueError(f"{where}: dtype {dtype} is not allowed")
    return dtype


def _check_state_dict(obj: Any, where: str) -> None:
    """A random generator's state: plain JSON, plus flat numeric arrays."""
    if isinstance(obj, dict):
        if obj.get("$t") == "ndarray":
            _dtype(obj.get("dtype"), "biuf", where)
            values = obj.get("v")
            if not isinstance(values, list) or any(
                not isinstance(x, (int, float)) or isinstance(x, bool) for x in values
            ):
                raise ValueError(f"{where}: a generator array must be a flat list of numbers")
            return
        for key, value in obj.items():
            _check_state_dict(value, f"{where}/{key}")
    elif isinstance(obj, list):
        for value in obj:
            _check_state_dict(value, where)
    elif obj is not None and not isinstance(obj, (str, int, float, bool)):
        raise ValueError(f"{where}: unexpected {type(obj).__name__} in a generator state")


def check_tree(tree: Any, where: str = "<root>") -> None:
    """Raise ValueError unless every node of ``tree`` is one hpcckpt writes (docs/format.md)."""
    if tree is None or isinstance(tree, (bool, str, int, float)):
        return
    if isinstance(tree, list):
        for i, item in enumerate(tree):
            check_tree(item, f"{where}/{i}")
        return
    if not isinstance(tree, dict):
        raise ValueError(f"{where}: {type(tree).__name__} is not a state tree node")
    tag = tree.get("$t")
    if tag not in _NODE_TAGS:
        raise ValueError(f"{where}: unknown node type {tag!r:.40}")
    value = tree.get("v")
    if tag == "dict":
        if not isinstance(value, dict):
            raise ValueError(f"{where}: a dict node needs a dict 'v'")
        for key, item in value.items():
            check_tree(item, f"{where}/{key}")
    elif tag == "tuple":
        if not isinstance(value, list):
            raise ValueError(f"{where}: a tuple node needs a list 'v'")
        for i, item in enumerate(value):
            check_tree(item, f"{where}/{i}")
    elif tag == "kdict":
        if not isinstance(value, list):
            raise ValueError(f"{where}: a kdict node needs a list of [key, value] pairs")
        for pair in value:
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and (pair[0] is None or isinstance(pair[0], (bool, int, float, str)))
            ):
                raise ValueError(f"{where}: a kdict entry must be [scalar key, value]")
            check_tree(pair[1], f"{where}/{pair[0]}")
    elif tag == "stateful":
        if not isinstance(tree.get("type"), str):
            raise ValueError(f"{where}: a stateful node needs its type name")
        check_tree(value, where)
    elif tag == "tensor":
        if not isinstance(tree.get("path"), str) or not isinstance(tree.get("dtype"), str):
            raise ValueError(f"{where}: a tensor node needs a path and a torch dtype name")
        if not _TORCH_DTYPE.match(tree["dtype"]):
            raise ValueError(f"{where}: {tree['dtype']!r:.40} is not a torch dtype name")
    elif tag == "bytes":
        if not isinstance(value, str):
            raise ValueError(f"{where}: a bytes node needs base64 text")
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{where}: bad base64 ({exc})") from None
    elif tag == "int":
        if not isinstance(tree.get("hex"), str) or not _HEX.match(tree["hex"]):
            raise ValueError(f"{where}: an int node needs hex digits")
    elif tag == "complex":
        if not (
            isinstance(value, list)
            and len(value) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
        ):
            raise ValueError(f"{where}: a complex node needs [real, imag]")
    elif tag == "npscalar":
        dtype = _dtype(tree.get("dtype"), "biufc", where)
        raw = tree.get("hex")
        if not isinstance(raw, str) or len(raw) != 2 * dtype.itemsize or not _HEX.match(raw):
            raise ValueError(f"{where}: a {dtype} scalar needs {2 * dtype.itemsize} hex digits")
    elif tag == "array":
        if not isinstance(tree.get("path"), str):
            raise ValueError(f"{where}: an array node needs a path")
    else:  # generator, randomstate
        state = tree.get("state")
        if not isinstance(state, dict):
            raise ValueError(f"{where}: a {tag} node needs a state dict")
        name = state.get("bit_generator")
        allowed = BIT_GENERATORS if tag == "generator" else {"MT19937"}
        if name not in allowed:
            raise ValueError(f"{where}: bit generator {name!r:.40} is not one of {sorted(allowed)}")
        _check_state_dict(state, where)


__all__ = [
    "BIT_GENERATORS",
    "check_global_heaps",
    "check_regular_file",
    "check_tree",
    "create_private",
    "check_free_space",
    "explain_write_error",
    "make_directory",
    "modes",
    "remove_leftover",
    "set_mode",
    "write_private",
]
