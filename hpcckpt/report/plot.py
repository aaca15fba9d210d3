"""The timeline of ``hpcckpt report --plot``: one row per attempt, and where the time went.

Imported only when a plot is asked for; needs matplotlib (``pip install matplotlib``).
Draws the dict returned by :func:`hpcckpt.report.analysis.analyze`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hpcckpt.report.format import dur, pct
from hpcckpt.report.model import SEGMENT_KINDS, STOPPED, UNKNOWN

__all__ = ["COLORS", "LABELS", "plot_report"]

#: Colour and legend label of each segment kind.
COLORS = {
    "compute": "#59a14f",
    "checkpoint": "#1f4e9c",
    "mirror_wait": "#76b7b2",
    "overhead": "#a0a0a0",
    "lost": "#e15759",
    "unrecorded": "#f4b6b7",
    "queue": "#f6d77a",
}
LABELS = {
    "compute": "useful work",
    "checkpoint": "checkpoint (line: commit)",
    "mirror_wait": "waiting for the mirror (finish, stop)",
    "overhead": "start-up / restore / shut-down",
    "lost": "lost work (redone after a failure)",
    "unrecorded": "end not recorded (lost or idle)",
    "queue": "waiting (queue, or until rerun)",
}
#: How an outcome is labelled where it is not its own name.
_OUTCOME = {UNKNOWN: "no end event"}


def _unit(span: float) -> tuple[float, str]:
    if span >= 3 * 3600:
        return 3600.0, "hours"
    if span >= 180:
        return 60.0, "minutes"
    return 1.0, "seconds"


def _row_label(a: Mapping[str, Any]) -> str:
    parts = [f"#{a['index']}"]
    if a.get("job_id") is not None:
        parts.append(f"job {a['job_id']}")
    if a.get("restart_count") is not None and a.get("job_id") is not None:
        parts.append(f"restart {a['restart_count']}")
    if a.get("chain_count"):
        parts.append(f"chain {a['chain_count']}")
    return "\n".join([parts[0], " ".join(parts[1:])]) if len(parts) > 1 else parts[0]


def _panel_text(report: Mapping[str, Any]) -> str:
    tm, ck, iv, fl = report["time"], report["checkpoints"], report["interval"], report["failures"]
    run = tm["run_seconds"] or 0.0
    wall = tm["wall_seconds"] or 0.0

    def share(v: float | None, of: float) -> str:
        return f"{100 * (v or 0.0) / of:5.1f}%" if of > 0 else "    -"

    lines = [
        "Where the run time went",
        f"  useful work   {share(tm['useful_seconds'], run)}",
        f"  checkpoints   {share(tm['checkpoint_seconds'], run)}",
        f"  start/restore {share(tm['overhead_seconds'], run)}",
        f"  lost work     {share(tm['lost_seconds'], run)}",
        f"  run {dur(run)}, wall {dur(wall)}",
        f"  waiting {dur(tm['queue_seconds'])}",
    ]
    if tm.get("mirror_wait_seconds"):
        lines.insert(4, f"  mirror wait   {share(tm['mirror_wait_seconds'], run)}")
    if tm["unrecorded_seconds"]:
        lines.append(f"  unrecorded {dur(tm['unrecorded_seconds'])}")
    lines += [
        "",
        f"Checkpoints: {ck['count']}",
        f"  cost mean {dur(ck['mean_seconds'])}",
        f"  cost max  {dur(ck['max_seconds'])}",
    ]
    if ck["by_reason"]:
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in ck["by_reason"].items()))
    lines += ["", "Interval", f"  used  {dur(iv['used_seconds'])}"]
    if fl["mtbf_seconds"] is None:
        lines.append("  no failure observed")
        if iv["young_lower_bound_seconds"] is not None:
            lines.append(f"  Young >= {dur(iv['young_lower_bound_seconds'])}")
    else:
        lines += [
            f"  Young {dur(iv['young_seconds'])}",
            f"  Daly  {dur(iv['daly_seconds'])}",
            f"  (MTBF {dur(fl['mtbf_seconds'])}: {fl['count']} failure"
            f"{'s' if fl['count'] != 1 else ''})",
        ]
    return "\n".join(lines)


def plot_report(
    report: Mapping[str, Any], path: str | os.PathLike[str], *, title: str | None = None
) -> None:
    """Draw the timeline of ``report`` (:func:`~hpcckpt.report.analysis.analyze`) into ``path``.

    ``title`` (e.g. the directory) goes before the counts of attempts, checkpoints and
    failures in the figure's title.

    The format follows the file name's extension (``.png``, ``.svg``, ``.pdf``).
    Raises ImportError if matplotlib is missing, OSError if ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    attempts = report["attempts"]
    n = max(1, len(attempts))
    span = max(
        [s["end"] for a in attempts for s in a["segments"]] + [a["end"] or 0.0 for a in attempts]
        or [1.0]
    )
    span = span if span > 0 else 1.0
    scale, unit = _unit(span)

    # Inches: title 0.9 on top, x label and legend 1.3 below, 0.8 per attempt, and at
    # least the height of the side panel's text.
    fig_h = max(4.8, 2.2 + 0.8 * n)
    fig = plt.figure(figsize=(11.5, fig_h), dpi=110)
    top, bottom = 1 - 0.9 / fig_h, 1.3 / fig_h
    ax = fig.add_axes((0.09, bottom, 0.64, top - bottom))

    height = 0.6
    used: set[str] = set()
    for row, a in enumerate(attempts):
        y = row
        for kind in (
            "queue",
            "overhead",
            "mirror_wait",
            "compute",
            "lost",
            "unrecorded",
            "checkpoint",
        ):
            bars = [
                (s["start"] / scale, (s["end"] - s["start"]) / scale)
                for s in a["segments"]
                if s["kind"] == kind
            ]
            if not bars:
                continue
            used.add(kind)
            hatch = "////" if kind == "unrecorded" else None
            ax.broken_barh(
                bars,
                (y - height / 2, height),
                facecolors=COLORS[kind],
                edgecolor=COLORS["lost"] if kind == "unrecorded" else "none",
                linewidth=0,
                hatch=hatch,
            )
        commits = [s["end"] / scale for s in a["segments"] if s["kind"] == "checkpoint"]
        if commits:
            ax.vlines(
                commits,
                y - height / 2,
                y + height / 2,
                colors=COLORS["checkpoint"],
                linewidth=1.6,
            )
        outcome = _OUTCOME.get(a["outcome"], a["outcome"])
        if a["outcome"] == STOPPED and a.get("stop_reason"):
            outcome += f" ({a['stop_reason']})"
        if a.get("requeued"):
            outcome += ", requeued"
        if a.get("launches", 1) > 1:
            outcome += f" ({a['launches']} launches)"
        lost = a["seconds"].get("lost") or 0.0
        if lost:
            outcome += f", lost {dur(lost)}"
        end = max([s["end"] for s in a["segments"]] + [a["end"] or 0.0]) / scale
        ax.text(
            end + span / scale * 0.01,
            y,
            outcome,
            va="center",
            ha="left",
            fontsize=8.5,
            color="#c62828" if a["outcome"] == "crashed" else "#333333",
        )

    ax.set_yticks(range(len(attempts)))
    ax.set_yticklabels([_row_label(a) for a in attempts], fontsize=9)
    ax.set_ylim(n - 0.5, -0.5)  # attempt 1 on top
    ax.set_xlim(0, span / scale * 1.2)
    ax.set_xlabel(f"time since the first attempt started ({unit})")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    for spine in ("top", "right"):
        ax.spines[spine].set_visible(False)

    handles: list[Any] = []
    for kind in SEGMENT_KINDS:
        if kind not in used and kind not in ("compute", "checkpoint", "lost"):
            continue
        if kind == "checkpoint":
            handles.append(Line2D([], [], color=COLORS[kind], lw=2, label=LABELS[kind]))
            continue
        handles.append(
            Patch(
                facecolor=COLORS[kind],
                edgecolor=COLORS["lost"] if kind == "unrecorded" else "none",
                hatch="////" if kind == "unrecorded" else None,
                label=LABELS[kind],
            )
        )
    fig.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.07, 0.01),
        ncol=3,
        fontsize=8.5,
        frameon=False,
    )
    fig.text(
        0.76,
        top,
        _panel_text(report),
        va="top",
        ha="left",
        family="monospace",
        fontsize=8.2,
        bbox={"boxstyle": "round,pad=0.6", "facecolor": "#f6f6f6", "edgecolor": "#cccccc"},
    )

    eff = report["efficiency"]
    fl = report["failures"]
    counts = (
        f"{len(attempts)} attempt{'s' if len(attempts) != 1 else ''}, "
        f"{report['checkpoints']['count']} checkpoints, "
        f"{fl['count']} failure{'s' if fl['count'] != 1 else ''}"
    )
    title = counts if title is None else f"{title}: {counts}"
    fig.suptitle(
        f"{title}\nuseful-work efficiency {pct(eff['run'])} of run time, "
        f"{pct(eff['wall'])} of wall time (with waiting)",
        fontsize=11,
        x=0.02,
        ha="left",
    )
    try:
        fig.savefig(os.fspath(path))
    finally:
        plt.close(fig)
