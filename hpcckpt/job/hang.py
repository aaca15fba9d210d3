"""Hang detection: a step whose ranks went silent is treated as a crash.

A rank stuck in a collective (a peer died without MPI noticing, a dead mount, a
deadlock) burns the allocation until the time limit and then loses everything since the
last checkpoint. With ``--hang-timeout DURATION`` the wrapper watches the per-rank
heartbeats of the current attempt (``DIR/heartbeat/rank-<r>.json``, written by the
Checkpointer from ``due()`` at most every 5 s, see :mod:`hpcckpt.job.heartbeat`):

- a rank whose newest heartbeat is older than the timeout is **silent**; while it is in
  the I/O phases ``save``/``restore`` the allowance is ``--hang-save-timeout`` instead
  (default: :func:`default_save_timeout`, four times the timeout or three times the
  slowest measured checkpoint plus the timeout, whichever is longer);
- a rank that never wrote a heartbeat in this attempt is silent once the timeout has
  passed since the step started (the expected ranks are the ``nranks`` of the
  Checkpointer's ``start`` event or ``SLURM_NTASKS``; unknown: only "no heartbeat at
  all" counts);
- with ``--progress-file GLOB`` (applications without the API) the step is one unit:
  a change of any matching file's size or modification time is its heartbeat.

When one rank is silent the wrapper logs one line naming the ranks, appends an event
``hang`` and takes the whole step down (:func:`kill_step`); the attempt then ends like a
crash: requeue or chain within the restart budget if it made progress.

:func:`decide` is pure (no I/O): the unit tests drive it with made-up heartbeats.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcckpt.job.heartbeat import DEFAULT_PERIOD, Heartbeat, clear_heartbeats, read_heartbeats

#: Phases of a heartbeat that get the longer (I/O) allowance.
IO_PHASES = ("save", "restore")
#: --hang-save-timeout default: this many times --hang-timeout ...
SAVE_FACTOR = 4.0
#: ... or this many times the slowest measured checkpoint plus --hang-timeout.
COST_FACTOR = 3.0
#: Seconds between two looks at the heartbeats.
CHECK_EVERY = 1.0
#: Grace between the launcher's SIGTERM and the SIGKILLs.
KILL_GRACE = 5.0


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

    def message(self) -> str:
        shown = "; ".join(s.describe() for s in self.silent[:8])
        more = f"; and {len(self.silent) - 8} more" if len(self.silent) > 8 else ""
        return f"hang: {shown}{more}"

    def event_fields(self) -> dict[str, Any]:
        return {
            "ranks": [s.rank for s in self.silent],
            "last_steps": [s.step for s in self.silent],
            "phases": [s.phase for s in self.silent],
            "seconds_silent": [round(s.seconds, 1) for s in self.silent],
            "since": [round(s.since, 3) for s in self.silent],
            "limits": [s.limit for s in self.silent],
            "heard": self.heard,
        }


def default_save_timeout(timeout: float, costs: Iterable[float] = ()) -> float:
    """The allowance of a rank in a save/restore when ``--hang-save-timeout`` is not given."""
    slowest = max((c for c in costs if c and c > 0), default=0.0)
    return max(SAVE_FACTOR * timeout, COST_FACTOR * slowest + timeout)


def measured_costs(events: Iterable[Mapping[str, Any]]) -> list[float]:
    """The seconds of every ``checkpoint`` (and ``restart_set``) event of the log."""
    out = []
    for ev in events:
        if ev.get("event") in ("checkpoint", "restart_set"):
            value = ev.get("seconds")
            if isinstance(value, (int, float)) and value > 0:
                out.append(float(value))
    return out


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
    if waited > timeout:
        expected = range(nranks) if nranks else ([] if fresh else [0])
        for rank in expected:
            if rank not in fresh:
                silent.append(Silent(rank, started, waited, None, None, timeout))
    silent.sort(key=lambda s: (s.since, s.rank if s.rank is not None else -1))
    return Verdict(bool(silent), silent, len(fresh))


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
            else default_save_timeout(timeout, measured_costs(history))
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
        from hpcckpt.job import events as job_events

        try:
            for ev in job_events.read_events(self.ckpt_dir):
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


# -- taking a hung step down -----------------------------------------------------------------
def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time) of a process, None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> dict[int, int]:
    """{pid: start time} of every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        info = _stat(int(entry))
        if info is None:
            continue
        children.setdefault(info[0], []).append(int(entry))
        starts[int(entry)] = info[1]
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = starts[child]
                todo.append(child)
    return found


