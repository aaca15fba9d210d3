"""Why one shared file is slower than a file per rank here, and what closes the gap.

Run under ``mpirun -n 2``. Without HDF5, every rank writes its own half of one
shared file at its offset and makes it durable in one of several ways, next to the
limit (a file per rank, 64 MiB writes, fsync) in the same invocation, variants
rotated per repetition:

- ``shared fsync``: ``pwrite`` + ``fsync`` on every rank (what the writer does today);
- ``shared range sync``: ``pwrite`` + ``sync_file_range`` of the rank's own range
  (writeback of both halves starts in parallel), then one ``fdatasync`` on rank 0;
- ``shared prealloc + range sync``: the same into a file ``fallocate``d by rank 0;
- ``shared O_DIRECT``: aligned ``pwrite`` with ``O_DIRECT`` (no page cache, no inode
  lock held across the copy) into a preallocated file, then one ``fdatasync``.

Prints one JSON record per (repetition, size, variant) on rank 0.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _util  # noqa: E402
from _util import MiB, timed, write_raw  # noqa: E402

_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
SFR_ALL = 1 | 2 | 4  # WAIT_BEFORE | WRITE | WAIT_AFTER
CHUNK = 64 * MiB


def sync_range(fd: int, off: int, n: int) -> None:
    if _libc.sync_file_range(fd, off, n, SFR_ALL) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def pwrite_all(fd: int, buf: memoryview, off: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done : done + CHUNK], off + done)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--sizes", default="512M")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    root = Path(args.dir)
    shared = root / "shared.bin"

    def prepare() -> None:
        if rank == 0:
            _util.drop_caches()
        comm.Barrier()

    def create(size: int, prealloc: bool) -> None:
        if rank == 0:
            shared.unlink(missing_ok=True)
            fd = os.open(shared, os.O_WRONLY | os.O_CREAT, 0o600)
            if prealloc:
                os.posix_fallocate(fd, 0, size * n)
            os.fsync(fd)
            os.close(fd)
        comm.Barrier()

    def variant(name: str, a: np.ndarray, aligned: mmap.mmap) -> float:
        size = a.nbytes
        buf = memoryview(a).cast("B")
        off = rank * size
        if name == "limit":
            path = root / f"limit.{rank}"
            prepare()
            t = timed(comm, lambda: write_raw(path, buf))
            path.unlink()
            return t
        prealloc = name in ("shared prealloc + range sync", "shared O_DIRECT")
        create(size, prealloc)
        prepare()

        def run() -> None:
            flags = os.O_WRONLY | (os.O_DIRECT if name == "shared O_DIRECT" else 0)
            fd = os.open(shared, flags)
            try:
                if name == "shared O_DIRECT":
                    pwrite_all(fd, memoryview(aligned), off)
                else:
                    pwrite_all(fd, buf, off)
                if name == "shared fsync":
                    os.fsync(fd)
                elif name == "shared O_DIRECT":
                    comm.Barrier()
                    if rank == 0:
                        os.fdatasync(fd)
                else:
                    sync_range(fd, off, size)
                    comm.Barrier()
                    if rank == 0:
                        os.fdatasync(fd)
            finally:
                os.close(fd)

        t = timed(comm, run)
        comm.Barrier()
        if rank == 0:
            shared.unlink()
        return t

    names = [
        "limit",
        "shared fsync",
        "shared range sync",
        "shared prealloc + range sync",
        "shared O_DIRECT",
    ]
    for rep in range(args.reps):
        for size in map(_util.parse_size, args.sizes.split(",")):
            a = np.random.default_rng(rank).random(size // 8)
            aligned = mmap.mmap(-1, size)  # page aligned, as O_DIRECT needs
            memoryview(aligned)[:] = memoryview(a).cast("B")
            for name in _util.rotate(names, rep):
                t = variant(name, a, aligned)
                if rank == 0:
                    rec = {"rep": rep, "size": size, "variant": name, "seconds": t}
                    print(json.dumps(rec), flush=True)
            aligned.close()


if __name__ == "__main__":
    main()
