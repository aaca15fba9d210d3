"""Restart files written on the application's own schedule (no signal to forward).

Many codes (molecular dynamics, CFD, legacy Fortran) take no signal at all: they rewrite
their restart files every N steps or minutes, and TERM simply kills them. With
``--restart-files GLOB`` and no ``--app-signal`` the wrapper never signals the step; it
watches the files while the step runs and keeps each complete set:

- **a set is what one write burst wrote**: the files matching GLOB that changed (new, or
  rewritten) since the last kept set, once none changed for ``settle`` seconds *and the
  step was alive all that time* — a set whose writer died (killed at the limit,
  mid-write) is never kept. Two kinds of codes, one rule:

  - a **fixed set rewritten in place** (``restart.0``, ``restart.1`` every time): the
    burst must rewrite every file of the last kept set (before the first set: every
    matching file);
  - a **growing series** (``restart.1000.bin``, ``restart.2000.bin``; or files in new
    time-step directories): the burst's new files are the set, and once a set was kept a
    burst must write as many files as it did (one per rank, say). The older files of the
    series are the application's: never touched.

  Each complete set is checksummed and copied into ``DIR/restart-sets/<n>/``
  (:meth:`hpcckpt.job.restart_files.RestartFiles.register`, only the burst's files); the
  cost of a write is the time from its first observed change to its last, and
  :attr:`OwnScheduleWatch.writes` keeps when each write began and ended (the lead rule of
  :mod:`hpcckpt.job.ownlead` plans with them).
- **a stop** (the ``--signal`` signal, TERM, the wrapper's end-time stop): the step runs on
  while a set is being written, until that set is complete; then (or at once, when no
  write is under way) the wrapper ends the step. That is a stop, not a crash: the job is
  requeued and resumes from the newest kept set. At the next start a live file cut
  mid-write is found by its checksum and the kept set is put back
  (:meth:`RestartFiles.ensure_good`); a file of a series cut mid-write is moved aside
  (:meth:`RestartFiles.set_aside_cut`), so the code's own "newest file" logic reads a
  complete one.
- ``HPCCKPT_INTERVAL``: the Young interval from the measured cost of these writes
  (:class:`hpcckpt.job.periodic.PeriodicSchedule` with ``auto``), for applications with an
  interval option.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

from hpcckpt.job.restart_files import PendingSet, RestartFiles


@dataclass
class _Write:
    first_change_wall: float
    last_change_mono: float
    seen: dict[str, tuple[int, int]]


@dataclass(frozen=True)
class WriteSpan:
    """One kept write: when its first change was seen and when its last file was written
    (Unix seconds)."""

    began: float
    ended: float


def snapshot(files: RestartFiles) -> dict[str, tuple[int, int]]:
    """(size, mtime in ns) of each live restart file: what tells a write under way."""
    out = {}
    for path in files.current():
        try:
            st = os.stat(path)
        except OSError:
            continue
        out[path] = (st.st_size, st.st_mtime_ns)
    return out


def burst_complete(
    changed: Iterable[str], before: Iterable[str], members: Iterable[str] | None
) -> bool:
    """Is a settled write burst a whole set? ``changed``: the files it wrote; ``before``:
    the files there were when it began (at the last kept set, or the step's start);
    ``members``: the files of the last kept set (None: none kept yet). See the module doc."""
    changed, before = set(changed), set(before)
    if not changed:
        return False
    new = changed - before
    if not new:  # a fixed set rewritten in place: all of it
        return changed >= (set(members) if members is not None else before)
    if members is None:
        return True  # the first set of a series: whatever one burst wrote
    return len(changed) >= len(set(members))


class OwnScheduleWatch:
    """``tick(alive)`` while the step runs; returns a complete set to keep, or None."""

    def __init__(
        self,
        files: RestartFiles,
        since_wall_ns: int,
        settle: float,
        members: Iterable[str] | None = None,
    ) -> None:
        self.files = files
        self.since_ns = since_wall_ns
        self.settle = float(settle)
        self._write: _Write | None = None
        self._before = set(snapshot(files))  # what there was at the start
        self.members: set[str] | None = None if members is None else set(members)
        self.writes: list[WriteSpan] = []  # the kept writes of this step
        self.first_seen: float | None = None  # Unix seconds: the step's first write began

    @property
    def writing(self) -> bool:
        """A write is under way (files changed since the last kept set, not yet complete)."""
        return self._write is not None

    @property
    def write_began(self) -> float | None:
        """When the write under way began (Unix seconds), None when none is."""
        return None if self._write is None else self._write.first_change_wall

    @property
    def unfinished(self) -> list[str]:
        """The files the write under way has touched so far."""
        return [] if self._write is None else sorted(self._write.seen)

    def tick(self, alive: bool, now: float | None = None) -> PendingSet | None:
        now = time.monotonic() if now is None else now
        snap = snapshot(self.files)
        changed = {p: s for p, s in snap.items() if s[1] > self.since_ns}
        if not changed:
            self._write = None
            return None
        if self._write is None:
            began = min(time.time(), min(s[1] for s in changed.values()) / 1e9)
            self._write = _Write(began, now, changed)
            if self.first_seen is None:
                self.first_seen = began
            return None
        if changed != self._write.seen:
            self._write.seen = changed
            self._write.last_change_mono = now
            return None
        if not alive:
            return None  # the writer is gone: the set may be cut; never keep it
        if now - self._write.last_change_mono < self.settle:
            return None
        if not burst_complete(changed, self._before, self.members):
            return None  # some files not written yet
        newest = max(s[1] for s in changed.values())
        done = PendingSet(
            signal_wall_ns=int(self._write.first_change_wall * 1e9),
            signal_mono=self._write.last_change_mono,
            stop=False,
            seen=dict(changed),
            last_change_wall=newest / 1e9,
        )
        self.writes.append(WriteSpan(self._write.first_change_wall, newest / 1e9))
        self.since_ns = newest
        self.members = set(changed)
        self._before = set(snap)
        self._write = None
        return done