def alive(processes: Mapping[int, int]) -> dict[int, int]:
    """Those of ``{pid: start time}`` still running (same pid, same start time)."""
    out = {}
    for pid, start in processes.items():
        info = _stat(pid)
        if info is not None and info[1] == start and not _zombie(pid):
            out[pid] = start
    return out


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def slurm_steps(job: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """The job's running steps (``JOB.N``; not ``batch``/``extern``), via squeue."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-s", "-j", job, "-o", "%i"],
            capture_output=True,
            text=True,
            timeout=20,
            env=None if environ is None else dict(environ),
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    steps = []
    for line in out.split():
        _, _, step = line.partition(".")
        if step.isdigit():
            steps.append(line)
    return steps


def kill_step(
    child: subprocess.Popen[Any],
    *,
    grace: float = KILL_GRACE,
    log: Callable[[str], None] = lambda _m: None,
    slurm_job: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Take a hung step down, all ranks, no orphans; returns what it took (for the event).

    1. remember every process below the launcher (mpirun's ranks; srun's are not ours);
    2. SIGTERM the launcher: srun then SIGKILLs every task of its step at once, mpirun
       sends its ranks SIGTERM and SIGKILL a second later;
    3. after ``grace`` seconds: SIGKILL the launcher if still there and, inside a Slurm
       job, ``scancel --signal=KILL JOB.STEP`` every running step of the job (a step
       outlives a killed srun);
    4. SIGKILL every remembered process still alive (ranks orphaned by a dead mpirun).
    """
    taken: dict[str, Any] = {"launcher_signal": "TERM", "killed_launcher": False}
    below = descendants(child.pid)
    try:
        os.kill(child.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        child.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        log(f"the step (pid {child.pid}) is still there {grace:g} s after SIGTERM: SIGKILL")
        below.update(descendants(child.pid))
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        taken["killed_launcher"] = True
        if slurm_job:
            steps = slurm_steps(slurm_job, environ)
            for step in steps:
                subprocess.run(
                    ["scancel", "--signal=KILL", step],
                    capture_output=True,
                    timeout=20,
                    env=None if environ is None else dict(environ),
                )
            taken["scancelled"] = steps
        child.wait()
    left = alive(below)
    deadline = time.monotonic() + 2.0
    while left and time.monotonic() < deadline:  # the launcher's own clean-up, briefly
        time.sleep(0.1)
        left = alive(left)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if left:
        log(f"SIGKILLed {len(left)} leftover process(es) of the step: {sorted(left)}")
        deadline = time.monotonic() + 5.0
        while alive(left) and time.monotonic() < deadline:
            time.sleep(0.05)
    taken["leftovers_killed"] = sorted(left)
    return taken


# -- the wrapper's hooks (hpcckpt/job/wrapper.py calls these) --------------------------------
def start_watch(wrapper: Any) -> HangWatch | None:
    """Set up the watch for this attempt (None without --hang-timeout); before the step."""
    from hpcckpt.job import events as job_events
    from hpcckpt.job.wrapper import WrapperError

    cfg = wrapper.config
    timeout = getattr(cfg, "hang_timeout", None)
    patterns = list(getattr(cfg, "progress_files", None) or [])
    save_timeout = getattr(cfg, "hang_save_timeout", None)
    if timeout is None:
        if patterns or save_timeout is not None:
            raise WrapperError("--progress-file and --hang-save-timeout need --hang-timeout")
        return None
    if cfg.app_mode and not patterns:
        raise WrapperError(
            "--hang-timeout with --app-signal needs --progress-file GLOB: an application "
            "without the Python API writes no heartbeats"
        )
    try:
        history = list(job_events.read_events(cfg.ckpt_dir))
    except OSError:
        history = []
    try:
        watch = HangWatch(
            cfg.ckpt_dir,
            float(timeout),
            None if save_timeout is None else float(save_timeout),
            patterns,
            nranks=wrapper.slurm_env.ntasks or None,
            events=history,
        )
    except ValueError as exc:
        raise WrapperError(str(exc)) from None
    watch.start()
    wrapper.log(watch.describe())
    return watch


def tick(wrapper: Any) -> None:
    """One look from the wrapper's main loop; takes the step down when it is hung."""
    watch: HangWatch | None = getattr(wrapper, "hang", None)
    child = wrapper.child
    if watch is None or child is None or child.poll() is not None:
        return
    verdict = watch.check()
    if verdict is None:
        return
    wrapper.log(f"{verdict.message()}; taking the step (pid {child.pid}) down")
    wrapper.event(
        "hang",
        **verdict.event_fields(),
        timeout=watch.timeout,
        save_timeout=watch.save_timeout,
        progress_files=watch.patterns or None,
        elapsed=round(wrapper.elapsed(), 3),
    )
    job = wrapper.slurm_env.job_id if wrapper.slurm_env.in_job else None
    t0 = time.monotonic()
    taken = kill_step(child, log=wrapper.log, slurm_job=job, environ=wrapper.environ)
    wrapper.log(f"hung step taken down in {time.monotonic() - t0:.1f} s")
    wrapper.event("hang_killed", seconds=round(time.monotonic() - t0, 3), **taken)


def adjust(wrapper: Any, result: Any) -> Any:
    """A crashed result of a step the watch took down says so in its reason."""
    from dataclasses import replace

    from hpcckpt.job.outcome import Outcome

    watch: HangWatch | None = getattr(wrapper, "hang", None)
    if watch is None or watch.verdict is None or result.outcome is not Outcome.CRASHED:
        return result
    return replace(
        result, reason=f"{watch.verdict.message()}; killed by the wrapper; {result.reason}"
    )
