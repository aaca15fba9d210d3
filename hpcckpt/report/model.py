"""The report's model: a job's events grouped into attempts, each cut into segments.

See :mod:`hpcckpt.report` for what the segments mean. Pure functions over event records.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcckpt.rundir import events as evlog

#: Segment kinds, in the order the plot's legend shows them.
SEGMENT_KINDS = (
    "compute",
    "checkpoint",
    "mirror_wait",
    "overhead",
    "lost",
    "unrecorded",
    "queue",
)

#: Outcomes after which the job was not meant to run again by itself.
FINISHED, STOPPED, CRASHED = evlog.OUTCOME_FINISHED, evlog.OUTCOME_STOPPED, evlog.OUTCOME_CRASHED
#: The outcome of an attempt that has no final event.
UNKNOWN = "unknown"


@dataclass
class Segment:
    """``kind`` from ``start`` to ``end`` (Unix times)."""

    kind: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass
class Attempt:
    """One run of the job, with its events in file order."""

    index: int
    events: list[dict[str, Any]] = field(default_factory=list)
    wrapper: bool = False
    token: str | None = None
    ended: bool = False  # the wrapper wrote step_end (or an equivalent)

    def first(self, key: str) -> Any:
        """The first non-null value of ``key`` among the events."""
        for ev in self.events:
            if ev.get(key) is not None:
                return ev[key]
        return None


# -- reading ---------------------------------------------------------------------------
def load_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events of ``path`` (a directory holding events.jsonl, or the file itself).

    Lines that are not JSON objects with a numeric ``time`` and an ``event`` (a torn
    last line after a crash, garbage) are skipped. Raises FileNotFoundError if absent.
    """
    p = Path(path)
    if p.is_dir():
        p = p / evlog.EVENTS_FILE
    return [e for e in evlog.read_log(p) if valid_event(e)]


def valid_event(ev: Mapping[str, Any]) -> bool:
    t = ev.get("time")
    return (
        isinstance(ev.get("event"), str)
        and isinstance(t, (int, float))
        and not isinstance(t, bool)
        and math.isfinite(t)
    )


