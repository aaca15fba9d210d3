"""What happened to a job, from its event log: attempts, checkpoints, lost time, efficiency.

Pure functions over the list of events in ``DIR/events.jsonl`` (see
:mod:`hpcckpt.job.events`); no HDF5, no MPI, no Slurm. ``hpcckpt report DIR`` prints
:func:`format_report` of :func:`analyze`, and ``--plot`` draws the timeline with
:mod:`hpcckpt.job.report_plot`.

The model
---------
An *attempt* is one run of the job: a ``wrapper_start`` (the wrapper's run, possibly
holding several launches of the application) or, without the wrapper, a Checkpointer
``start``. Its wall time is cut into segments:

- ``overhead`` — start-up and restore (from the attempt's start to the ``restore``
  event), and shut-down (after ``stop``/``finish`` until the wrapper's ``step_end``);
- ``checkpoint`` — from ``checkpoint_begin`` to ``checkpoint`` (the commit); for a
  staged save (``async_save``/``cache``) to ``checkpoint_staged``, when the ranks go
  back to work: its later commit protects the work done up to the staging;
- ``compute`` — the rest of the time the application ran: useful work, except
- ``lost`` — work after the last committed checkpoint of an attempt (or launch) that
  crashed or was killed: it is redone by the next attempt. A checkpoint begun and never
  committed is lost too;
- ``unrecorded`` — an attempt with no final event (killed without the wrapper noticing,
  or an application run without the wrapper that crashed): its end is unknown, so the
  time from its last event to the next attempt's start is somewhere between lost work
  and waiting;
- ``queue`` — between an attempt's end and the next attempt's start (Slurm's queue
  after a requeue, or the time until someone ran the job again).

Failures are attempts (or launches inside an attempt) that ended neither ``finished``
nor ``stopped`` and were followed by another try. The job's MTBF is estimated as the
run time (the sum of the attempts' durations) divided by the number of failures, and
the interval used is compared with Young's and Daly's for the measured checkpoint cost.

Unknown events and missing fields are tolerated: the event log is shared by the
wrapper and the Checkpointer, and both grow new events over time.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcckpt.job import report_nodes
from hpcckpt.job.events import EVENTS_FILE

__all__ = [
    "SEGMENT_KINDS",
    "Attempt",
    "Segment",
    "analyze",
    "format_report",
    "load_events",
    "split_attempts",
]

#: Segment kinds, in the order the plot's legend shows them.
SEGMENT_KINDS = ("compute", "checkpoint", "overhead", "lost", "unrecorded", "queue")

#: Wrapper events that end the application's run inside an attempt.
_WRAPPER_END = {"step_end", "finished", "crashed", "stopped", "requeue", "requeue_failed"}
#: Events known to this module; anything else is counted as unknown and otherwise ignored.
_KNOWN = {
    "wrapper_start",
    "signal",
    "signal_forwarded",
    *_WRAPPER_END,
    "start",
    "restore",
    "skip_bad",
    "checkpoint_begin",
    "checkpoint_staged",
    "checkpoint",
    "checkpoint_failed",
    "stop",
    "finish",
    "node_failure",  # issue 11: hpcckpt/job/report_nodes.py
    "relaunch",
}
#: Outcomes after which the job was not meant to run again by itself.
FINISHED, STOPPED, CRASHED, UNKNOWN = "finished", "stopped", "crashed", "unknown"


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
        p = p / EVENTS_FILE
    events = []
    for line in p.read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and _valid(ev):
            events.append(ev)
    return events


def _valid(ev: Mapping[str, Any]) -> bool:
    t = ev.get("time")
    return (
        isinstance(ev.get("event"), str)
        and isinstance(t, (int, float))
        and not isinstance(t, bool)
        and math.isfinite(t)
    )


def _num(value: Any) -> float | None:
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
        if not _valid(raw):
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
        if target.wrapper and kind in _WRAPPER_END:
            target.ended = True
    return attempts


def _segments(att: Attempt, next_start: float | None) -> tuple[list[Segment], dict[str, Any]]:
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
            if ev.get("step") is not None:
                last_step = ev["step"]
        elif kind == "checkpoint":
            secs = _num(ev.get("seconds"))
            if not open_ckpt and secs is not None:
                add(state, t - secs)  # no checkpoint_begin: the cost tells when it began
            add("checkpoint", t)
            state, open_ckpt, safe_until = "compute", False, t
            if ev.get("step") is not None:
                last_step = ev["step"]
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
        elif kind in _WRAPPER_END:
            said = str(ev.get("outcome") or "") if kind == "step_end" else ""
            requeued = requeued or kind == "requeue"
            if outcome is None:
                if kind == "finished" or said == FINISHED:
                    outcome = FINISHED
                elif kind == "requeue" and ev.get("cause") == "node_failure":  # issue 11
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
        "skipped_bad": skipped,
        "uncommitted_checkpoints": uncommitted,
        "stop_reason": stop_reason,
        "requeued": requeued,
    }
    return segs, facts


# -- the analysis ----------------------------------------------------------------------
def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def analyze(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The report of a list of events, as a JSON-ready dict.

    Durations are seconds; ``time.t0`` is the first attempt's start (Unix time), and
    every other time is in seconds since ``t0``. Unknown values are ``None``. Keys:

    - ``events`` (count), ``unknown_events`` ({event name: count} not analysed);
    - ``attempts``: one dict per attempt, in order: ``index``, ``job_id``,
      ``restart_count``, ``chain_count``, ``attempt`` (the wrapper's token),
      ``wrapper`` (bool), ``launches`` (application starts), ``nranks``, ``policy``,
      ``start``, ``end``, ``end_known``, ``duration``, ``wait_before``, ``outcome``
      (finished, stopped, crashed, unknown), ``stop_reason``, ``requeued``,
      ``failures``, ``restored_step``, ``last_saved_step``, ``checkpoints``,
      ``skipped_bad``, ``uncommitted_checkpoints``, ``seconds`` ({kind: seconds}) and
      ``segments`` ([{kind, start, end}]), kinds as in :data:`SEGMENT_KINDS`;
    - ``checkpoints``: ``count``, ``mean_seconds``, ``max_seconds``, ``total_seconds``,
      ``total_bytes``, ``mean_bytes``, ``by_reason``, ``by_kind`` (None unless the
      events have a ``kind``), ``skipped_bad``, ``uncommitted``;
    - ``time``: ``t0``, ``wall_seconds``, ``run_seconds`` (sum of the attempts),
      ``useful_seconds``, ``checkpoint_seconds``, ``overhead_seconds``,
      ``lost_seconds``, ``unrecorded_seconds``, ``queue_seconds``;
    - ``efficiency``: ``run`` (useful / run time), ``wall`` (useful / wall time);
    - ``failures``: ``count``, ``mtbf_seconds`` (run time / count), ``note``;
    - ``interval``: ``used_seconds`` (median measured), ``configured_seconds`` (the
      policy's ``next_interval``), ``cost_seconds``, ``mtbf_seconds``, ``young_seconds``,
      ``daly_seconds``, ``model_efficiency_used``, ``model_efficiency_daly``,
      ``young_lower_bound_seconds`` (with no failure), ``note``.
    """
    events = [dict(e) for e in events if isinstance(e, Mapping) and _valid(e)]
    unknown = Counter(e["event"] for e in events if e["event"] not in _KNOWN)
    attempts = split_attempts(events)
    t0 = attempts[0].events[0]["time"] if attempts else None

    rows: list[dict[str, Any]] = []
    totals = dict.fromkeys(SEGMENT_KINDS, 0.0)
    failures = 0
    prev_end: float | None = None
    prev_known = True
    for i, att in enumerate(attempts):
        next_start = attempts[i + 1].events[0]["time"] if i + 1 < len(attempts) else None
        segs, facts = _segments(att, next_start)
        start = facts["start"]
        wait = None
        if prev_end is not None and prev_known and start > prev_end:
            segs.insert(0, Segment("queue", prev_end, start))
            wait = start - prev_end
        elif prev_end is not None and prev_known:
            wait = 0.0
        by_kind = dict.fromkeys(SEGMENT_KINDS, 0.0)
        for s in segs:
            by_kind[s.kind] += s.seconds
        for k, v in by_kind.items():
            totals[k] += v
        failed_here = facts["failures"]
        failures += failed_here
        ckpts = [e for e in att.events if e["event"] == "checkpoint"]
        rows.append(
            {
                "index": att.index,
                "job_id": att.first("job_id"),
                "array_task": att.first("array_task"),
                "restart_count": att.first("restart_count"),
                "chain_count": att.first("chain_count"),
                "attempt": att.token,
                "wrapper": att.wrapper,
                "launches": facts["launches"],
                "nranks": att.first("nranks"),
                "policy": next(
                    (e.get("policy") for e in att.events if e["event"] == "start"), None
                ),
                "start": _r(start - t0),
                "end": _r(facts["end"] - t0),
                "end_known": facts["end_known"],
                "duration": _r(facts["end"] - start),
                "wait_before": _r(wait),
                "outcome": facts["outcome"],
                "stop_reason": facts["stop_reason"],
                "requeued": facts["requeued"],
                "failures": failed_here,
                "restored_step": facts["restored_step"],
                "last_saved_step": facts["last_step"],
                "checkpoints": len(ckpts),
                "skipped_bad": facts["skipped_bad"],
                "uncommitted_checkpoints": facts["uncommitted_checkpoints"],
                "seconds": {k: _r(v) for k, v in by_kind.items()},
                "segments": [
                    {"kind": s.kind, "start": _r(s.start - t0), "end": _r(s.end - t0)} for s in segs
                ],
            }
        )
        prev_end = facts["end"]
        prev_known = facts["end_known"]

    ckpt_events = [e for a in attempts for e in a.events if e["event"] == "checkpoint"]
    costs = [c for c in (_num(e.get("seconds")) for e in ckpt_events) if c is not None]
    sizes = [b for b in (_num(e.get("bytes")) for e in ckpt_events) if b is not None]
    reasons = Counter(str(e.get("reason") or "unknown") for e in ckpt_events)
    kinds = Counter(str(e["kind"]) for e in ckpt_events if e.get("kind") is not None)
    checkpoints = {
        "count": len(ckpt_events),
        "mean_seconds": _r(_mean(costs), 6),
        "max_seconds": _r(max(costs), 6) if costs else None,
        "total_seconds": _r(sum(costs), 6),
        "total_bytes": int(sum(sizes)),
        "mean_bytes": int(_mean(sizes)) if sizes else None,
        "by_reason": dict(sorted(reasons.items())),
        "by_kind": dict(sorted(kinds.items())) if kinds else None,
        "skipped_bad": sum(r["skipped_bad"] for r in rows),
        "uncommitted": sum(r["uncommitted_checkpoints"] for r in rows),
    }

    run = sum(r["duration"] or 0.0 for r in rows)
    wall = (rows[-1]["end"] - rows[0]["start"]) if rows else 0.0
    useful = totals["compute"]
    time_ = {
        "t0": t0,
        "wall_seconds": _r(wall),
        "run_seconds": _r(run),
        "useful_seconds": _r(useful),
        "checkpoint_seconds": _r(totals["checkpoint"]),
        "overhead_seconds": _r(totals["overhead"]),
        "lost_seconds": _r(totals["lost"]),
        "unrecorded_seconds": _r(totals["unrecorded"]),
        "queue_seconds": _r(totals["queue"]),
    }
    efficiency = {
        "run": _r(useful / run, 4) if run > 0 else None,
        "wall": _r(useful / wall, 4) if wall > 0 else None,
    }
    mtbf = run / failures if failures and run > 0 else None
    fail = {
        "count": failures,
        "mtbf_seconds": _r(mtbf),
        "note": (
            "no failure observed"
            if not failures
            else f"run time / failures = {run:.0f} s / {failures}"
        ),
    }
    return {
        "events": len(events),
        "unknown_events": dict(sorted(unknown.items())),
        "attempts": rows,
        "checkpoints": checkpoints,
        "time": time_,
        "efficiency": efficiency,
        "failures": fail,
        "interval": _interval_analysis(attempts, checkpoints["mean_seconds"], mtbf, run),
        "node_failures": report_nodes.analyze_node_failures(events, rows, t0),  # issue 11
    }


