"""The background copy to the mirror: one thread of rank 0, off the ranks' critical path.

After a commit, the store's rank 0 hands the checkpoint to :class:`MirrorWorker`
(``committed``; :class:`~hpcckpt.store.store.CheckpointStore` owns the worker); the
thread uploads it (:func:`.mirror.index.upload`: verified, manifest last, then the
mirror's index), then applies the mirror's retention, decided on that index. One
writer per checkpoint: the checkpoint is one file, already durable in the directory, so
one sequential stream reads it once and no rank waits.
Only the newest checkpoint waiting counts: a newer one replaces an older one not yet
started. A mirror that refuses, is slow or full costs retries with a backoff (about 1 s,
doubling, up to ``mirror_retry_max``, with jitter: :func:`retry_delay`) that nothing but
:meth:`MirrorWorker.close` cuts short, never a stall: the ranks go on, and the directory
keeps what is on its way (``protected``). Failures of one cause are one ``mirror_failed``
report and log line, then a summary with their ``count`` when the count doubles or every
:data:`SUMMARY_EVERY` seconds, and one line when the mirror is back (:class:`Streak`).
At a stop or ``finish()`` the store waits a bounded time for the newest checkpoint
(:meth:`MirrorWorker.wait_newest`, a :class:`MirrorWait`). An error of the worker's own
is reported and retried like a failed copy: the thread ends only at ``close()``.

The copy steps aside while a checkpoint is written: a save holds the worker's
:class:`Gate` (:meth:`MirrorWorker.steps_aside`) from its start until its bytes are
durable or it failed, and the copy waits at the gate between its chunks (never inside a
request), so the save's writes and fsync do not share the disk and the cores with it.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror import index as mirror_index
from hpcckpt.store.mirror import retention as mirror_retention
from hpcckpt.store.mirror.backend import MirrorBackend, MirrorUnavailable
from hpcckpt.store.mirror.options import MirrorOptions
from hpcckpt.store.retention import Candidate, checkpoint_chain

log = logging.getLogger("hpcckpt.store")

#: The report callback: (event name, fields); the Checkpointer writes them as events.
Report = Callable[[str, dict[str, Any]], None]
MIRRORED, MIRROR_FAILED, MIRROR_PRUNED = "mirrored", "mirror_failed", "mirror_pruned"

#: The longest time between two summaries of one run of failures of the same cause.
SUMMARY_EVERY = 300.0
#: 2 ** this many seconds is beyond any ``mirror_retry_max``; the exponent stops there.
_MAX_DOUBLINGS = 40
#: Seconds between two looks of a copy waiting at the gate at a background write's end.
POLL = 0.05


def retry_delay(failures: int, retry_max: float, rng: random.Random) -> float:
    """Seconds before the next try after ``failures`` failures in a row: 1 s doubling
    per failure, capped at ``retry_max``, then a random cut of up to half ("equal
    jitter", so that ranks of many jobs failing together do not retry in step)."""
    nominal = min(float(retry_max), 2.0 ** min(max(failures - 1, 0), _MAX_DOUBLINGS))
    return nominal * (0.5 + 0.5 * rng.random())


def _cause(exc: BaseException, reason: str) -> str:
    """What makes two failures "the same": the error's kind and its words, numbers
    aside (a step, a size, a request id)."""
    return f"{type(exc).__name__}: {re.sub(r'[0-9]+', '#', reason)}"


@dataclass
class Streak:
    """Failures in a row of one cause: when the first was (``since``, Unix time), how
    many so far, how many were reported and when the last report was."""

    cause: str
    since: float
    count: int = 0
    reported_count: int = 0
    reported_at: float = 0.0  # monotonic

    def due(self, now: float) -> bool:
        """Whether this failure is reported: the first, each doubling of the count, or
        :data:`SUMMARY_EVERY` seconds after the last report."""
        if self.reported_count == 0 or self.count >= 2 * self.reported_count:
            return True
        return now - self.reported_at >= SUMMARY_EVERY


class Gate:
    """What the copy waits at between its chunks while a save writes: held by any number
    of saves at once, open when none holds it. The copy's threads call :meth:`wait_open`;
    :attr:`paused` counts the seconds during which at least one of them waited."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holders = 0
        self._until: list[Callable[[], bool]] = []  # held until each says done (polled)
        self._waiting = 0  # copying threads waiting now
        self._since = 0.0  # monotonic: when the first of them began to wait
        self._paused = 0.0
        self._open_for_good = False

    def hold(self) -> None:
        with self._cond:
            self._holders += 1

    def release(self) -> None:
        with self._cond:
            self._holders = max(self._holders - 1, 0)
            if not self._holders:
                self._cond.notify_all()

    def hold_until(self, done: Callable[[], bool]) -> None:
        """Held until ``done()`` (never blocking) says so: a background write, asked
        every :data:`POLL` seconds by a copy waiting at the gate (no thread watches it)."""
        with self._cond:
            self._until.append(done)

    def _held(self) -> bool:
        self._until = [d for d in self._until if not d()]
        return bool(self._holders or self._until)

    @property
    def held(self) -> bool:
        with self._cond:
            return self._held()

    def wait_open(self) -> None:
        """Return once no save holds the gate (at once when none does)."""
        with self._cond:
            if self._open_for_good or not self._held():
                return
            if not self._waiting:
                self._since = time.monotonic()
            self._waiting += 1
            try:
                while not self._open_for_good and self._held():
                    self._cond.wait(POLL if self._until else None)
            finally:
                self._waiting -= 1
                if not self._waiting:
                    self._paused += time.monotonic() - self._since

    @property
    def paused(self) -> float:
        """Seconds the copy has waited at the gate so far (a wait under way included)."""
        with self._cond:
            now = time.monotonic() - self._since if self._waiting else 0.0
            return self._paused + now

    def open_for_good(self) -> None:
        """Never hold the copy again (the worker closes: a copy under way goes on to its end
        or its cut, whatever a save does)."""
        with self._cond:
            self._open_for_good = True
            self._cond.notify_all()


class Aside:
    """One save's hold of a :class:`Gate` (None: no mirror here, nothing held), released
    once, at the end of its ``with`` block or by :meth:`release`; :meth:`until` keeps
    the gate held past it while the save's background write goes on."""

    def __init__(self, gate: Gate | None) -> None:
        self._gate = gate
        self._lock = threading.Lock()
        if gate is not None:
            gate.hold()

    def __enter__(self) -> Aside:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def release(self) -> None:
        """Open the gate for this save (again: nothing)."""
        with self._lock:
            gate, self._gate = self._gate, None
        if gate is not None:
            gate.release()

    def until(self, done: Callable[[], bool]) -> None:
        """Keep the gate held, past this hold's release, until ``done()`` (never
        blocking) is true: a staged save's background write, durable or failed."""
        with self._lock:
            gate = self._gate
        if gate is not None:
            gate.hold_until(done)


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
        #: Failed tries, all causes together, since the worker began.
        self.failures = 0
        #: Tries of a copy (successful or not) since the worker began.
        self.tries = 0
        self._streak: Streak | None = None
        self._in_row = 0  # failed tries since the last copy that went through, any cause
        self._rng = random.Random()
        self._thread: threading.Thread | None = None
        #: Held by the saves while they write: the copy waits at it between its chunks.
        self.gate = Gate()

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

    def steps_aside(self) -> Aside:
        """The copy pauses between its chunks from now until the returned hold is
        released (``with worker.steps_aside(): ...``; see :class:`Aside`). A pause
        never fails a copy, and never outlasts the hold."""
        return Aside(self.gate)

    def busy(self) -> bool:
        with self._lock:
            return self._pending is not None or self._current is not None

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until nothing is queued or being copied;
        whether that happened. Waiting never hurries a retry: the backoff holds."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._pending is not None or self._current is not None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
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
        self.gate.open_for_good()
        self.join(5.0)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread (after :meth:`close`)."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout))

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
            if delay and self._stop.wait(delay):  # a backoff: only close() ends it early
                return
            delay = 0.0
            target = self._take()
            if target is None:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            attempt += 1
            self.tries += 1
            try:
                retry = self._copy(target, attempt)
            except Exception as exc:  # noqa: BLE001 (the worker's own error: never the thread's end)
                retry = self._own_error(target, exc, attempt)
            if retry is None:  # done (copied, or cannot ever be)
                attempt = 0
                self._done()
                continue
            with self._lock:  # back in the queue unless a newer one came meanwhile
                if self._pending is None:
                    self._pending = target
                self._current = None
                self._lock.notify_all()
            delay = retry

    def _own_error(self, target: Target, exc: Exception, attempt: int) -> float:
        """A bug or a report that raised, not the mirror: logged with its traceback once
        per cause, reported like a failed copy, retried after the backoff."""
        if self._streak is None or self._streak.cause != _cause(exc, str(exc)):
            log.exception("mirror: the copy of step %d hit an error of its own", target.step)
        delay = retry_delay(self._in_row + 1, self.options.mirror_retry_max, self._rng)
        try:
            self._failed(target, exc, attempt, delay)
        except Exception:  # noqa: BLE001 (the report itself fails: the log has it)
            log.exception("mirror: reporting a failed copy failed")
        return delay

    def _copy(self, target: Target, attempt: int) -> float | None:
        """Copy one checkpoint; None when done with it, else seconds before a retry."""
        paused0 = self.gate.paused
        try:
            copied = mirror_index.upload(self.backend, target.path, pause=self.gate.wait_open)
        except (MirrorUnavailable, mirror.MirrorCopyBad, OSError) as exc:
            if isinstance(exc, FileNotFoundError) and not target.path.exists():
                return self._give_up(target, f"{target.path.name} left the directory", attempt)
            return self._retry_later(target, exc, attempt)
        except CheckpointError as exc:  # the local checkpoint cannot be mirrored at all
            return self._give_up(target, str(exc), attempt)
        except Exception as exc:  # noqa: BLE001 (a client library's own error: retry)
            return self._retry_later(target, exc, attempt)
        uploaded = copied.uploaded
        paused = min(self.gate.paused - paused0, uploaded.seconds)
        self.newest_mirrored = max(self.newest_mirrored or -1, target.step)
        self.last_error = None
        self._recovered(target)
        moving = uploaded.seconds - paused  # the copy's own rate: its pauses left out
        rate = uploaded.bytes / moving if moving > 0 else None
        log.info(
            "mirror: step %d copied to %s and verified: %.1f MiB in %.1f s%s",
            target.step,
            self.backend.url,
            uploaded.bytes / 2**20,
            uploaded.seconds,
            ""
            if rate is None
            else f" ({rate / 1e6:.0f} MB/s"
            + (f", {paused:.1f} s paused for saves)" if paused >= 0.05 else ")"),
        )
        self.report(
            MIRRORED,
            {
                "step": target.step,
                "files": list(uploaded.files),
                "bytes": uploaded.bytes,
                "seconds": round(uploaded.seconds, 6),
                "paused": round(paused, 6),
                "rate": rate,
                "attempts": attempt,
                "mirror": self.backend.url,
            },
        )
        self._prune(copied.index)
        return None

    def _retry_later(self, target: Target, exc: BaseException, attempt: int) -> float:
        delay = retry_delay(self._in_row + 1, self.options.mirror_retry_max, self._rng)
        self._failed(target, exc, attempt, delay)
        return delay

    def _failed(self, target: Target, exc: BaseException, attempt: int, delay: float) -> None:
        """Count a failed try in its streak; log and report it when :meth:`Streak.due`."""
        reason = str(exc) or type(exc).__name__
        self.last_error = reason
        self.failures += 1
        self._in_row += 1
        cause, now = _cause(exc, reason), time.monotonic()
        streak = self._streak
        if streak is None or streak.cause != cause:
            streak = self._streak = Streak(cause, time.time())
        streak.count += 1
        if not streak.due(now):
            return
        streak.reported_count, streak.reported_at = streak.count, now
        if streak.count == 1:
            log.warning(
                "mirror: copying step %d to %s failed (again in %.3g s): %s",
                target.step,
                self.backend.url,
                delay,
                reason,
            )
        else:
            log.warning(
                "mirror: copying to %s failed %d times since %s (step %d, again in %.3g s): %s",
                self.backend.url,
                streak.count,
                _clock(streak.since),
                target.step,
                delay,
                reason,
            )
        self.report(
            MIRROR_FAILED,
            {
                "step": target.step,
                "reason": reason[:2000],
                "tries": attempt,
                "retry_in": round(delay, 3),
                "count": streak.count,
                "since": streak.since,
                "mirror": self.backend.url,
            },
        )

    def _recovered(self, target: Target) -> None:
        """A copy went through: one line when failures came before it."""
        streak, self._streak = self._streak, None
        self._in_row = 0
        if streak is not None and streak.count:
            log.info(
                "mirror: %s is back: step %d copied after %d failed tries since %s",
                self.backend.url,
                target.step,
                streak.count,
                _clock(streak.since),
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
                "tries": attempt,
                "retry_in": None,
                "count": 1,
                "since": time.time(),
                "mirror": self.backend.url,
            },
        )
        return None

    def _prune(self, index: mirror_index.Index) -> None:
        """The mirror's retention, after a copy, decided on the index that copy left; a
        failure is reported, nothing else."""
        o = self.options
        if o.mirror_keep_last is None and o.mirror_keep_every is None and not o.mirror_thinning:
            return
        try:
            deleted = prune_mirror(self.backend, o, time.time(), index=index)
        except (MirrorUnavailable, OSError) as exc:
            log.warning("mirror: retention failed, nothing more deleted: %s", exc)
            return
        if deleted:
            self.report(MIRROR_PRUNED, {"deleted": deleted, "mirror": self.backend.url})


def _clock(unix: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(unix))


def mirror_candidates(listing: list[mirror.Mirrored]) -> list[Candidate]:
    """The mirror's checkpoints as retention candidates (not good: bad)."""
    return [Candidate(m.step, m.time, not m.good, tuple(s for _, s, _ in m.chain)) for m in listing]


def prune_mirror(
    backend: MirrorBackend,
    options: MirrorOptions,
    now: float,
    dry_run: bool = False,
    *,
    index: mirror_index.Index | None = None,
) -> list[str]:
    """Delete the mirrored checkpoints the mirror's rules do not keep (newest step
    first, so a delta goes before its base), as the mirror's ``index`` lists them (by
    default :func:`.mirror.index.load`: no manifest fetched), then drop them from the
    index; the names (to be) deleted."""
    if index is None:
        index = mirror_index.load(backend)
    listing = index.listing()
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
        if doomed:
            mirror_index.commit(backend, index, remove=doomed)
    return doomed
