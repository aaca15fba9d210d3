"""Per-rank heartbeats: how the wrapper tells a hung job from a slow one.

Each rank of a Checkpointer rewrites ``DIR/heartbeat/rank-<r>.json`` at most every
few seconds (from ``due()``, never more often): its step, the time, and its phase
(``compute``; ``save`` or ``restore`` during those; the call it waits in for the other
ranks once it has waited half a second: ``due``, ``finish``...; ``finished`` after
``finish()``). The wrapper reads them; a rank whose heartbeat is older than the hang
timeout has gone silent (a stuck collective, a dead mount), and :func:`places` says
where each rank is.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcckpt.atomicfile import atomic_write

HEARTBEAT_DIR = "heartbeat"
#: Seconds between two heartbeats of one rank (the cost: one tiny file write).
DEFAULT_PERIOD = 5.0
#: At most this long (seconds) between a beat and its writing: the writer's thread looks
#: for a new beat that often, so ``beat()`` never wakes it (a wakeup inside a save's
#: blocked window can cost the caller its core for milliseconds on a busy node).
WRITE_LAG = 0.2
#: Phases that say the rank is inside one of the Checkpointer's collective calls.
CALL_PHASES = ("due", "restore", "save", "wait", "finish", "close")
#: Of these, the calls made at a step (the heartbeat's step is the call's).
STEP_PHASES = ("due", "save")
#: Ranks named in one group of :func:`places`, groups shown.
_SHOWN, _GROUPS = 4, 8


@dataclass(frozen=True)
class Heartbeat:
    rank: int
    step: int | None
    time: float
    phase: str = "compute"


def heartbeat_dir(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / HEARTBEAT_DIR


def write_heartbeat(directory: str | os.PathLike[str], beat: Heartbeat) -> None:
    """Replace this rank's heartbeat file atomically; not durably: it is stale in seconds,
    and an fsync every few seconds on every rank would load the file system for nothing."""
    folder = heartbeat_dir(directory)
    path = folder / f"rank-{beat.rank}.json"
    text = json.dumps(asdict(beat))
    temp = f".rank-{beat.rank}.json.tmp"
    try:
        atomic_write(path, text, mode=None, durable=False, temp=temp)
    except FileNotFoundError:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write(path, text, mode=None, durable=False, temp=temp)


def read_heartbeats(directory: str | os.PathLike[str]) -> dict[int, Heartbeat]:
    """The latest heartbeat of every rank that wrote one (unreadable files are skipped)."""
    beats: dict[int, Heartbeat] = {}
    folder = heartbeat_dir(directory)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return beats
    for name in names:
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        try:
            data = json.loads((folder / name).read_text())
            beat = Heartbeat(
                int(data["rank"]),
                data.get("step"),
                float(data["time"]),
                str(data.get("phase", "compute")),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        beats[beat.rank] = beat
    return beats


def where(beat: Heartbeat | None) -> str:
    """Where a heartbeat says its rank is: "in save (step 5)", "in finish", "computing
    (step 11)", "finished", "no heartbeat"."""
    if beat is None:
        return "no heartbeat"
    step = "" if beat.step is None else f" (step {beat.step})"
    if beat.phase == "compute":
        return f"computing{step}"
    if beat.phase in CALL_PHASES:
        return f"in {beat.phase}{step if beat.phase in STEP_PHASES else ''}"
    return beat.phase


def places(beats: Mapping[int, Heartbeat | None], ranks: Iterable[int] | None = None) -> str:
    """Where each rank of ``ranks`` (default: those of ``beats``) is, grouped by place:
    "ranks 0, 1 in save (step 5), rank 2 in finish"."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(beats if ranks is None else ranks):
        groups.setdefault(where(beats.get(rank)), []).append(rank)
    parts = []
    for text, members in list(groups.items())[:_GROUPS]:
        shown = ", ".join(map(str, members[:_SHOWN]))
        more = f" and {len(members) - _SHOWN} more" if len(members) > _SHOWN else ""
        parts.append(f"rank{'s' * (len(members) > 1)} {shown}{more} {text}")
    if len(groups) > _GROUPS:
        parts.append(f"and {len(groups) - _GROUPS} more places")
    return ", ".join(parts)


def clear_heartbeats(directory: str | os.PathLike[str]) -> None:
    """Forget the heartbeats of an earlier attempt."""
    folder = heartbeat_dir(directory)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        (folder / name).unlink(missing_ok=True)


class HeartbeatWriter:
    """Rate-limited heartbeat of one rank: ``beat()`` is cheap to call every step.

    A thread of its own writes the file within :data:`WRITE_LAG`: a beat inside a save's
    blocked window costs a lock, not a rename (milliseconds on a file system busy with
    the checkpoint's own write-back, or a metadata server away) nor a thread's wakeup.
    Only the newest beat is kept for it: one never written is older than the next.
    :meth:`flush` waits until the newest is written; after :meth:`close` beats are
    written by the caller.
    """

    def __init__(
        self, directory: str | os.PathLike[str], rank: int, period: float = DEFAULT_PERIOD
    ) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self.period = period
        self._last = -float("inf")
        self._cond = threading.Condition()
        self._latest: Heartbeat | None = None  # handed over, not written yet
        self._thread: threading.Thread | None = None
        self._closed = False

    def beat(self, step: int | None, phase: str = "compute", force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.period:
            return
        self._last = now
        beat = Heartbeat(self.rank, step, time.time(), phase)
        with self._cond:
            if not self._closed:
                self._latest = beat
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="hpcckpt-heartbeat", daemon=True
                    )
                    self._thread.start()
                return  # its thread looks within WRITE_LAG
        _write_quietly(self.directory, beat)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds until the newest beat is written; whether it is."""
        with self._cond:
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._latest is None, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write the newest beat, stop the thread; later beats are written at once."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._cond.wait_for(
                    lambda: self._latest is not None or self._closed, WRITE_LAG
                ):
                    pass
                beat = self._latest
                if beat is None:  # closed, nothing left
                    return
            _write_quietly(self.directory, beat)
            with self._cond:
                if self._latest is beat:
                    self._latest = None
                self._cond.notify_all()


def _write_quietly(directory: Path, beat: Heartbeat) -> None:
    try:
        write_heartbeat(directory, beat)
    except OSError:
        pass  # a heartbeat must never stop the computation
