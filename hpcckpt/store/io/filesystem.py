"""Parallel file systems: recognise the checkpoint directory's, and tune the writes for it.

Detection reads the ``f_type`` magic number of ``statfs(2)`` through ctypes (the
kernel's own answer for the path, mounts and bind mounts included); when that call
is unavailable it falls back to the longest matching mount point in
``/proc/self/mountinfo``. Everything else here is pure: given the file system kind,
the number of ranks and the checkpoint size it returns the ``lfs setstripe`` argument
list, the HDF5 alignment and whether to write past the page cache, so tests check them
exactly even though neither Lustre nor GPFS exists on a laptop. No MPI-IO hints: the
store opens no file through MPI-IO. See docs/filesystems.md.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hpcckpt import libc

log = logging.getLogger("hpcckpt.store")

LUSTRE, GPFS, NFS, BEEGFS, LOCAL, UNKNOWN = "lustre", "gpfs", "nfs", "beegfs", "local", "unknown"

#: statfs f_type magic numbers (linux/magic.h and the file systems' sources).
MAGIC: dict[int, tuple[str, str]] = {
    0x0BD00BD0: (LUSTRE, "lustre"),
    0x47504653: (GPFS, "gpfs"),
    0x6969: (NFS, "nfs"),
    0x19830326: (BEEGFS, "beegfs"),
    0xEF53: (LOCAL, "ext2/3/4"),
    0x58465342: (LOCAL, "xfs"),
    0x9123683E: (LOCAL, "btrfs"),
    0x01021994: (LOCAL, "tmpfs"),
    0x794C7630: (LOCAL, "overlay"),
    0x2FC12FC1: (LOCAL, "zfs"),
    0x65735546: (LOCAL, "fuse"),
}
#: /proc/self/mountinfo type names, for the fallback.
_FSTYPE = {
    "lustre": LUSTRE,
    "gpfs": GPFS,
    "nfs": NFS,
    "nfs4": NFS,
    "beegfs": BEEGFS,
    "ext2": LOCAL,
    "ext3": LOCAL,
    "ext4": LOCAL,
    "xfs": LOCAL,
    "btrfs": LOCAL,
    "tmpfs": LOCAL,
    "overlay": LOCAL,
    "zfs": LOCAL,
}

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class FileSystem:
    """The file system holding a directory: a kind for tuning, and what was seen."""

    kind: str  # lustre, gpfs, nfs, beegfs, local or unknown
    name: str  # e.g. "ext2/3/4", "lustre", or the mountinfo type
    magic: int | None  # statfs f_type, None when found through mountinfo
    block_size: int  # statvfs f_bsize (GPFS reports its file system block size here)


def kind_of_magic(magic: int) -> tuple[str, str]:
    """(kind, name) of a statfs ``f_type`` magic number; unknown numbers are "unknown"."""
    return MAGIC.get(magic & 0xFFFFFFFF, (UNKNOWN, f"0x{magic & 0xFFFFFFFF:08x}"))


def statfs_magic(path: str | os.PathLike[str]) -> int | None:
    """``statfs(path).f_type`` via libc, or None where the call is not available."""
    statfs = libc.function("statfs")
    if statfs is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if statfs(os.fsencode(path), buf) != 0:
        return None
    # f_type is the first member, a signed word (__fsword_t).
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def mountinfo_type(path: str | os.PathLike[str], mountinfo: str | None = None) -> str | None:
    """The type name of the mount holding ``path`` per /proc/self/mountinfo (longest prefix)."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mount = fields[4].encode().decode("unicode_escape")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, best_type = mount, right.split()[0]
    return best_type


