"""Where each restore came from: the directory, the node-local tier, or a rebuild of it.

A part of ``hpcckpt report`` (:mod:`hpcckpt.report`): one row per ``restore`` event
that found a checkpoint, and the node-local checkpoints skipped on the way with why
(``local_skipped`` events: a set that could not rebuild, a redundancy file that did
not match its checksum), and the node-local files set aside as damaged on the way
(``local_set_aside`` events).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hpcckpt.rundir.events import LOCAL_SET_ASIDE, LOCAL_SKIPPED, RESTORE


def tier_label(ev: Mapping[str, Any]) -> str:
    """ "directory", "cache", or "cache (rebuilt from xor)" for a ``restore`` event."""
    tier = str(ev.get("tier") or "directory")
    if tier == "cache" and ev.get("rebuilt"):
        return f"cache (rebuilt from {ev.get('rebuilt_from')})"
    return tier


def analyze_restores(events: Sequence[Mapping[str, Any]], t0: float | None) -> list[dict]:
    """Every restore of a checkpoint, in order: time (since ``t0``), step, tier, the
    ranks rebuilt, and the node-local checkpoints skipped just before it."""
    rows: list[dict] = []
    skipped: list[dict] = []
    set_aside: list[dict] = []
    for ev in events:
        kind = ev.get("event")
        if kind == LOCAL_SKIPPED:
            skipped.append({"step": ev.get("step"), "reason": ev.get("reason")})
        elif kind == LOCAL_SET_ASIDE:
            set_aside.append({k: ev.get(k) for k in ("step", "node", "file", "reason")})
        elif kind == RESTORE:
            if ev.get("step") is not None:
                t = ev.get("time")
                rows.append(
                    {
                        "time": None if t0 is None or t is None else round(t - t0, 3),
                        "step": ev.get("step"),
                        "tier": tier_label(ev),
                        "rebuilt": list(ev.get("rebuilt") or []),
                        "local_skipped": skipped,
                        "set_aside": set_aside,
                    }
                )
            skipped, set_aside = [], []
    return rows


def format_restores(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Report lines: one per restore, and one per node-local checkpoint skipped."""
    if not rows:
        return []
    lines = ["Restores"]
    for r in rows:
        ranks = f", rank(s) {', '.join(map(str, r['rebuilt']))} rebuilt" if r["rebuilt"] else ""
        lines.append(f"  step {r['step']} from the {r['tier']}{ranks}")
        for s in r["local_skipped"]:
            lines.append(f"    node-local step {s['step']} not used: {s['reason']}")
        for a in r.get("set_aside", ()):
            lines.append(f"    set aside {a['file']} on {a['node']}: {a['reason']}")
    lines.append("")
    return lines
