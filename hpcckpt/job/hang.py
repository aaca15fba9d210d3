"""Hang detection: a step whose ranks went silent is treated as a crash.

A rank stuck in a collective (a peer died without MPI noticing, a dead mount, a
deadlock) burns the allocation until the time limit and then loses everything since the
last checkpoint. With ``--hang-timeout DURATION`` the wrapper watches the per-rank
heartbeats of the current attempt (``DIR/heartbeat/rank-<r>.json``, written by the
Checkpointer from ``due()`` at most every 5 s, see :mod:`hpcckpt.rundir.heartbeat`):

- a rank whose newest heartbeat is older than the timeout is **silent**; while it is in
  the I/O phases ``save``/``restore`` the allowance is ``--hang-save-timeout`` instead
  (default: :func:`default_save_timeout`, four times the timeout or three times the
  slowest measured checkpoint plus the timeout, whichever is longer);
- a rank that never wrote a heartbeat in this attempt is silent once the I/O allowance
  has passed since the step started: its start-up is the interpreter's imports, the
  launcher's and MPI's start and the first restore, all of them I/O (the expected ranks
  are the ``nranks`` of the Checkpointer's ``start`` event or ``SLURM_NTASKS``; unknown:
  only "no heartbeat at all" counts);
- with ``--progress-file GLOB`` (applications without the API) the step is one unit:
  a change of any matching file's size or modification time is its heartbeat.

When one rank is silent the wrapper logs one line naming the ranks (and, when their
heartbeats differ, where each rank is: "rank 0 in save (step 5), rank 1 in finish"),
appends an event ``hang`` and takes the whole step down
(:func:`hpcckpt.job.step.take_down`); the attempt then ends like a crash: requeue or
chain within the restart budget if it made progress.

:func:`decide` is pure (no I/O): the unit tests drive it with made-up heartbeats.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hpcckpt.job.outcome import Outcome, StepResult
from hpcckpt.rundir.events import checkpoint_costs, read_events
from hpcckpt.rundir.heartbeat import (
    DEFAULT_PERIOD,
    Heartbeat,
    clear_heartbeats,
    places,
    read_heartbeats,
    where,
)

#: Phases of a heartbeat that get the longer (I/O) allowance.
IO_PHASES = ("save", "restore")
#: --hang-save-timeout default: this many times --hang-timeout ...
SAVE_FACTOR = 4.0
#: ... or this many times the slowest measured checkpoint plus --hang-timeout.
COST_FACTOR = 3.0
#: Seconds between two looks at the heartbeats.
CHECK_EVERY = 1.0


@dataclass(frozen=True)
class Silent:
    """One rank (or, with progress files, the whole step: rank None) that went silent."""

    rank: int | None
    since: float  # wall-clock time of its last sign of life (the step's start if none)
    seconds: float  # how long it has been silent
    step: int | None = None  # its last reported step
    phase: str | None = None  # its last phase; None: never heard of
    limit: float = 0.0  # the allowance it exceeded

    def describe(self) -> str:
        who = "the step" if self.rank is None else f"rank {self.rank}"
        at = time.strftime("%H:%M:%S", time.localtime(self.since))
        if self.phase is None:
            what = "no heartbeat since the step started" if self.rank is not None else ""
            what = what or "no progress-file change since the step started"
        elif self.rank is None:
            what = f"last progress-file change at {at}"
        else:
            step = f"step {self.step}" if self.step is not None else "before its first step"
            what = f"last heartbeat at {at}, {step}, phase {self.phase}"
        return f"{who} silent for {self.seconds:.0f} s ({what}; limit {self.limit:g} s)"


@dataclass(frozen=True)
class Verdict:
    hung: bool
    silent: list[Silent] = field(default_factory=list)
    heard: int = 0  # ranks with a heartbeat in this attempt
    #: Each expected rank's heartbeat in this attempt (None: none yet).
    beats: dict[int, Heartbeat | None] = field(default_factory=dict)

    def message(self) -> str:
        shown = "; ".join(s.describe() for s in self.silent[:8])
        more = f"; and {len(self.silent) - 8} more" if len(self.silent) > 8 else ""
        apart = ""
        if len({where(b) for b in self.beats.values()}) > 1:  # say where each rank is
            apart = f"; where the ranks are: {places(self.beats)}"
        return f"hang: {shown}{more}{apart}"

    def event_fields(self) -> dict[str, Any]:
        return {
            "ranks": [s.rank for s in self.silent],
            "last_steps": [s.step for s in self.silent],
            "phases": [s.phase for s in self.silent],
            "seconds_silent": [round(s.seconds, 1) for s in self.silent],
            "since": [round(s.since, 3) for s in self.silent],
            "limits": [s.limit for s in self.silent],
            "heard": self.heard,
            "places": {str(r): where(b) for r, b in sorted(self.beats.items())},
        }


def default_save_timeout(timeout: float, costs: Iterable[float] = ()) -> float:
    """The allowance of a rank in a save/restore when ``--hang-save-timeout`` is not given."""
    slowest = max((c for c in costs if c and c > 0), default=0.0)
    return max(SAVE_FACTOR * timeout, COST_FACTOR * slowest + timeout)


def check_timeouts(timeout: float, save_timeout: float | None) -> None:
    """ValueError when the options cannot work with heartbeats every 5 s."""
    if timeout <= DEFAULT_PERIOD:
        raise ValueError(
            f"--hang-timeout {timeout:g} s is not longer than the heartbeat period "
            f"({DEFAULT_PERIOD:g} s): every rank would look silent; use at least "
            f"{2 * DEFAULT_PERIOD:g} s plus the longest step of the application"
        )
    if save_timeout is not None and save_timeout < timeout:
        raise ValueError("--hang-save-timeout must be at least --hang-timeout")


def decide(
    beats: Mapping[int, Heartbeat],
    *,
    now: float,
    started: float,
    timeout: float,
    save_timeout: float,
    nranks: int | None = None,
) -> Verdict:
    """Is the step hung? Pure: the heartbeats of this attempt, the clock, the allowances.

    ``started`` is the wall-clock time the step was started; ``nranks`` the number of
    ranks expected (None: unknown). Heartbeats older than ``started`` (a stale file from
    an earlier attempt) count as missing.
    """
    fresh = {r: b for r, b in beats.items() if b.time >= started - 1.0}
    silent: list[Silent] = []
    for rank, beat in sorted(fresh.items()):
        limit = save_timeout if beat.phase in IO_PHASES else timeout
        age = now - beat.time
        if age > limit:
            silent.append(Silent(rank, beat.time, age, beat.step, beat.phase, limit))
    waited = now - started
    if waited > save_timeout:  # start-up: imports, the launch, MPI's start, I/O
        expected = range(nranks) if nranks else ([] if fresh else [0])
        for rank in expected:
            if rank not in fresh:
                silent.append(Silent(rank, started, waited, None, None, save_timeout))
    silent.sort(key=lambda s: (s.since, s.rank if s.rank is not None else -1))
    ranks = set(fresh) | set(range(nranks or 0))
    return Verdict(bool(silent), silent, len(fresh), {r: fresh.get(r) for r in ranks})


def decide_progress(
    last_change: float, *, now: float, started: float, timeout: float, changed: bool
) -> Verdict:
    """Progress-file mode: silent when no watched file changed for ``timeout`` seconds."""
    since = max(last_change, started)
    age = now - since
    if age <= timeout:
        return Verdict(False, [], 1 if changed else 0)
    return Verdict(True, [Silent(None, since, age, None, "progress" if changed else None, timeout)])


class ProgressFiles:
    """The step's log (or any files) as its heartbeat: size or mtime changes count."""

    def __init__(self, patterns: Iterable[str], cwd: str | os.PathLike[str] | None = None) -> None:
        self.patterns = list(patterns)
        self.cwd = Path(cwd) if cwd is not None else Path.cwd()
        self._seen: dict[str, tuple[int, int]] = self._look()
        self.last_change = time.time()
        self.changed = False

    def _look(self) -> dict[str, tuple[int, int]]:
        found: dict[str, tuple[int, int]] = {}
        for pattern in self.patterns:
            full = pattern if os.path.isabs(pattern) else str(self.cwd / pattern)
            for name in glob.glob(full):
                try:
                    st = os.stat(name)
                except OSError:
                    continue
                found[name] = (st.st_size, st.st_mtime_ns)
        return found

    def poll(self, now: float | None = None) -> float:
        """Look again; returns the wall-clock time of the last change seen."""
        now = time.time() if now is None else now
        seen = self._look()
        if seen != self._seen and any(self._seen.get(k) != v for k, v in seen.items()):
            self.last_change = now
            self.changed = True
        self._seen = seen
        return self.last_change


