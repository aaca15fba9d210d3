"""Retention: which checkpoints to keep, as a pure function, and the deletes that follow.

Rules (all optional; a checkpoint is kept when any rule keeps it):

- ``keep_last=N``: the N newest good checkpoints;
- ``keep_every=K``: one checkpoint per window of K steps (``step // K``): the oldest
  good one in each window, so a kept checkpoint stays kept as newer ones arrive;
- ``keep_every_seconds=T``: the same over windows of T seconds of checkpoint time.

The newest good checkpoint is always kept, whatever the rules, and so are the
``protect`` steps (with a mirror: the checkpoint on its way there, not yet verified on
it, so the only copy is never deleted). Checkpoints marked
bad are kept for inspection unless ``delete_bad`` is set. With no rule at all,
nothing is deleted. "Good" here means committed and not marked bad: pruning does not
re-read the files (restore and ``hpcckpt verify`` do).

Incremental checkpoints: one is good only when every file of its chain (its base and
the deltas before it) is present and good, and whatever a kept checkpoint is built on
is kept with it, so pruning never breaks a retained checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import h5py

from hpcckpt.store.file import layout
from hpcckpt.store.io.faults import fault_point

log = logging.getLogger("hpcckpt.store")


@dataclass(frozen=True)
class Candidate:
    """What retention needs to know about one committed checkpoint."""

    step: int
    time: float  # seconds since the epoch when it was written
    bad: bool = False
    #: Steps of the base and deltas an incremental checkpoint is built on (its chain).
    needs: tuple[int, ...] = ()


def check_rules(
    keep_last: int | None, keep_every: int | None, keep_every_seconds: float | None
) -> None:
    """Raise ValueError for a rule that makes no sense (zero or negative)."""
    for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
        if value is not None and (int(value) != value or value < 1):
            raise ValueError(f"{name} must be a positive integer, not {value!r}")
    if keep_every_seconds is not None and not keep_every_seconds > 0:
        raise ValueError(f"keep_every_seconds must be positive, not {keep_every_seconds!r}")


def steps_to_keep(
    candidates: Iterable[Candidate],
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_every_seconds: float | None = None,
    delete_bad: bool = False,
    protect: Iterable[int] = (),
) -> set[int]:
    """The steps to keep among ``candidates`` under the rules above (``protect``: kept
    whatever the rules, with their chains)."""
    check_rules(keep_last, keep_every, keep_every_seconds)
    all_ = sorted(candidates, key=lambda c: c.step)
    if keep_last is None and keep_every is None and keep_every_seconds is None:
        return {c.step for c in all_}
    good, keep = newest_good(all_, keep_last, delete_bad)
    for width, key in ((keep_every, "step"), (keep_every_seconds, "time")):
        if width is not None:
            keep |= one_per_window(good, width, key)
    present = {c.step for c in all_}
    keep.update(s for s in protect if s in present)
    return with_chains(all_, keep)


def newest_good(
    all_: list[Candidate], keep_last: int | None, delete_bad: bool
) -> tuple[list[Candidate], set[int]]:
    """The good checkpoints of ``all_`` (sorted by step), oldest first, and the steps kept
    whatever the other rules: the newest good one, the ``keep_last`` newest good ones and,
    unless ``delete_bad``, the bad ones. An incremental checkpoint is good only when every
    file of its chain is."""
    sound: set[int] = set()
    for c in all_:  # chains point to older steps
        if not c.bad and all(n in sound for n in c.needs):
            sound.add(c.step)
    good = [c for c in all_ if c.step in sound]
    keep = {c.step for c in all_ if c.step not in sound and not delete_bad}
    if good:
        keep.add(good[-1].step)
    if keep_last is not None:
        keep.update(c.step for c in good[-int(keep_last) :])
    return good, keep


def one_per_window(good: Iterable[Candidate], width: float, key: str) -> set[int]:
    """The oldest checkpoint of each window of ``width`` (in steps or seconds: ``key``)."""
    seen: set[int] = set()
    keep: set[int] = set()
    for c in good:  # oldest first: the first one seen in a window is kept
        window = math.floor(getattr(c, key) / width)
        if window not in seen:
            seen.add(window)
            keep.add(c.step)
    return keep


def with_chains(all_: Iterable[Candidate], keep: set[int]) -> set[int]:
    """``keep`` and whatever a kept checkpoint is built on."""
    present = {c.step for c in all_}
    for c in sorted(all_, key=lambda c: c.step, reverse=True):  # newest first: chains close
        if c.step in keep:
            keep.update(n for n in c.needs if n in present)
    return keep


def checkpoint_time(path: Path) -> float:
    """When a checkpoint was written: its ``meta`` time attribute, else the file's mtime."""
    try:
        with h5py.File(path, "r") as f:
            return float(f["meta"].attrs["time"])
    except (OSError, KeyError, ValueError, TypeError):
        return os.stat(path).st_mtime


