"""The report's node failures: which node, when, what it cost.

Reads the ``node_failure`` and ``relaunch`` events (written by
:mod:`hpcckpt.job.relaunch`) next to the attempts :func:`hpcckpt.report.analysis.analyze`
built. Times are seconds since the report's ``t0``.

- ``lost_seconds``: work since the last committed checkpoint (or the restore) until
  the failure was seen, redone afterwards. For a node failure seen only at the next
  start (the wrapper died with its node), from that checkpoint until Slurm marked the
  node down (``failed_at``, from ``sinfo -R``);
- ``queue_seconds``: after a requeue, the wait until the next attempt started;
- ``resume_seconds``: after a relaunch inside the allocation, the time from the failure
  being seen until the application had restored its checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hpcckpt.report.format import rounded


def analyze_node_failures(
    events: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]], t0: float | None
) -> list[dict[str, Any]]:
    """One dict per ``node_failure`` event: ``attempt`` (index), ``node``, ``time``,
    ``action``, ``detected``, ``lost_seconds``, ``queue_seconds``, ``resume_seconds``."""
    if t0 is None:
        return []
    index = {r.get("attempt"): i for i, r in enumerate(rows) if r.get("attempt")}
    out = []
    for ev in events:
        if ev.get("event") != "node_failure":
            continue
        token = ev.get("previous_attempt") or ev.get("attempt")
        i = index.get(token)
        at_restart = bool(ev.get("previous_attempt"))
        seen = ev["time"]
        failed_at = ev.get("failed_at") if isinstance(ev.get("failed_at"), (int, float)) else None
        when = failed_at if at_restart and failed_at is not None else seen
        safe = None
        for e in events:
            if e.get("attempt") != token or e["time"] > when:
                continue
            if e.get("event") in ("checkpoint", "restore", "wrapper_start"):
                safe = e["time"] if safe is None else max(safe, e["time"])
        queue = resume = None
        action = ev.get("action")
        if action in ("requeue", "requeued_by_slurm") and i is not None and i + 1 < len(rows):
            queue = rows[i + 1].get("wait_before")
            if at_restart and failed_at is not None:
                start = rows[i + 1].get("start")
                queue = None if start is None else max(0.0, start - (failed_at - t0))
        if action == "relaunch":
            later = [
                e["time"]
                for e in events
                if e.get("attempt") == token and e.get("event") == "restore" and e["time"] > seen
            ]
            resume = min(later) - seen if later else None
        out.append(
            {
                "attempt": rows[i]["index"] if i is not None else None,
                "node": ev.get("node"),
                "time": rounded(when - t0),
                "action": action,
                "detected": ev.get("detected"),
                "lost_seconds": rounded(when - safe) if safe is not None else None,
                "queue_seconds": rounded(queue),
                "resume_seconds": rounded(resume),
            }
        )
    return out