def number(value: Any) -> float | None:
    """A finite int/float field of an event as a float; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# -- attempts --------------------------------------------------------------------------
def split_attempts(events: Iterable[Mapping[str, Any]]) -> list[Attempt]:
    """Group events (in file order) into attempts.

    A ``wrapper_start`` opens an attempt; the Checkpointer's ``start`` opens one too,
    unless a wrapper attempt is running (then it is a launch inside it). Wrapper events
    carrying an ``attempt`` token go to the attempt with that token; Checkpointer events
    go to the latest attempt (or to the one named by their ``attempt`` field, if any).
    Events before the first attempt are dropped.
    """
    attempts: list[Attempt] = []
    by_token: dict[str, Attempt] = {}
    current: Attempt | None = None
    for raw in events:
        if not valid_event(raw):
            continue
        ev = dict(raw)
        kind = ev["event"]
        token = ev.get("attempt") if isinstance(ev.get("attempt"), str) else None
        if kind == "wrapper_start":
            current = Attempt(len(attempts) + 1, wrapper=True, token=token)
            attempts.append(current)
            if token:
                by_token[token] = current
        elif kind == "start" and ev.get("source", "checkpointer") == "checkpointer":
            target = by_token.get(token) if token else None
            if target is None:
                inside = current is not None and current.wrapper and not current.ended
                if not inside:
                    current = Attempt(len(attempts) + 1, token=token)
                    attempts.append(current)
                    if token:
                        by_token[token] = current
                target = current
            assert target is not None
            target.events.append(ev)
            continue
        target = by_token.get(token) if token else None
        if target is None:
            target = current
        if target is None:
            continue
        target.events.append(ev)
        if target.wrapper and kind in evlog.END_EVENTS:
            target.ended = True
    return attempts


def segments_of(att: Attempt, next_start: float | None) -> tuple[list[Segment], dict[str, Any]]:
    """Cut one attempt into segments; also its outcome and facts about it.

    The span since the last state change is classified when the next one happens
    (signals and unknown events do not change the state), so work after the last
    committed checkpoint becomes ``lost`` as a whole when the attempt turns out to
    have crashed.
    """
    evs = att.events
    t_start = evs[0]["time"]
    t_last = max(e["time"] for e in evs)
    segs: list[Segment] = []
    cursor = t_start
    state = "overhead"  # what the time since ``cursor`` is being spent on
    open_ckpt = False
    launches = 0
    failures = 0  # launches that failed before a relaunch inside this attempt
    outcome: str | None = None
    restored_step: Any = None
    last_step: Any = None
    reached: Any = None  # the last step the application reported (finish/stop); None: unknown
    skipped = 0
    uncommitted = 0
    safe_until = t_start  # work before this is checkpointed (or was not work)
    stop_reason: str | None = None
    requeued = False
    staged_at: dict[Any, float] = {}  # step -> when a staged save let the ranks go on

    def add(kind: str, until: float) -> None:
        nonlocal cursor
        until = max(until, cursor)
        if until > cursor:
            if segs and segs[-1].kind == kind and segs[-1].end == cursor:
                segs[-1].end = until
            else:
                segs.append(Segment(kind, cursor, until))
        cursor = until

    def crash_here(t: float) -> None:
        """The launch died at ``t``: everything since the last commit is lost."""
        nonlocal open_ckpt, uncommitted
        if open_ckpt:
            uncommitted += 1
            open_ckpt = False
        uncommitted += len(staged_at)  # staged, never committed
        staged_at.clear()
        add("lost" if state in ("compute", "checkpoint") else state, t)
        for seg in segs:
            if seg.start >= safe_until and seg.kind in ("compute", "checkpoint"):
                seg.kind = "lost"
        merged: list[Segment] = []
        for seg in segs:
            if merged and merged[-1].kind == seg.kind and merged[-1].end == seg.start:
                merged[-1].end = seg.end
            else:
                merged.append(seg)
        segs[:] = merged

    for ev in evs:
        kind, t = ev["event"], ev["time"]
        if kind == "start" and ev.get("source", "checkpointer") == "checkpointer":
            launches += 1
            if launches > 1 and outcome is None:  # relaunched: the previous launch failed
                failures += 1
                crash_here(t)
            add(state, t)
            state, outcome = "overhead", None
        elif kind == "restore":
            add(state, t)
            safe_until = t
            state = "compute"
            if launches <= 1 and restored_step is None:
                restored_step = ev.get("step")
        elif kind == "skip_bad":
            skipped += 1
        elif kind == "checkpoint_begin":
            add(state, t)
            state, open_ckpt = "checkpoint", True
        elif kind == "checkpoint_staged":
            add("checkpoint", t)
            state, open_ckpt = "compute", False
            staged_at[ev.get("step")] = t
        elif kind == "checkpoint" and ev.get("blocked_seconds") is not None:
            # a staged save's commit, later: the work up to its staging is safe now
            safe_until = max(safe_until, staged_at.pop(ev.get("step"), t))
            if open_ckpt:  # begun, never staged: it blocked to the end (node-local, drain)
                add("checkpoint", t)
                state, open_ckpt = "compute", False
            if ev.get("step") is not None:
                last_step = ev["step"]
        elif kind == "checkpoint":
            secs = number(ev.get("seconds"))
            if not open_ckpt and secs is not None:
                add(state, t - secs)  # no checkpoint_begin: the cost tells when it began
            add("checkpoint", t)
            state, open_ckpt, safe_until = "compute", False, t
            if ev.get("step") is not None:
                last_step = ev["step"]
        elif kind == "mirror_wait":
            waited = number(ev.get("seconds"))
            if waited is not None and waited > 0:  # the event comes when the wait ended
                add(state, t - waited)
                add("mirror_wait", t)
        elif kind in ("stop", "finish"):
            add(state, t)
            state = "overhead"
            outcome = STOPPED if kind == "stop" else FINISHED
            if kind == "stop":
                why = ev.get("reason")
                sig = ev.get("signal")
                stop_reason = f"{why} {sig}" if why == "signal" and sig else why
            if kind == "finish" and ev.get("last_step") is not None:
                last_step = ev["last_step"]
            # finish: the last step passed to due() (none: the last saved); stop: its save's
            reached = ev.get("step") if ev.get("step") is not None else last_step
        elif kind in evlog.END_EVENTS:
            said = str(ev.get("outcome") or "") if kind == "step_end" else ""
            requeued = requeued or kind == "requeue"
            if outcome is None:
                if kind == "finished" or said == FINISHED:
                    outcome = FINISHED
                elif kind == "requeue" and ev.get("cause") == "node_failure":
                    outcome = CRASHED
                elif kind in ("stopped", "requeue", "requeue_failed") or said == STOPPED:
                    outcome = STOPPED
                else:
                    outcome = CRASHED
            if outcome == CRASHED:
                crash_here(t)
            add(state, t)

    end_known = att.ended if att.wrapper else outcome in (FINISHED, STOPPED)
    if outcome is None or (not end_known and outcome not in (FINISHED, STOPPED)):
        # No final event: it died unrecorded if another attempt followed; else it may
        # still be running.
        if next_start is not None:
            outcome = CRASHED
            crash_here(t_last)
        else:
            outcome = UNKNOWN
            add(state, t_last)
    t_end = cursor
    if not end_known and next_start is not None and next_start > t_end:
        segs.append(Segment("unrecorded", t_end, next_start))
    facts = {
        "launches": launches,
        "failures": failures + (1 if outcome == CRASHED else 0),
        "outcome": outcome,
        "end_known": end_known,
        "start": t_start,
        "end": t_end,
        "restored_step": restored_step,
        "last_step": last_step,
        "reached_step": reached,
        "skipped_bad": skipped,
        "uncommitted_checkpoints": uncommitted,
        "stop_reason": stop_reason,
        "requeued": requeued,
    }
    return segs, facts