def checkpoint_chain(path: Path) -> tuple[str | None, list[tuple[str, int, str]]]:
    """(uid, chain) of a checkpoint: its own uid and the (name, step, uid) of the files an
    incremental checkpoint is built on; (None, []) for a full one of format version 1."""
    try:
        with h5py.File(path, "r") as f:
            attrs = f["meta"].attrs
            uid = attrs.get("uid")
            raw = attrs.get("chain")
            uid = uid.decode() if isinstance(uid, bytes) else uid
            raw = raw.decode() if isinstance(raw, bytes) else raw
            chain = [(str(n), int(s), str(u)) for n, s, u in json.loads(raw)] if raw else []
            return (None if uid is None else str(uid)), chain
    except (OSError, KeyError, ValueError, TypeError):
        return None, []


def candidates(directory: str | os.PathLike[str], need_time: bool = True) -> list[Candidate]:
    """The committed checkpoints of ``directory`` as retention candidates.

    An incremental checkpoint whose chain names a file that is now another checkpoint
    of that step (another uid) counts as bad: it cannot be restored.
    """
    entries = layout.scan(directory)
    uids, chains = {}, {}
    for e in entries:
        uids[e.step], chains[e.step] = checkpoint_chain(e.path)
    out = []
    for e in entries:
        t = checkpoint_time(e.path) if need_time else 0.0
        chain = chains[e.step]
        replaced = any(s in uids and uids[s] != u for _, s, u in chain)
        needs = tuple(s for _, s, _ in chain)
        out.append(Candidate(e.step, t, not e.good_candidate or replaced, needs))
    return out


def prune_directory(
    directory: str | os.PathLike[str],
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_every_seconds: float | None = None,
    delete_bad: bool = False,
    dry_run: bool = False,
    protect: Iterable[int] = (),
) -> list[Path]:
    """Delete the checkpoints the rules do not keep (one process); the paths (to be) deleted.

    A deleted checkpoint's ``.bad`` sidecar goes with it. Never touches ``.partial``
    files (the next save removes those) or anything that is not a checkpoint.
    """
    check_rules(keep_last, keep_every, keep_every_seconds)
    if keep_last is None and keep_every is None and keep_every_seconds is None:
        return []  # no rule keeps all: no file need be opened to know it
    cands = candidates(directory, need_time=keep_every_seconds is not None)
    keep = steps_to_keep(cands, keep_last, keep_every, keep_every_seconds, delete_bad, protect)
    doomed = [Path(directory) / layout.checkpoint_name(c.step) for c in cands if c.step not in keep]
    if not dry_run:
        for path in sorted(doomed, reverse=True):  # deltas before the files they are built on
            log.info("retention: deleting %s", path.name)
            path.unlink(missing_ok=True)
            fault_point("prune.deleting")  # tests: die between two deletions
            path.with_name(path.name + layout.BAD).unlink(missing_ok=True)
    return sorted(doomed)


class BackgroundPrune:
    """One process's prunes run in a thread, one at a time, off the caller's path: a save
    returns after its commit, not after the deletes that follow it (unlinking a large
    file takes a good part of a second). :meth:`wait` is called before anything that
    reads or writes the directory's checkpoints (a save, a restore, a listing, another
    prune), so they see the directory as a synchronous prune would have left it."""

    def __init__(self, name: str = "hpcckpt-prune") -> None:
        self.name = name
        self._thread: threading.Thread | None = None

    def start(self, prune: Callable[[], object], what: str) -> None:
        """Wait for the previous prune, then run ``prune()`` in a thread; an OSError there
        is logged as a warning naming ``what`` (the checkpoints it had not deleted stay)."""
        self.wait()

        def run() -> None:
            try:
                prune()
            except OSError as exc:
                log.warning("retention of %s failed, the rest kept: %s", what, exc)

        # Not a daemon: an exit waits for the deletes under way (each is safe to cut,
        # but a prune half done at exit is one more thing alive when the runtime ends).
        self._thread = threading.Thread(target=run, name=self.name, daemon=False)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether a prune is still deleting."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Return once the prune started last (if any) has ended."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()


@dataclass(frozen=True)
class RetentionOptions:
    """Which committed checkpoints stay (docs/format.md, "Retention"): the ``keep_last``
    newest good ones (None: all), plus one per ``keep_every`` steps and one per
    ``keep_every_seconds``; whatever a kept checkpoint is built on stays too."""

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_every_seconds: float | None = None

    def __post_init__(self) -> None:
        check_rules(self.keep_last, self.keep_every, self.keep_every_seconds)