def detect(directory: str | os.PathLike[str]) -> FileSystem:
    """The file system of ``directory``, or of its nearest existing parent."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        block = os.statvfs(path).f_bsize
    except OSError:
        block = 4096
    magic = statfs_magic(path)
    if magic is not None:
        kind, name = kind_of_magic(magic)
        return FileSystem(kind, name, magic, block)
    fstype = mountinfo_type(path) or "unknown"
    return FileSystem(_FSTYPE.get(fstype.split(".")[0], UNKNOWN), fstype, None, block)


@dataclass(frozen=True)
class TuningOptions:
    """What a site or user may set; None means "choose from the state size and rank count"."""

    stripe_count: int | None = None  # Lustre OSTs per file; -1 = all
    stripe_size: int | None = None  # bytes, a multiple of 64 KiB
    setstripe: bool = True  # run `lfs setstripe` on the directory (Lustre)
    alignment: bool = True  # align HDF5 datasets to the stripe or block size
    kind: str | None = None  # force a file system kind instead of detecting it
    direct_io: bool | None = None  # write array bytes with O_DIRECT (see store.direct_io)
    #: Gone: MPI-IO hints had no effect once the store stopped using MPI-IO. Accepted only
    #: to refuse it with a message that says so.
    hints: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.hints:
            raise ValueError(
                f"TuningOptions(hints={self.hints!r}): hpcckpt opens no checkpoint through "
                "MPI-IO any more, so MPI-IO hints would have no effect; drop the argument "
                "(on Lustre set the layout with stripe_count= and stripe_size=)"
            )


@dataclass(frozen=True)
class Tuning:
    """The decisions for one checkpoint directory."""

    kind: str
    setstripe_argv: list[str] | None
    alignment: tuple[int, int] | None  # HDF5 (threshold, interval) in bytes
    direct_io: bool = False  # array bytes past the page cache


#: File systems whose O_DIRECT writes are worth the bounce copy (see store.direct_io):
#: block-device file systems and the parallel ones that implement it. Not NFS or
#: BeeGFS (client-side semantics vary), nor tmpfs, overlay, FUSE or ZFS.
#: Names as :func:`detect` gives them: from statfs, or the mountinfo type.
DIRECT_IO_NAMES = {"ext2/3/4", "ext2", "ext3", "ext4", "xfs", "btrfs", "lustre", "gpfs"}


def default_stripe_count(total_bytes: int, nranks: int, cap: int = 64) -> int:
    """One stripe per GiB of checkpoint, at least 1, at most one per rank and ``cap``."""
    return max(1, min(nranks, cap, math.ceil(total_bytes / GiB)))


def default_stripe_size(total_bytes: int, nranks: int) -> int:
    """1 MiB for small checkpoints, 4 MiB from 1 GiB per rank, 16 MiB from 16 GiB per rank."""
    per_rank = total_bytes / max(nranks, 1)
    return 16 * MiB if per_rank >= 16 * GiB else 4 * MiB if per_rank >= GiB else MiB


def setstripe_argv(directory: str | os.PathLike[str], count: int, size: int) -> list[str]:
    """``lfs setstripe -c COUNT -S SIZE DIR``: new files in DIR get this layout."""
    if size <= 0 or size % (64 * 1024):
        raise ValueError(f"Lustre stripe size must be a positive multiple of 64 KiB, not {size}")
    if count == 0 or count < -1:
        raise ValueError(f"Lustre stripe count must be >= 1 or -1 (all OSTs), not {count}")
    return ["lfs", "setstripe", "-c", str(count), "-S", str(size), str(directory)]


def plan(
    directory: str | os.PathLike[str],
    fs: FileSystem,
    nranks: int,
    total_bytes: int,
    options: TuningOptions | None = None,
) -> Tuning:
    """The setstripe command, HDF5 alignment and direct-I/O choice for ``fs``; pure."""
    options = options or TuningOptions()
    kind = options.kind or fs.kind
    argv, alignment = None, None
    if kind == LUSTRE:
        count = options.stripe_count or default_stripe_count(total_bytes, nranks)
        size = options.stripe_size or default_stripe_size(total_bytes, nranks)
        argv = setstripe_argv(directory, count, size) if options.setstripe else None
        alignment = (size // 2, size) if options.alignment else None
    elif kind == GPFS:
        block = options.stripe_size or fs.block_size
        alignment = (block // 2, block) if options.alignment and block > 4096 else None
    return Tuning(kind, argv, alignment, direct_io(fs, options))


def direct_io(fs: FileSystem, options: TuningOptions | None = None) -> bool:
    """Whether array bytes go past the page cache on ``fs``, written and read back:
    ``options.direct_io`` if set, else by file system (:data:`DIRECT_IO_NAMES`)."""
    if options is not None and options.direct_io is not None:
        return options.direct_io
    return fs.name in DIRECT_IO_NAMES


def apply_setstripe(argv: list[str]) -> str | None:
    """Run an ``lfs setstripe`` argument list; None on success, else why it did not work.

    Failing to stripe is not fatal: the checkpoint is still written, just slower.
    """
    if shutil.which(argv[0]) is None:
        return f"{argv[0]} not found on PATH"
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {proc.stderr.strip()[:300]}"
    return None
