"""The background copy to the mirror: one thread of rank 0, off the ranks' critical path.

After a commit, the store's rank 0 hands the checkpoint to :class:`MirrorWorker`
(``committed``; :class:`~hpcckpt.store.store.CheckpointStore` owns the worker); the
thread uploads it (:func:`.mirror.copy.upload`: verified, manifest last), then applies the
mirror's retention. One writer per checkpoint: the checkpoint is one file, already
durable in the directory, so one sequential stream reads it once and no rank waits.
Only the newest checkpoint waiting counts: a newer one replaces an older one not yet
started. A mirror that refuses, is slow or full costs retries with a backoff (1 s,
doubling, up to ``mirror_retry_max``) and a ``mirror_failed`` report each time, never a
stall: the ranks go on, and the directory keeps what is on its way (``protected``).
At a stop or ``finish()`` the store waits a bounded time for the newest checkpoint
(:meth:`MirrorWorker.wait_newest`, a :class:`MirrorWait`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror import retention as mirror_retention
from hpcckpt.store.mirror.backend import MirrorBackend, MirrorUnavailable
from hpcckpt.store.mirror.options import MirrorOptions
from hpcckpt.store.retention import Candidate, checkpoint_chain

log = logging.getLogger("hpcckpt.store")

#: The report callback: (event name, fields); the Checkpointer writes them as events.
Report = Callable[[str, dict[str, Any]], None]
MIRRORED, MIRROR_FAILED, MIRROR_PRUNED = "mirrored", "mirror_failed", "mirror_pruned"


@dataclass(frozen=True)
class MirrorWait:
    """How a bounded wait for the newest checkpoint to reach the mirror ended: its
    ``step``, whether it arrived (``done``), the ``seconds`` waited, the newest step
    this worker verified there and the last failure's reason."""

    step: int
    done: bool
    seconds: float
    newest_mirrored: int | None
    error: str | None


@dataclass(frozen=True)
class Target:
    """A committed checkpoint to mirror, and the steps of the files it is built on."""

    step: int
    path: Path
    needs: tuple[int, ...]