def _interval_analysis(
    attempts: list[Attempt], cost: float | None, mtbf: float | None, run: float
) -> dict[str, Any]:
    """The interval used (measured, and as the policy reported it) against Young and Daly."""
    from hpcckpt.policy.formulas import daly, efficiency, young

    gaps: list[float] = []
    for att in attempts:
        ref: float | None = None  # the last commit, or the restore (the timer restarts)
        began: float | None = None
        for ev in att.events:
            kind = ev["event"]
            if kind == "start":
                ref = began = None
            elif kind == "restore":
                ref = ev["time"]
            elif kind == "checkpoint_begin":
                began = ev["time"]
            elif kind == "checkpoint_staged":
                if ref is not None and began is not None:
                    gaps.append(began - ref)
                ref, began = ev["time"], None
            elif kind == "checkpoint" and ev.get("blocked_seconds") is not None:
                continue  # the commit of a staged save: its interval was counted at staging
            elif kind == "checkpoint":
                if began is None:
                    began = ev["time"] - (_num(ev.get("seconds")) or 0.0)
                # A checkpoint on a stop request cuts its interval short: not a sample.
                if ref is not None and ev.get("reason") not in ("signal", "deadline"):
                    gaps.append(began - ref)
                ref, began = ev["time"], None
    configured = [
        v
        for v in (
            _num(e.get("next_interval"))
            for a in attempts
            for e in a.events
            if e["event"] == "checkpoint"
        )
        if v is not None
    ]
    used = _median([g for g in gaps if g >= 0])
    out: dict[str, Any] = {
        "used_seconds": _r(used),
        "configured_seconds": _r(_median(configured)),
        "cost_seconds": _r(cost, 6),
        "mtbf_seconds": _r(mtbf),
        "young_seconds": None,
        "daly_seconds": None,
        "model_efficiency_used": None,
        "model_efficiency_daly": None,
        "young_lower_bound_seconds": None,
        "note": "",
    }
    if cost is None or cost <= 0:
        out["note"] = "no checkpoint cost measured"
        return out
    if mtbf is None:
        if run > 0:
            out["young_lower_bound_seconds"] = _r(young(cost, run))
        out["note"] = (
            "no failure observed: the MTBF is longer than the run so far, so the optimum "
            "is at least Young's interval for MTBF = run time"
        )
        return out
    out["young_seconds"] = _r(young(cost, mtbf))
    out["daly_seconds"] = _r(daly(cost, mtbf))
    t_daly = daly(cost, mtbf)
    if used is not None and used > 0:
        out["model_efficiency_used"] = _r(efficiency(used, cost, mtbf), 4)
    if t_daly > 0:
        out["model_efficiency_daly"] = _r(efficiency(t_daly, cost, mtbf), 4)
    if used is not None and t_daly > 0:
        ratio = used / t_daly
        if ratio > 2:
            out["note"] = f"the interval used is {ratio:.1f}x Daly's: checkpoint more often"
        elif ratio < 0.5:
            out["note"] = f"the interval used is {ratio:.2f}x Daly's: checkpoint less often"
        else:
            out["note"] = "the interval used is within a factor 2 of Daly's"
    return out


