"""Restart files written on the application's own schedule (no signal to forward).

Many codes (molecular dynamics, CFD, legacy Fortran) take no signal at all: they rewrite
their restart files every N steps or minutes, and TERM simply kills them. With
``--restart-files GLOB`` and no ``--app-signal`` the wrapper never signals the step; it
watches the files while the step runs and keeps each complete set:

- **complete**: every matching file was rewritten since the last kept set (or since the
  step started), none changed for ``settle`` seconds, *and the step was alive all that
  time* — a set whose writer died (killed at the limit, mid-write) is never kept. Each
  complete set is checksummed and copied into ``DIR/restart-sets/<n>/``
  (:meth:`hpcckpt.job.restart_files.RestartFiles.register`); the cost of a write is the
  time from its first observed change to its last.
- **a stop** (the ``--signal`` signal, TERM, the wrapper's end-time stop): the step runs on
  while a set is being written, until that set is complete; then (or at once, when no
  write is under way) the wrapper ends the step. That is a stop, not a crash: the job is
  requeued and resumes from the newest kept set. At the next start a live file cut
  mid-write is found by its checksum and the kept set is put back
  (:meth:`RestartFiles.ensure_good`).
- ``HPCCKPT_INTERVAL``: the Young interval from the measured cost of these writes
  (:class:`hpcckpt.job.periodic.PeriodicSchedule` with ``auto``), for applications with an
  interval option.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from hpcckpt.job.restart_files import PendingSet, RestartFiles


@dataclass
class _Write:
    first_change_wall: float
    last_change_mono: float
    seen: dict[str, tuple[int, int]]


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


class OwnScheduleWatch:
    """``tick(alive)`` while the step runs; returns a complete set to keep, or None."""

    def __init__(self, files: RestartFiles, since_wall_ns: int, settle: float) -> None:
        self.files = files
        self.since_ns = since_wall_ns
        self.settle = float(settle)
        self._write: _Write | None = None

    @property
    def writing(self) -> bool:
        """A write is under way (files changed since the last kept set, not yet complete)."""
        return self._write is not None

    def tick(self, alive: bool, now: float | None = None) -> PendingSet | None:
        now = time.monotonic() if now is None else now
        snap = snapshot(self.files)
        changed = {p: s for p, s in snap.items() if s[1] > self.since_ns}
        if not changed:
            self._write = None
            return None
        if self._write is None:
            self._write = _Write(time.time(), now, snap)
            return None
        if snap != self._write.seen:
            self._write.seen = snap
            self._write.last_change_mono = now
            return None
        if not alive:
            return None  # the writer is gone: the set may be cut; never keep it
        if now - self._write.last_change_mono < self.settle:
            return None
        if len(changed) != len(snap):
            return None  # some files not rewritten yet
        newest = max(s[1] for s in snap.values())
        done = PendingSet(
            signal_wall_ns=int(self._write.first_change_wall * 1e9),
            signal_mono=self._write.last_change_mono,
            stop=False,
            seen=dict(snap),
            last_change_wall=newest / 1e9,
        )
        self.since_ns = newest
        self._write = None
        return done