class HangWatch:
    """The wrapper's watch over one attempt: ``check()`` often, act on a hung verdict."""

    def __init__(
        self,
        ckpt_dir: str | os.PathLike[str],
        timeout: float,
        save_timeout: float | None = None,
        progress_files: Iterable[str] = (),
        nranks: int | None = None,
        events: Iterable[Mapping[str, Any]] = (),
    ) -> None:
        check_timeouts(timeout, save_timeout)
        self.ckpt_dir = Path(ckpt_dir)
        self.timeout = timeout
        history = list(events)
        self.save_timeout = (
            save_timeout
            if save_timeout is not None
            else default_save_timeout(timeout, checkpoint_costs(history))
        )
        self.patterns = list(progress_files)
        self.nranks = nranks
        self.started = time.time()
        self.progress: ProgressFiles | None = None
        self.verdict: Verdict | None = None  # set once the step was found hung
        self._next = 0.0

    def start(self) -> None:
        """A new attempt: forget old heartbeats, restart the clock. Call before the step."""
        clear_heartbeats(self.ckpt_dir)
        self.started = time.time()
        self.verdict = None
        self._next = 0.0
        if self.patterns:
            self.progress = ProgressFiles(self.patterns)

    def describe(self) -> str:
        what = f"progress files {', '.join(self.patterns)}" if self.patterns else "rank heartbeats"
        return (
            f"hang watch on {what}: silent for more than {self.timeout:g} s "
            f"({self.save_timeout:g} s during a checkpoint) ends the step"
        )

    def _expected(self) -> int | None:
        if self.nranks:
            return self.nranks
        try:
            for ev in read_events(self.ckpt_dir):
                if ev.get("event") == "start" and ev.get("source") == "checkpointer":
                    if float(ev.get("time", 0)) >= self.started - 1.0 and ev.get("nranks"):
                        return int(ev["nranks"])
        except (OSError, ValueError, TypeError):
            return None
        return None

    def check(self, now: float | None = None, force: bool = False) -> Verdict | None:
        """A hung verdict (once), or None; looks at most every CHECK_EVERY seconds."""
        mono = time.monotonic()
        if self.verdict is not None or (not force and mono < self._next):
            return None
        self._next = mono + CHECK_EVERY
        now = time.time() if now is None else now
        if self.progress is not None:
            last = self.progress.poll(now)
            verdict = decide_progress(
                last,
                now=now,
                started=self.started,
                timeout=self.timeout,
                changed=self.progress.changed,
            )
        else:
            beats = read_heartbeats(self.ckpt_dir)
            verdict = decide(
                beats,
                now=now,
                started=self.started,
                timeout=self.timeout,
                save_timeout=self.save_timeout,
                nranks=self._expected(),
            )
        if verdict.hung:
            self.verdict = verdict
            return verdict
        return None