# -- text ------------------------------------------------------------------------------
def _dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    from hpcckpt.policy.durations import format_duration

    return format_duration(seconds)


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_report(report: Mapping[str, Any]) -> str:
    """The report as text for a terminal."""
    lines: list[str] = []
    atts = report["attempts"]
    if not atts:
        return "no job attempt in the event log (no wrapper_start or Checkpointer start)"
    tm, eff, ck = report["time"], report["efficiency"], report["checkpoints"]
    lines.append(
        f"{len(atts)} attempt{'s' if len(atts) != 1 else ''}, "
        f"{ck['count']} checkpoint{'s' if ck['count'] != 1 else ''}, "
        f"{report['failures']['count']} failure{'s' if report['failures']['count'] != 1 else ''}"
        f"; useful-work efficiency {_pct(eff['run'])} of run time, "
        f"{_pct(eff['wall'])} of wall time"
    )
    lines.append("")
    lines.append("Attempts")
    header = (
        f"  {'#':>2}  {'job':<10} {'restart':>7}  {'start':>8} {'duration':>9} "
        f"{'waited':>8}  {'steps':<13} {'ckpts':>5} {'lost':>8}  outcome"
    )
    lines.append(header)
    for a in atts:
        job = str(a["job_id"]) if a["job_id"] is not None else "-"
        if a.get("array_task"):
            job = str(a["array_task"])  # A_T: which task of the array
        restart = a["restart_count"] if a["restart_count"] is not None else "-"
        if a["chain_count"]:
            restart = f"{restart}/c{a['chain_count']}"
        steps = (
            f"{'new' if a['restored_step'] is None else a['restored_step']}"
            f"->{'-' if a['last_saved_step'] is None else a['last_saved_step']}"
        )
        outcome = a["outcome"]
        if not a["end_known"]:
            outcome += " (end not recorded)"
        if outcome == STOPPED and a["stop_reason"]:
            outcome += f" ({a['stop_reason']})"
        if a["requeued"]:
            outcome += ", requeued"
        if a["launches"] > 1:
            outcome += f", {a['launches']} launches"
        lost = a["seconds"]["lost"]
        lines.append(
            f"  {a['index']:>2}  {job:<10} {restart!s:>7}  {_dur(a['start']):>8} "
            f"{_dur(a['duration']):>9} {_dur(a['wait_before']):>8}  {steps:<13} "
            f"{a['checkpoints']:>5} {_dur(lost) if lost else '0':>8}  {outcome}"
        )
    lines.extend(report_nodes.format_lines(report))  # issue 11: which node, when, the cost
    lines.append("")
    lines.append("Checkpoints")
    if ck["count"]:
        reasons = ", ".join(f"{k} {v}" for k, v in ck["by_reason"].items())
        lines.append(
            f"  {ck['count']} committed ({reasons}); cost mean {_dur(ck['mean_seconds'])}, "
            f"max {_dur(ck['max_seconds'])}; {_size(ck['mean_bytes'])} each, "
            f"{_size(ck['total_bytes'])} in all"
        )
        if ck["by_kind"]:
            lines.append("  kinds: " + ", ".join(f"{k} {v}" for k, v in ck["by_kind"].items()))
    else:
        lines.append("  none committed")
    if ck["skipped_bad"]:
        lines.append(f"  {ck['skipped_bad']} bad checkpoint(s) skipped at restore")
    if ck["uncommitted"]:
        lines.append(f"  {ck['uncommitted']} checkpoint(s) begun and never committed")
    lines.append("")
    lines.append("Time")
    lines.append(
        f"  wall {_dur(tm['wall_seconds'])} = run {_dur(tm['run_seconds'])} "
        f"+ waiting between attempts {_dur(tm['queue_seconds'])}"
        + (
            f" + end not recorded {_dur(tm['unrecorded_seconds'])}"
            if tm["unrecorded_seconds"]
            else ""
        )
    )
    run = tm["run_seconds"] or 0.0
    for key, label in (
        ("useful_seconds", "useful work"),
        ("checkpoint_seconds", "writing checkpoints"),
        ("overhead_seconds", "start-up, restore, shut-down"),
        ("lost_seconds", "lost to failures (redone)"),
    ):
        v = tm[key] or 0.0
        share = f" ({100 * v / run:.1f}% of run)" if run > 0 else ""
        lines.append(f"  {label:<30} {_dur(v):>9}{share}")
    if tm["unrecorded_seconds"]:
        lines.append(
            "  an attempt ended without a final event (run it under `hpcckpt run/srun` for "
            "exact figures): the time after its last event is counted as 'end not recorded'"
        )
    lines.append("")
    lines.append("Interval")
    iv, fl = report["interval"], report["failures"]
    used = (
        f"used {_dur(iv['used_seconds'])} between checkpoints (measured)"
        if iv["used_seconds"] is not None
        else "no regular checkpoint to measure the interval (only on stop requests)"
    )
    lines.append(
        f"  {used}"
        + (
            f", policy {_dur(iv['configured_seconds'])}"
            if iv["configured_seconds"] is not None
            else ""
        )
        + f"; checkpoint cost {_dur(iv['cost_seconds'])}"
    )
    if fl["mtbf_seconds"] is None:
        lines.append(f"  {fl['note']}")
        if iv["young_lower_bound_seconds"] is not None:
            lines.append(
                f"  Young's interval would be at least {_dur(iv['young_lower_bound_seconds'])}"
                " (MTBF >= run time)"
            )
    else:
        lines.append(
            f"  MTBF {_dur(fl['mtbf_seconds'])} ({fl['note']}); Young {_dur(iv['young_seconds'])}"
            f", Daly {_dur(iv['daly_seconds'])}"
        )
        if iv["model_efficiency_used"] is not None:
            lines.append(
                f"  expected efficiency: {_pct(iv['model_efficiency_used'])} at the interval "
                f"used, {_pct(iv['model_efficiency_daly'])} at Daly's"
            )
        if iv["note"]:
            lines.append(f"  {iv['note']}")
    if report["unknown_events"]:
        lines.append("")
        lines.append(
            "Other events (not analysed): "
            + ", ".join(f"{k} {v}" for k, v in report["unknown_events"].items())
        )
    return "\n".join(lines)
