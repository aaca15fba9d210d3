"""What reached the mirror (the second tier) and what is behind, for ``hpcckpt report``.

From rank 0's ``mirrored``, ``mirror_failed``, ``mirror_pruned`` and ``mirror_wait``
events and the directory's ``checkpoint`` events: the checkpoints copied and verified,
the committed ones that are not (yet) on the mirror, the failures with their last reason,
and whether the last wait at ``finish()`` or a stop saw the newest one arrive.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from hpcckpt.rundir.events import MIRROR_FAILED, MIRROR_PRUNED, MIRROR_WAIT, MIRRORED


def analyze_mirror(
    events: Sequence[Mapping[str, Any]], present: Collection[int] | None = None
) -> dict[str, Any] | None:
    """The mirror's part of the report, or None when the run had no mirror events.

    Keys: ``mirror`` (URL), ``mirrored`` (steps, in order), ``bytes``, ``median_rate``
    (bytes/s), ``newest_mirrored``, ``newest_committed`` (the directory's),
    ``behind`` (committed steps newer than the newest mirrored one), ``failures`` (failed
    tries: a ``mirror_failed`` event with a ``count`` stands for that many of one run of
    failures, ``since`` its first), ``last_failure`` (``step``, ``reason``), ``pruned``
    (files the mirror's retention deleted), ``last_wait`` (``reason``, ``done``,
    ``seconds``, ``step``) or None.

    With ``present`` (the steps of the checkpoints in the directory now), ``behind`` holds
    only those, and ``behind_deleted`` counts the others (deleted by the directory's
    retention before they were copied: a newer one took their place); else None."""
    mirrored: list[int] = []
    rates: list[float] = []
    total = 0
    url = None
    failures: list[Mapping[str, Any]] = []
    pruned = 0
    last_wait = None
    committed: list[int] = []
    for ev in events:
        kind = ev.get("event")
        if kind == "checkpoint" and ev.get("tier") != "cache" and ev.get("step") is not None:
            committed.append(int(ev["step"]))
        elif kind == MIRRORED:
            mirrored.append(int(ev["step"]))
            total += int(ev.get("bytes") or 0)
            if isinstance(ev.get("rate"), (int, float)):
                rates.append(float(ev["rate"]))
        elif kind == MIRROR_FAILED:
            failures.append(ev)
        elif kind == MIRROR_PRUNED:
            pruned += len(ev.get("deleted") or [])
        elif kind == MIRROR_WAIT:
            last_wait = {k: ev.get(k) for k in ("reason", "done", "seconds", "step", "error")}
        else:
            continue
        url = ev.get("mirror", url)
    if not (mirrored or failures or pruned or last_wait):
        return None
    newest = max(mirrored) if mirrored else None
    newest_committed = max(committed) if committed else None
    behind = sorted({s for s in committed if newest is None or s > newest})
    deleted = None
    if present is not None:
        here = set(present)
        deleted = sum(1 for s in behind if s not in here)
        behind = [s for s in behind if s in here]
    last = failures[-1] if failures else None
    runs: dict[Any, int] = {}  # one run of failures of one cause -> its latest count
    for i, ev in enumerate(failures):
        count, since = ev.get("count"), ev.get("since")
        if isinstance(count, int) and since is not None:
            runs[(ev.get("mirror"), since)] = max(count, runs.get((ev.get("mirror"), since), 0))
        else:  # one event per failure (an older run), or a copy given up
            runs[i] = 1
    return {
        "mirror": url,
        "mirrored": mirrored,
        "bytes": total,
        "median_rate": statistics.median(rates) if rates else None,
        "newest_mirrored": newest,
        "newest_committed": newest_committed,
        "behind": behind,
        "behind_deleted": deleted,
        "failures": sum(runs.values()),
        "last_failure": None
        if last is None
        else {"step": last.get("step"), "reason": last.get("reason")},
        "pruned": pruned,
        "last_wait": last_wait,
    }


def format_mirror(m: Mapping[str, Any] | None) -> list[str]:
    """Report lines for :func:`analyze_mirror`'s dict (none for None)."""
    if not m:
        return []
    lines = [f"Mirror {m['mirror'] or '(URL not recorded)'}"]
    rate = m["median_rate"]
    lines.append(
        f"  {len(m['mirrored'])} checkpoint(s) copied and verified, {m['bytes'] / 1e6:.1f} MB"
        + (f", median {rate / 1e6:.1f} MB/s" if rate else "")
        + (f"; newest step {m['newest_mirrored']}" if m["newest_mirrored"] is not None else "")
    )
    behind = m["behind"]
    if behind:
        shown = ", ".join(str(s) for s in behind[-5:])
        more = f" (and {len(behind) - 5} more)" if len(behind) > 5 else ""
        lines.append(
            f"  behind: {len(behind)} committed checkpoint(s) not on the mirror, steps "
            f"{shown}{more}"
        )
    elif not m.get("behind_deleted"):
        lines.append("  up to date: the newest committed checkpoint is on the mirror")
    if m.get("behind_deleted"):
        lines.append(
            f"  {m['behind_deleted']} more committed checkpoint(s) never reached the mirror: "
            "the directory's retention deleted them (a newer one took their place)"
        )
    if m["failures"]:
        last = m["last_failure"]
        lines.append(
            f"  {m['failures']} failed cop(ies); the last, step {last['step']}: {last['reason']}"
        )
    if m["pruned"]:
        lines.append(f"  {m['pruned']} file(s) deleted by the mirror's retention")
    wait = m["last_wait"]
    if wait:
        outcome = "arrived" if wait.get("done") else "did NOT arrive"
        lines.append(
            f"  last wait ({wait.get('reason')}): step {wait.get('step')} {outcome} "
            f"after {float(wait.get('seconds') or 0):.1f} s"
            + (f" ({wait['error']})" if not wait.get("done") and wait.get("error") else "")
        )
    lines.append("")
    return lines
