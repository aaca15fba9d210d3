"""The HDF5 global heap check, and the walk that opens every dataset of a file.

The HDF5 library (1.10) can loop forever reading a variable-length string attribute
whose global heap collection is damaged (one flipped bit in an object's size does it).
:func:`check_global_heaps` parses the collections in the file's metadata and checks them
before any attribute is read, so a damaged one is a :class:`CorruptCheckpoint`, not a
hung restore.
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path
from typing import Any

import h5py

from hpcckpt.store.errors import CorruptCheckpoint

#: What h5py and the reader's checks raise on a damaged file (HDF5 errors come as
#: OSError, KeyError, ValueError or RuntimeError, depending on where they happen).
DAMAGE_ERRORS = (OSError, KeyError, ValueError, TypeError, IndexError, RecursionError, RuntimeError)

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


def check_collection(raw: bytes, at: int, name: str) -> None:
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
                    check_collection(raw, at, path.name)
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
