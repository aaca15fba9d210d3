"""The report as text for a terminal (``hpcckpt report DIR``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcckpt.report import mirror, saves, tiers
from hpcckpt.report.format import dur, pct, size
from hpcckpt.report.model import STOPPED


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
        f"; useful-work efficiency {pct(eff['run'])} of run time, "
        f"{pct(eff['wall'])} of wall time"
    )
    lines.append("")
    lines.append("Attempts")
    header = (
        f"  {'#':>2}  {'job':<10} {'restart':>7}  {'start':>8} {'duration':>9} "
        f"{'waited':>8}  {'restored':>8} {'reached':>8} {'saved':>8} {'ckpts':>5} "
        f"{'lost':>8}  outcome"
    )
    lines.append(header)
    for a in atts:
        job = str(a["job_id"]) if a["job_id"] is not None else "-"
        if a.get("array_task"):
            job = str(a["array_task"])  # A_T: which task of the array
        restart = a["restart_count"] if a["restart_count"] is not None else "-"
        if a["chain_count"]:
            restart = f"{restart}/c{a['chain_count']}"
        restored = "new" if a["restored_step"] is None else str(a["restored_step"])
        reached = "?" if a.get("reached_step") is None else str(a["reached_step"])
        saved = "-" if a["last_saved_step"] is None else str(a["last_saved_step"])
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
            f"  {a['index']:>2}  {job:<10} {restart!s:>7}  {dur(a['start']):>8} "
            f"{dur(a['duration']):>9} {dur(a['wait_before']):>8}  {restored:>8} {reached:>8} "
            f"{saved:>8} {a['checkpoints']:>5} {dur(lost) if lost else '0':>8}  {outcome}"
        )
    lines.extend(node_failure_lines(report))
    given_up = report.get("gave_up")
    if given_up:
        lines.append("")
        lines.append(f"Not continued ({_CAUSES.get(given_up['cause'], given_up['cause'])})")
        lines.append(f"  {given_up['reason'] or '(no reason recorded)'}")
    lines.append("")
    lines.append("Checkpoints")
    if ck["count"]:
        reasons = ", ".join(f"{k} {v}" for k, v in ck["by_reason"].items())
        lines.append(
            f"  {ck['count']} committed ({reasons}); cost (the store's write and commit of "
            f"one save) mean {dur(ck['mean_seconds'])}, max {dur(ck['max_seconds'])}"
        )
        lines.append(
            f"  written per save: mean {size(ck['mean_bytes'])} (array data and state trees "
            f"of all ranks), {size(ck['total_bytes'])} in all"
        )
        if ck["by_kind"]:
            lines.append("  kinds: " + ", ".join(f"{k} {v}" for k, v in ck["by_kind"].items()))
        lines.extend(saves.format_lines(ck.get("saves")))
    else:
        lines.append("  none committed")
    if ck["skipped_bad"]:
        lines.append(f"  {ck['skipped_bad']} bad checkpoint(s) skipped at restore")
    if ck["uncommitted"]:
        lines.append(f"  {ck['uncommitted']} checkpoint(s) begun and never committed")
    lines.append("")
    lines += tiers.format_restores(report.get("restores") or [])
    lines += mirror.format_mirror(report.get("mirror"))
    lines.append("Time")
    lines.append(
        f"  wall {dur(tm['wall_seconds'])} = run {dur(tm['run_seconds'])} "
        f"+ waiting between attempts {dur(tm['queue_seconds'])}"
        + (
            f" + end not recorded {dur(tm['unrecorded_seconds'])}"
            if tm["unrecorded_seconds"]
            else ""
        )
    )
    run = tm["run_seconds"] or 0.0
    for key, label in (
        ("useful_seconds", "useful work"),
        ("checkpoint_seconds", "writing checkpoints"),
        ("mirror_wait_seconds", "waiting for the mirror"),
        ("overhead_seconds", "start-up, restore, shut-down"),
        ("lost_seconds", "lost to failures (redone)"),
    ):
        v = tm.get(key) or 0.0
        if key == "mirror_wait_seconds" and not v:
            continue
        share = f" ({100 * v / run:.1f}% of run)" if run > 0 else ""
        lines.append(f"  {label:<30} {dur(v):>9}{share}")
        if key == "checkpoint_seconds" and v and tm.get("checkpoint_store_seconds") is not None:
            lines.append(
                f"    the store {dur(tm['checkpoint_store_seconds'])} (the saves' costs; "
                f"staged: the time blocked), around it {dur(tm['checkpoint_other_seconds'])} "
                "(state check, pruning, heartbeats, events)"
            )
    if tm["unrecorded_seconds"]:
        lines.append(
            "  an attempt ended without a final event (run it under `hpcckpt run/srun` for "
            "exact figures): the time after its last event is counted as 'end not recorded'"
        )
    lines.append("")
    lines.append("Interval")
    iv, fl = report["interval"], report["failures"]
    used = (
        f"used {dur(iv['used_seconds'])} between checkpoints (measured)"
        if iv["used_seconds"] is not None
        else "no regular checkpoint to measure the interval (only on stop requests)"
    )
    lines.append(
        f"  {used}"
        + (
            f", policy {dur(iv['configured_seconds'])}"
            if iv["configured_seconds"] is not None
            else ""
        )
        + f"; checkpoint cost {dur(iv['cost_seconds'])}"
    )
    if fl["mtbf_seconds"] is None:
        lines.append(f"  {fl['note']}")
        if iv["young_lower_bound_seconds"] is not None:
            lines.append(
                f"  Young's interval would be at least {dur(iv['young_lower_bound_seconds'])}"
                " (MTBF >= run time)"
            )
    else:
        lines.append(
            f"  MTBF {dur(fl['mtbf_seconds'])} ({fl['note']}); Young {dur(iv['young_seconds'])}"
            f", Daly {dur(iv['daly_seconds'])}"
        )
        if iv["model_efficiency_used"] is not None:
            lines.append(
                f"  expected efficiency: {pct(iv['model_efficiency_used'])} at the interval "
                f"used, {pct(iv['model_efficiency_daly'])} at Daly's"
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


_CAUSES = {
    "no_progress": "runs in a row stopped before keeping anything new",
    "crash": "after a crash",
    "poisoned": "the application rejected its state",
}

_ACTIONS = {
    "relaunch": "relaunched on the spare node(s) inside the allocation",
    "requeue": "requeued by the wrapper (no spare left)",
    "requeued_by_slurm": "requeued by Slurm",
    "give_up": "not continued: restart budget spent",
    "none": "not continued",
}


def node_failure_lines(report: Mapping[str, Any]) -> list[str]:
    """The "Node failures" section of the text report (empty if there was none)."""
    failures = report.get("node_failures") or []
    if not failures:
        return []
    lines = ["", "Node failures"]
    for f in failures:
        cost = [f"lost {dur(f['lost_seconds'])}"]
        if f["queue_seconds"] is not None:
            cost.append(f"queue wait {dur(f['queue_seconds'])}")
        if f["resume_seconds"] is not None:
            cost.append(f"resumed {dur(f['resume_seconds'])} later")
        seen = " (seen at the next start)" if f["detected"] == "at_restart" else ""
        lines.append(
            f"  attempt {f['attempt'] or '?'}: node {f['node']} failed at {dur(f['time'])}"
            f"{seen}; {_ACTIONS.get(str(f['action']), str(f['action']))}; " + ", ".join(cost)
        )
    return lines
