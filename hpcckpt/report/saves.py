"""The report's per-save costs: what the ranks waited and the memory a save took.

Reads the ``checkpoint`` events (``blocked_seconds`` for a staged save, ``peak_rss``:
the largest resident set of a rank from the save's start to its commit, the
application's own memory included; ``staging_mode``) and ``staging_refused`` (an
``async_save`` written synchronously for lack of memory).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from hpcckpt.report.format import dur, size
from hpcckpt.report.model import number
from hpcckpt.rundir.events import CHECKPOINT, STAGING_REFUSED


def summarize(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """``blocked_mean_seconds``, ``blocked_max_seconds`` (staged saves; a synchronous
    save blocks for its whole ``seconds``), ``peak_rss_max_bytes``, ``staging_modes``
    ({mode: count}), ``staging_refused`` (count)."""
    blocked: list[float] = []
    peaks: list[float] = []
    modes: Counter[str] = Counter()
    refused = 0
    for ev in events:
        kind = ev.get("event")
        if kind == STAGING_REFUSED:
            refused += 1
        if kind != CHECKPOINT:
            continue
        b = number(ev.get("blocked_seconds"))
        b = b if b is not None else number(ev.get("seconds"))
        if b is not None:
            blocked.append(b)
        p = number(ev.get("peak_rss"))
        if p:
            peaks.append(p)
        if ev.get("staging_mode"):
            modes[str(ev["staging_mode"])] += 1
    return {
        "blocked_mean_seconds": round(sum(blocked) / len(blocked), 6) if blocked else None,
        "blocked_max_seconds": round(max(blocked), 6) if blocked else None,
        "peak_rss_max_bytes": int(max(peaks)) if peaks else None,
        "staging_modes": dict(sorted(modes.items())),
        "staging_refused": refused,
    }


def format_lines(saves: Mapping[str, Any] | None) -> list[str]:
    """The report's lines about blocked time and memory (none when nothing was recorded)."""
    if not saves or saves.get("blocked_mean_seconds") is None:
        return []
    line = (
        f"  ranks blocked per save: mean {dur(saves['blocked_mean_seconds'])}, "
        f"max {dur(saves['blocked_max_seconds'])}"
    )
    if saves.get("peak_rss_max_bytes"):
        line += f"; peak memory of a rank during a save {size(saves['peak_rss_max_bytes'])}"
    lines = [line]
    if saves.get("staging_modes"):
        modes = ", ".join(f"{k} {v}" for k, v in saves["staging_modes"].items())
        lines.append(f"  staged in memory: {modes}")
    if saves.get("staging_refused"):
        lines.append(
            f"  {saves['staging_refused']} async save(s) written synchronously: memory short"
        )
    return lines
