"""The report's analysis: where a job's time went, what checkpoints cost, the interval
used against Young's and Daly's, as one JSON-ready dict (:func:`analyze`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from hpcckpt.policy.formulas import daly, efficiency, young
from hpcckpt.report import saves, tiers
from hpcckpt.report.format import mean, median, rounded
from hpcckpt.report.mirror import analyze_mirror
from hpcckpt.report.model import (
    SEGMENT_KINDS,
    Attempt,
    Segment,
    number,
    segments_of,
    split_attempts,
    valid_event,
)
from hpcckpt.report.nodes import analyze_node_failures
from hpcckpt.rundir import events as evlog

#: Events known to this module; anything else is counted as unknown and otherwise ignored.
_KNOWN = {
    "wrapper_start",
    "signal",
    "signal_forwarded",
    *evlog.END_EVENTS,
    "start",
    "restore",
    "skip_bad",
    "checkpoint_begin",
    "checkpoint_staged",
    "checkpoint",
    "checkpoint_failed",
    "stop",
    "finish",
    "node_failure",  # analysed in hpcckpt/report/nodes.py
    "relaunch",
    evlog.STAGING_REFUSED,  # counted in hpcckpt/report/saves.py
    evlog.WRITE_PATH,
    evlog.LOCAL_SKIPPED,  # shown by hpcckpt/report/tiers.py
    evlog.LOCAL_SET_ASIDE,  # shown by hpcckpt/report/tiers.py
    evlog.SIGNAL_DELIVERED,
    evlog.NOT_BATCH_SHELL,
    evlog.END_TIME_STOP,
    evlog.END_TIME_MOVED,
    evlog.PREEMPTED,
    evlog.CANCELLED,
    evlog.MIRRORED,  # shown by hpcckpt/report/mirror.py
    evlog.MIRROR_FAILED,
    evlog.MIRROR_PRUNED,
    evlog.MIRROR_WAIT,
}


def analyze(
    events: Iterable[Mapping[str, Any]], present: Collection[int] | None = None
) -> dict[str, Any]:
    """The report of a list of events, as a JSON-ready dict; ``present``: the steps of
    the checkpoints in the directory now, when known (the mirror's ``behind``).

    Durations are seconds; ``time.t0`` is the first attempt's start (Unix time), and
    every other time is in seconds since ``t0``. Unknown values are ``None``. Keys:

    - ``events`` (count), ``unknown_events`` ({event name: count} not analysed);
    - ``attempts``: one dict per attempt, in order: ``index``, ``job_id``,
      ``restart_count``, ``chain_count``, ``attempt`` (the wrapper's token),
      ``wrapper`` (bool), ``launches`` (application starts), ``nranks``, ``policy``,
      ``start``, ``end``, ``end_known``, ``duration``, ``wait_before``, ``outcome``
      (finished, stopped, crashed, unknown), ``stop_reason``, ``requeued``,
      ``failures``, ``restored_step``, ``reached_step`` (the last step the application
      reported: the ``finish`` event's ``step``, the last one given to ``due()``, or the
      step of the stop checkpoint; None when the attempt ended without either, a
      crash), ``last_saved_step``, ``checkpoints``,
      ``skipped_bad``, ``uncommitted_checkpoints``, ``seconds`` ({kind: seconds}) and
      ``segments`` ([{kind, start, end}]), kinds as in :data:`SEGMENT_KINDS`;
    - ``checkpoints``: ``count``, ``mean_seconds``, ``max_seconds``, ``total_seconds``,
      ``total_bytes``, ``mean_bytes``, ``by_reason``, ``by_kind`` (None unless the
      events have a ``kind``), ``skipped_bad``, ``uncommitted``, ``saves`` (blocked
      time and peak memory per save: :func:`hpcckpt.report.saves.summarize`);
    - ``time``: ``t0``, ``wall_seconds``, ``run_seconds`` (sum of the attempts),
      ``useful_seconds``, ``checkpoint_seconds`` (in ``save()``, from ``checkpoint_begin``
      to the commit, or to the staging of a staged save), of which
      ``checkpoint_store_seconds`` (the store's part: the ``seconds`` of each synchronous
      save, the ``blocked_seconds`` of a staged one) and ``checkpoint_other_seconds``
      (the rest: checking the state, retention, events), ``mirror_wait_seconds`` (at
      ``finish()`` and a stop, waiting for the newest checkpoint to reach the mirror: the
      ``mirror_wait`` events' ``seconds``; not useful work), ``overhead_seconds``,
      ``lost_seconds``, ``unrecorded_seconds``, ``queue_seconds``;
    - ``efficiency``: ``run`` (useful / run time), ``wall`` (useful / wall time);
    - ``failures``: ``count``, ``mtbf_seconds`` (run time / count), ``note``;
    - ``interval``: ``used_seconds`` (median measured), ``configured_seconds`` (the
      policy's ``next_interval``), ``cost_seconds``, ``mtbf_seconds``, ``young_seconds``,
      ``daly_seconds``, ``model_efficiency_used``, ``model_efficiency_daly``,
      ``young_lower_bound_seconds`` (with no failure), ``note``;
    - ``restores``: every restore of a checkpoint, with its tier ("directory", "cache",
      "cache (rebuilt from xor)") and the node-local checkpoints skipped before it.
    - ``gave_up``: why the wrapper stopped continuing the job (the last ``give_up``
      event: ``cause``, ``reason``, ``attempt``), None when it never gave up.
    - ``mirror``: what reached the mirror and what is behind
      (:func:`hpcckpt.report.mirror.analyze_mirror`), None without a mirror.
    """
    events = [dict(e) for e in events if isinstance(e, Mapping) and valid_event(e)]
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
        segs, facts = segments_of(att, next_start)
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
                "start": rounded(start - t0),
                "end": rounded(facts["end"] - t0),
                "end_known": facts["end_known"],
                "duration": rounded(facts["end"] - start),
                "wait_before": rounded(wait),
                "outcome": facts["outcome"],
                "stop_reason": facts["stop_reason"],
                "requeued": facts["requeued"],
                "failures": failed_here,
                "restored_step": facts["restored_step"],
                "reached_step": facts["reached_step"],
                "last_saved_step": facts["last_step"],
                "checkpoints": len(ckpts),
                "skipped_bad": facts["skipped_bad"],
                "uncommitted_checkpoints": facts["uncommitted_checkpoints"],
                "seconds": {k: rounded(v) for k, v in by_kind.items()},
                "segments": [
                    {"kind": s.kind, "start": rounded(s.start - t0), "end": rounded(s.end - t0)}
                    for s in segs
                ],
            }
        )
        prev_end = facts["end"]
        prev_known = facts["end_known"]

    ckpt_events = [e for a in attempts for e in a.events if e["event"] == "checkpoint"]
    costs = [c for c in (number(e.get("seconds")) for e in ckpt_events) if c is not None]
    in_store = 0.0  # what the ranks spent in the store: a staged save's blocked time
    for e in ckpt_events:
        blocked = number(e.get("blocked_seconds"))
        in_store += (blocked if blocked is not None else number(e.get("seconds"))) or 0.0
    sizes = [b for b in (number(e.get("bytes")) for e in ckpt_events) if b is not None]
    reasons = Counter(str(e.get("reason") or "unknown") for e in ckpt_events)
    kinds = Counter(str(e["kind"]) for e in ckpt_events if e.get("kind") is not None)
    checkpoints = {
        "count": len(ckpt_events),
        "mean_seconds": rounded(mean(costs), 6),
        "max_seconds": rounded(max(costs), 6) if costs else None,
        "total_seconds": rounded(sum(costs), 6),
        "total_bytes": int(sum(sizes)),
        "mean_bytes": int(mean(sizes)) if sizes else None,
        "by_reason": dict(sorted(reasons.items())),
        "by_kind": dict(sorted(kinds.items())) if kinds else None,
        "skipped_bad": sum(r["skipped_bad"] for r in rows),
        "uncommitted": sum(r["uncommitted_checkpoints"] for r in rows),
        "saves": saves.summarize(e for a in attempts for e in a.events),
    }

    run = sum(r["duration"] or 0.0 for r in rows)
    wall = (rows[-1]["end"] - rows[0]["start"]) if rows else 0.0
    useful = totals["compute"]
    time_ = {
        "t0": t0,
        "wall_seconds": rounded(wall),
        "run_seconds": rounded(run),
        "useful_seconds": rounded(useful),
        "checkpoint_seconds": rounded(totals["checkpoint"]),
        "checkpoint_store_seconds": rounded(min(in_store, totals["checkpoint"])),
        "checkpoint_other_seconds": rounded(max(0.0, totals["checkpoint"] - in_store)),
        "overhead_seconds": rounded(totals["overhead"]),
        "mirror_wait_seconds": rounded(totals["mirror_wait"]),
        "lost_seconds": rounded(totals["lost"]),
        "unrecorded_seconds": rounded(totals["unrecorded"]),
        "queue_seconds": rounded(totals["queue"]),
    }
    efficiency = {
        "run": rounded(useful / run, 4) if run > 0 else None,
        "wall": rounded(useful / wall, 4) if wall > 0 else None,
    }
    mtbf = run / failures if failures and run > 0 else None
    fail = {
        "count": failures,
        "mtbf_seconds": rounded(mtbf),
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
        "node_failures": analyze_node_failures(events, rows, t0),
        "restores": tiers.analyze_restores(events, t0),
        "gave_up": gave_up(events),
        "mirror": analyze_mirror(events, present),
    }


def gave_up(events: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The last ``give_up`` event: why the wrapper stopped continuing the job (``cause``:
    ``no_progress``, ``poisoned``, else ``crash``), or None when it never gave up."""
    last = None
    for ev in events:
        if ev.get("event") == "give_up":
            last = ev
    if last is None:
        return None
    cause = last.get("cause") or ("poisoned" if last.get("poisoned") else "crash")
    return {"cause": cause, "reason": last.get("reason"), "attempt": last.get("attempt")}


def _interval_analysis(
    attempts: list[Attempt], cost: float | None, mtbf: float | None, run: float
) -> dict[str, Any]:
    """The interval used (measured, and as the policy reported it) against Young and Daly."""
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
                    began = ev["time"] - (number(ev.get("seconds")) or 0.0)
                # A checkpoint on a stop request cuts its interval short: not a sample.
                if ref is not None and ev.get("reason") not in ("signal", "deadline"):
                    gaps.append(began - ref)
                ref, began = ev["time"], None
    configured = [
        v
        for v in (
            number(e.get("next_interval"))
            for a in attempts
            for e in a.events
            if e["event"] == "checkpoint"
        )
        if v is not None
    ]
    used = median([g for g in gaps if g >= 0])
    out: dict[str, Any] = {
        "used_seconds": rounded(used),
        "configured_seconds": rounded(median(configured)),
        "cost_seconds": rounded(cost, 6),
        "mtbf_seconds": rounded(mtbf),
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
            out["young_lower_bound_seconds"] = rounded(young(cost, run))
        out["note"] = (
            "no failure observed: the MTBF is longer than the run so far, so the optimum "
            "is at least Young's interval for MTBF = run time"
        )
        return out
    out["young_seconds"] = rounded(young(cost, mtbf))
    out["daly_seconds"] = rounded(daly(cost, mtbf))
    t_daly = daly(cost, mtbf)
    if used is not None and used > 0:
        out["model_efficiency_used"] = rounded(efficiency(used, cost, mtbf), 4)
    if t_daly > 0:
        out["model_efficiency_daly"] = rounded(efficiency(t_daly, cost, mtbf), 4)
    if used is not None and t_daly > 0:
        ratio = used / t_daly
        if ratio > 2:
            out["note"] = f"the interval used is {ratio:.1f}x Daly's: checkpoint more often"
        elif ratio < 0.5:
            out["note"] = f"the interval used is {ratio:.2f}x Daly's: checkpoint less often"
        else:
            out["note"] = "the interval used is within a factor 2 of Daly's"
    return out