# -- the wrapper's side ---------------------------------------------------------------------
class HangConfigError(ValueError):
    """The hang options cannot work together (a usage error)."""


def start_watch(
    *,
    ckpt_dir: str | os.PathLike[str],
    timeout: float | None,
    save_timeout: float | None = None,
    progress_files: Iterable[str] = (),
    app_mode: bool = False,
    nranks: int | None = None,
) -> HangWatch | None:
    """The watch for this attempt, started (None without ``--hang-timeout``); call it
    before the step starts. HangConfigError when the options cannot work."""
    patterns = list(progress_files or [])
    if timeout is None:
        if patterns or save_timeout is not None:
            raise HangConfigError("--progress-file and --hang-save-timeout need --hang-timeout")
        return None
    if app_mode and not patterns:
        raise HangConfigError(
            "--hang-timeout with --app-signal needs --progress-file GLOB: an application "
            "without the Python API writes no heartbeats"
        )
    try:
        history = list(read_events(ckpt_dir))
    except OSError:
        history = []
    try:
        watch = HangWatch(
            ckpt_dir,
            float(timeout),
            None if save_timeout is None else float(save_timeout),
            patterns,
            nranks=nranks,
            events=history,
        )
    except ValueError as exc:
        raise HangConfigError(str(exc)) from None
    watch.start()
    return watch


def adjust(watch: HangWatch | None, result: StepResult) -> StepResult:
    """A crashed result of a step the watch took down says so in its reason."""
    if watch is None or watch.verdict is None or result.outcome is not Outcome.CRASHED:
        return result
    return replace(
        result, reason=f"{watch.verdict.message()}; killed by the wrapper; {result.reason}"
    )