class MirrorWorker:
    """Rank 0's background copy of committed checkpoints to the mirror; its thread starts
    with the first checkpoint queued."""

    def __init__(
        self, backend: MirrorBackend, options: MirrorOptions, report: Report | None = None
    ) -> None:
        self.backend = backend
        self.options = options
        self.report = report or (lambda kind, fields: None)
        self._lock = threading.Condition()
        self._pending: Target | None = None
        self._current: Target | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._commits = 0  # commits since the last one submitted
        self._last_submit: float | None = None
        #: The newest step verified on the mirror by this worker (None: none yet).
        self.newest_mirrored: int | None = None
        self.last_error: str | None = None
        self.failures = 0
        self._thread: threading.Thread | None = None

    # -- the ranks' side (rank 0's main thread) ---------------------------------------------
    def committed(self, step: int, path: Path, *, force: bool = False) -> bool:
        """A checkpoint was committed: queue it when it is due (``mirror_every`` or
        ``mirror_interval``), or always with ``force``. Whether it was queued."""
        self._commits += 1
        now = time.monotonic()
        interval = self.options.mirror_interval
        if interval is not None:
            due = self._last_submit is None or now - self._last_submit >= float(interval)
        else:
            due = self._commits >= int(self.options.mirror_every)
        if not (due or force):
            return False
        self.submit(step, path)
        return True

    def submit(self, step: int, path: Path) -> None:
        """Queue this checkpoint, replacing a queued older one not started yet."""
        _uid, chain = checkpoint_chain(path)
        target = Target(step, path, tuple(s for _, s, _ in chain))
        with self._lock:
            if self._current is not None and self._current.step == step:
                return
            if self._pending is None or self._pending.step <= step:
                self._pending = target
            self._commits = 0
            self._last_submit = time.monotonic()
            self._lock.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hpcckpt-mirror", daemon=True)
            self._thread.start()
        self._wake.set()

    def submit_newest(self, directory: Path) -> int | None:
        """Queue the directory's newest checkpoint unless it is mirrored or on its way
        (finish, stop). Its step, or None when there is nothing to copy."""
        entries = [e for e in layout.scan(directory) if e.good_candidate]
        if not entries:
            return None
        newest = entries[0]
        with self._lock:
            busy = {t.step for t in (self._pending, self._current) if t is not None}
        if newest.step not in busy and newest.step != self.newest_mirrored:
            self.submit(newest.step, newest.path)
        return newest.step

    def protected(self) -> set[int]:
        """Steps the directory must keep: the checkpoints on their way to the mirror, not
        yet verified there, and the files they are built on."""
        with self._lock:
            targets = [t for t in (self._pending, self._current) if t is not None]
        return {s for t in targets for s in (t.step, *t.needs)}

    def busy(self) -> bool:
        with self._lock:
            return self._pending is not None or self._current is not None

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until nothing is queued or being copied;
        whether that happened."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._pending is not None or self._current is not None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._wake.set()  # skip a backoff sleep: try now
                self._lock.wait(min(left, 0.5))
        return True

    def wait_newest(self, directory: Path, timeout: float) -> MirrorWait | None:
        """Queue the directory's newest checkpoint (:meth:`submit_newest`) and wait up to
        ``timeout`` seconds for the queue to empty (a stop, ``finish()``); how it ended,
        or None when the directory holds nothing to copy."""
        t0 = time.monotonic()
        step = self.submit_newest(directory)
        if step is None:
            return None
        done = self.wait(timeout)
        return MirrorWait(step, done, time.monotonic() - t0, self.newest_mirrored, self.last_error)

    def close(self) -> None:
        """Stop the thread (a copy under way is left unfinished: without its manifest it
        never counts)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    # -- the thread --------------------------------------------------------------------------
    def _take(self) -> Target | None:
        with self._lock:
            target, self._pending = self._pending, None
            self._current = target
            return target

    def _done(self) -> None:
        with self._lock:
            self._current = None
            self._lock.notify_all()

    def _run(self) -> None:
        delay = 0.0
        attempt = 0
        while not self._stop.is_set():
            if delay:
                self._wake.wait(delay)
                self._wake.clear()
                if self._stop.is_set():
                    return
            target = self._take()
            if target is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            attempt += 1
            retry = self._copy(target, attempt)
            if retry is None:  # done (copied, or cannot ever be)
                delay, attempt = 0.0, 0
                self._done()
                continue
            with self._lock:  # back in the queue unless a newer one came meanwhile
                if self._pending is None:
                    self._pending = target
                self._current = None
                self._lock.notify_all()
            delay = retry

    def _copy(self, target: Target, attempt: int) -> float | None:
        """Copy one checkpoint; None when done with it, else seconds before a retry."""
        try:
            uploaded = mirror.upload(self.backend, target.path)
        except (MirrorUnavailable, mirror.MirrorCopyBad, OSError) as exc:
            if isinstance(exc, FileNotFoundError) and not target.path.exists():
                return self._give_up(target, f"{target.path.name} left the directory", attempt)
            delay = min(float(self.options.mirror_retry_max), 2.0 ** (attempt - 1))
            self._failed(target, exc, attempt, delay)
            return delay
        except CheckpointError as exc:  # the local checkpoint cannot be mirrored at all
            return self._give_up(target, str(exc), attempt)
        except Exception as exc:  # noqa: BLE001 (a client library's own error: retry)
            delay = min(float(self.options.mirror_retry_max), 2.0 ** (attempt - 1))
            self._failed(target, exc, attempt, delay)
            return delay
        self.newest_mirrored = max(self.newest_mirrored or -1, target.step)
        self.last_error = None
        rate = uploaded.bytes / uploaded.seconds if uploaded.seconds > 0 else None
        self.report(
            MIRRORED,
            {
                "step": target.step,
                "files": list(uploaded.files),
                "bytes": uploaded.bytes,
                "seconds": round(uploaded.seconds, 6),
                "rate": rate,
                "attempts": attempt,
                "mirror": self.backend.url,
            },
        )
        self._prune()
        return None

    def _failed(self, target: Target, exc: BaseException, attempt: int, delay: float) -> None:
        reason = str(exc) or type(exc).__name__
        self.last_error = reason
        self.failures += 1
        log.warning(
            "mirror: copying step %d to %s failed (attempt %d, again in %.0f s): %s",
            target.step,
            self.backend.url,
            attempt,
            delay,
            reason,
        )
        self.report(
            MIRROR_FAILED,
            {
                "step": target.step,
                "reason": reason[:2000],
                "attempt": attempt,
                "retry_in": delay,
                "mirror": self.backend.url,
            },
        )

    def _give_up(self, target: Target, reason: str, attempt: int) -> None:
        self.last_error = reason
        self.failures += 1
        log.warning("mirror: step %d is not copied: %s", target.step, reason)
        self.report(
            MIRROR_FAILED,
            {
                "step": target.step,
                "reason": reason[:2000],
                "attempt": attempt,
                "retry_in": None,
                "mirror": self.backend.url,
            },
        )
        return None

    def _prune(self) -> None:
        """The mirror's retention, after a copy; a failure is reported, nothing else."""
        o = self.options
        if o.mirror_keep_last is None and o.mirror_keep_every is None and not o.mirror_thinning:
            return
        try:
            deleted = prune_mirror(self.backend, o, time.time())
        except (MirrorUnavailable, OSError) as exc:
            log.warning("mirror: retention failed, nothing more deleted: %s", exc)
            return
        if deleted:
            self.report(MIRROR_PRUNED, {"deleted": deleted, "mirror": self.backend.url})


def mirror_candidates(listing: list[mirror.Mirrored]) -> list[Candidate]:
    """The mirror's checkpoints as retention candidates (not good: bad)."""
    return [Candidate(m.step, m.time, not m.good, tuple(s for _, s, _ in m.chain)) for m in listing]


def prune_mirror(
    backend: MirrorBackend, options: MirrorOptions, now: float, dry_run: bool = False
) -> list[str]:
    """Delete the mirrored checkpoints the mirror's rules do not keep (newest step
    first, so a delta goes before its base); the names (to be) deleted."""
    listing = mirror.list_mirrored(backend)
    keep = mirror_retention.steps_to_keep(
        mirror_candidates(listing),
        now,
        options.mirror_keep_last,
        options.mirror_keep_every,
        options.mirror_thinning,
    )
    doomed = [m.name for m in listing if m.step not in keep]  # newest first
    if not dry_run:
        for name in doomed:
            mirror.delete_mirrored(backend, name)
    return doomed
