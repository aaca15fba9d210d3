"""Count what one save or restore costs in messages and system calls, on real MPI.

:class:`CountingComm` is a real communicator (the same MPI handle as the one it
wraps) that counts every call by kind; :func:`strace_counts` reads an ``strace -f``
log of an ``mpirun`` and counts, per rank and phase, the system calls between the
phase markers each rank leaves with :func:`mark` (a ``stat`` of a path that does not
exist). Used by ``benchmarks/bench_collectives.py`` (the table) and
``tests/store/test_store_mpi.py`` (the bound).
"""

from __future__ import annotations

import os
import re
from collections import Counter, defaultdict
from pathlib import Path

from mpi4py import MPI

COLLECTIVES = (
    "Allreduce allreduce Iallreduce Bcast bcast Gather gather Gatherv Allgather allgather "
    "Allgatherv Alltoall alltoall Alltoallv Exscan exscan Scan scan Reduce reduce "
    "Reduce_scatter_block Scatter scatter Split Split_type Dup Barrier barrier"
).split()
POINT_TO_POINT = (
    "Send send Recv recv Isend isend Irecv irecv Sendrecv sendrecv Ssend ssend Probe probe"
).split()
MARK_ROOT = "/nonexistent-hpcckpt-mark"


class CountingComm(MPI.Intracomm):
    """``comm`` itself (same handle), counting each collective and point-to-point call."""

    counts: Counter

    def __new__(cls, comm: MPI.Intracomm) -> CountingComm:
        self = super().__new__(cls, comm)
        self.counts = Counter()
        return self

    def reset(self) -> Counter:
        """The counts so far; start again from zero."""
        out, self.counts = self.counts, Counter()
        return out


def _counting(name: str):
    base = getattr(MPI.Intracomm, name)

    def call(self, *args, **kwargs):
        self.counts[name] += 1
        return base(self, *args, **kwargs)

    call.__name__ = name
    return call


for _name in COLLECTIVES + POINT_TO_POINT:
    if hasattr(MPI.Intracomm, _name):
        setattr(CountingComm, _name, _counting(_name))


def summarize(counts: Counter) -> dict[str, int]:
    """Collectives (all, and the barriers), point-to-point calls, and each kind."""
    coll = sum(n for k, n in counts.items() if k in COLLECTIVES)
    return {
        "collectives": coll,
        "barriers": counts["Barrier"] + counts["barrier"],
        "p2p": sum(n for k, n in counts.items() if k in POINT_TO_POINT),
        "kinds": dict(sorted(counts.items())),
    }


def mark(rank: int, what: str) -> None:
    """Leave ``what`` (e.g. ``save-begin``) in an ``strace`` log of this rank."""
    try:
        os.stat(f"{MARK_ROOT}/r{rank}-{what}")
    except OSError:
        pass


_LINE = re.compile(r"^(\d+)\s+(?:\d+\.\d+\s+)?(\w+)\((.*)$")
_CLONE = re.compile(r"= (\d+)\s*$")
_RESUMED = re.compile(r"^(\d+)\s+(?:\d+\.\d+\s+)?<\.\.\. (clone3?) resumed>.*= (\d+)\s*$")
_MARK = re.compile(re.escape(MARK_ROOT) + r"/r(\d+)-(\w+)-(begin|end)")
SYSCALLS = {
    "openat": "opens",
    "open": "opens",
    "fsync": "fsyncs",
    "fdatasync": "fsyncs",
    "rename": "renames",
    "renameat": "renames",
    "renameat2": "renames",
    "pwrite64": "writes",
    "write": "writes",
    "pwritev": "writes",
    "pwritev2": "writes",
}


def strace_counts(log: Path) -> dict[tuple[int, str], Counter]:
    """Per (rank, phase): the opens (and those of ``.h5`` files), fsyncs, renames and
    writes of that rank's threads between its ``PHASE-begin`` and ``PHASE-end`` marks.

    ``log`` is ``strace -f -o LOG`` of the whole ``mpirun``: threads are found through
    the ``clone`` calls that made them, ranks through their marks.
    """
    owner: dict[int, int] = {}  # thread id -> the process's first thread
    rank_of: dict[int, int] = {}
    phase: dict[int, str | None] = defaultdict(lambda: None)
    out: dict[tuple[int, str], Counter] = defaultdict(Counter)
    threading: set[int] = set()  # threads inside an unfinished clone of a thread
    for line in log.read_text(errors="replace").splitlines():
        r = _RESUMED.match(line)
        if r:
            tid = int(r.group(1))
            if tid in threading:
                threading.discard(tid)
                owner[int(r.group(3))] = owner.setdefault(tid, tid)
            continue
        m = _LINE.match(line)
        if not m:
            continue
        tid, call, rest = int(m.group(1)), m.group(2), m.group(3)
        pid = owner.setdefault(tid, tid)
        if call in ("clone", "clone3") and "CLONE_THREAD" in rest:
            c = _CLONE.search(rest)
            if c:
                owner[int(c.group(1))] = pid
            else:
                threading.add(tid)
            continue
        mk = _MARK.search(rest) if call in ("stat", "newfstatat", "statx") else None
        if mk:
            rank_of[pid] = int(mk.group(1))
            phase[pid] = mk.group(2) if mk.group(3) == "begin" else None
            continue
        what = phase[pid]
        kind = SYSCALLS.get(call)
        if what is None or kind is None:
            continue
        out[(rank_of[pid], what)][kind] += 1
        if kind == "opens" and ".h5" in rest:
            out[(rank_of[pid], what)]["h5_opens"] += 1
    return out
