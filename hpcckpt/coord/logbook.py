"""What the Checkpointer writes down about a save or a restore: its log lines and the
fields of its events, as functions of the store's result; and where its lines go.

Kept apart from the Checkpointer so that its methods keep only the sequence of a save;
tests and ``hpcckpt report`` read this text and these fields, so they change here or
nowhere (docs/events.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcckpt.policy import requeue_lead
from hpcckpt.policy.durations import format_duration
from hpcckpt.rundir import events as job_events
from hpcckpt.rundir import verbosity
from hpcckpt.store.results import STAGED, RestoreResult, SaveResult
from hpcckpt.store.store import MirrorWait, PendingSave

log = logging.getLogger("hpcckpt")


def configure_logging(rank: int, level: int) -> None:
    """One stderr handler with a rank prefix: rank 0's info lines, every rank's warnings.

    ``level`` (``HPCCKPT_LOG_LEVEL``, set by the wrapper's --quiet/--verbose): quiet keeps
    warnings only; verbose shows every rank's lines and the debug details.
    """
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"hpcckpt[{rank}] %(message)s"))
    log.addHandler(handler)
    if level == verbosity.QUIET:
        log.setLevel(logging.WARNING)
    elif level == verbosity.VERBOSE:
        log.setLevel(logging.DEBUG)
    else:
        log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


@dataclass(frozen=True)
class SaveRecord:
    """A committed save, written down: the info ``line``, the ``checkpoint`` event's
    ``fields``, a ``warning`` when the save turned write tracking off, and what follows
    the event: (info line, (event, fields)) of each (``bad_mark_cleared``)."""

    line: str
    fields: dict[str, Any]
    warning: str | None = None
    after: tuple[tuple[str, tuple[str, dict[str, Any]]], ...] = ()


def upcoming(stop: str | None, interval: float | None, every_steps: int | None) -> str:
    """The line's tail: "stopping", "next in 5 min" or "next in N steps"."""
    if stop:
        return "stopping"
    if interval is not None:
        return f"next in {format_duration(interval)}"
    return f"next in {every_steps} steps"


def kind_text(result: SaveResult, incremental: bool) -> str:
    """ "incremental (3.1 % of blocks)", "full (why not a delta)" or "full"."""
    if result.kind == "incremental":
        return f"incremental ({100 * result.dirty_fraction:.1f} % of blocks)"
    if result.full_reason and incremental:
        return f"full ({result.full_reason})"
    return "full"


def how_text(result: SaveResult, redundancy: str | None) -> str:
    """How it was written: in the background, on the node-local tier, or (synchronous)
    how the changed blocks were found; "" when none applies."""
    if result.write_path is not None:
        found = (
            f"kernel: {result.pages_written} page{'s' * (result.pages_written != 1)} written"
            if result.change_detection == "kernel"
            else "hashes"
        )
        return f" ({found}, {result.bytes_hashed / 2**20:.1f} MiB hashed)"
    if result.tier != "directory":
        return " on the node-local tier" + (f" with {redundancy} redundancy" if redundancy else "")
    if result.blocked_seconds is not None:
        return f" in the background (blocked {result.blocked_seconds:.2f} s)"
    return ""


def committed(
    result: SaveResult,
    reason: str,
    *,
    stop: str | None,
    interval: float | None,
    every_steps: int | None,
    cost_estimate: float,
    redundancy: str | None,
    incremental: bool,
) -> SaveRecord:
    """The log line and ``checkpoint`` event of a committed save. ``interval``: seconds to
    the next save (None: ``every_steps`` count); ``redundancy``: the node-local tier's;
    ``incremental``: whether deltas are on (a full save then says why it is full)."""
    rate = result.bytes_written / result.seconds / 1e6 if result.seconds > 0 else float("inf")
    line = (
        f"checkpoint step {result.step}: {kind_text(result, incremental)}, "
        f"{result.bytes_written / 2**20:.1f} MiB in {result.seconds:.2f} s ({rate:.0f} MB/s)"
        f"{how_text(result, redundancy)}, {reason}; {upcoming(stop, interval, every_steps)}"
    )
    extra: dict[str, Any] = {}
    if result.blocked_seconds is not None:
        extra["blocked_seconds"] = round(result.blocked_seconds, 6)
    if result.staging is not None:
        extra.update(staging_mode=result.staging, staging_bytes=result.staging_bytes)
    if result.write_path is not None:
        extra.update(
            write_path=result.write_path,
            change_detection=result.change_detection,
            pages_written=result.pages_written,
            bytes_hashed=result.bytes_hashed,
        )
    warning = None
    if result.tracking_audit is not None:
        extra["tracking_audit"] = result.tracking_audit
        warning = f"write tracking is off for the rest of this run: {result.tracking_audit}"
    if result.tier != "directory":
        extra["tier"] = result.tier  # a node-local checkpoint, not drained
    fields = {
        "step": result.step,
        "seconds": round(result.seconds, 6),
        "bytes": result.bytes_written,
        "save_kind": result.kind,  # "full" or "incremental"
        "full_reason": result.full_reason,
        "dirty": round(result.dirty_fraction, 6),
        "reason": reason,
        "path": result.path.name,
        "next_interval": interval,
        "cost_estimate": round(cost_estimate, 6),
        "peak_rss": result.peak_rss,
        **extra,
    }
    after: list[tuple[str, tuple[str, dict[str, Any]]]] = []
    if result.cleared_bad_mark is not None:
        after.append(
            (
                f"checkpoint step {result.step}: {result.path.name} replaces a file marked bad "
                f"({result.cleared_bad_mark}); its mark is removed",
                (
                    job_events.BAD_MARK_CLEARED,
                    {
                        "step": result.step,
                        "path": result.path.name,
                        "reason": result.cleared_bad_mark,
                    },
                ),
            )
        )
    return SaveRecord(line, fields, warning, tuple(after))


def writer_line(decision: dict[str, Any]) -> str:
    """The writer's choice after it measured direct against buffered writes."""
    return (
        f"writer: {decision['path']} writes for {decision['size_group_bytes'] / 2**20:.0f} MiB "
        f"per rank (direct {decision['direct_mb_s']:.0f} MB/s, "
        f"buffered {decision['buffered_mb_s']:.0f} MB/s)"
    )


def staged(pending: PendingSave, blocked: float, cache: Path | None) -> tuple[str, dict[str, Any]]:
    """The debug line and ``checkpoint_staged`` event of a save staged in memory or in the
    node-local ``cache``, whose write goes on in the background."""
    where = "in memory" if cache is None else f"in {cache}"
    line = (
        f"checkpoint step {pending.step} staged {where} in {blocked:.3f} s; "
        "writing in the background"
    )
    fields = {
        "step": pending.step,
        "blocked_seconds": round(blocked, 6),
        # A deferred save: the ranks decide its kind and size in the background.
        "bytes": pending.bytes_total if pending.written is not None else None,
        "save_kind": pending.written.kind if pending.written is not None else STAGED,
        "staging": "memory" if cache is None else "cache",
        "staging_mode": pending.staging,
    }
    return line, fields


def restored(
    result: RestoreResult | None,
    set_aside: list[tuple[int, str, str, str]],
    redundancy: str | None,
    directory: Path,
) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """The info line and the events of a restore from ``directory`` (``result`` None:
    nothing to restore): the node-local files set aside, the checkpoints skipped, and
    ``restore`` itself (which ranks were rebuilt and, with a redundant tier, moved)."""
    events = [
        (job_events.LOCAL_SET_ASIDE, {"step": step, "node": node, "file": name, "reason": why})
        for step, node, name, why in set_aside
    ]
    if result is None:
        line = f"no checkpoint in {directory}: starting from the beginning"
        return line, [*events, (job_events.RESTORE, {"step": None})]
    events += [(job_events.SKIP_BAD, {"step": s, "reason": why}) for s, why in result.skipped]
    events += [
        (job_events.LOCAL_SKIPPED, {"step": s, "reason": why}) for s, why in result.local_skipped
    ]
    how = ""
    if result.rebuilt:
        ranks = ", ".join(map(str, result.rebuilt))
        how = f" (rank {ranks} rebuilt from {result.rebuilt_from})"
    where = {"cache": "node-local copy ", "mirror": "the mirror's copy of "}.get(result.source, "")
    line = f"restored step {result.step} from {where}{result.path.name}{how}"
    fields: dict[str, Any] = {"step": result.step, "path": result.path.name, "tier": result.source}
    if result.skipped_keys or result.added_keys or result.ignored_keys:  # strict=False
        line += f"; {keys_text(result)}"
        fields.update(
            skipped_keys=list(result.skipped_keys),
            added_keys=list(result.added_keys),
            ignored_keys=list(result.ignored_keys),
        )
    if result.source == "cache" and redundancy is not None:
        fields.update(
            rebuilt=list(result.rebuilt), rebuilt_from=result.rebuilt_from, moved=list(result.moved)
        )
    return line, [*events, (job_events.RESTORE, fields)]


@dataclass(frozen=True)
class MirrorCut:
    """A mirror wait cut short for the job's end time: ``mirror_wait`` as set (``wait``),
    the seconds it was cut to (``bound``), and the job's end time (Unix seconds) and the
    seconds to it when the wait began (``left``)."""

    wait: float
    bound: float
    job_end: float
    left: float


def mirror_waited(
    waited: MirrorWait,
    reason: str,
    where: Path | str | None = None,
    cut: MirrorCut | None = None,
) -> tuple[str, dict[str, Any]]:
    """The line (info when it arrived, else a warning) and the ``mirror_wait`` event of a
    ``finish()`` or stop that waited for the newest checkpoint to reach the mirror;
    ``where``: the checkpoint directory, ``cut``: how the wait was cut for the job's end."""
    step, seconds = waited.step, waited.seconds
    if waited.done:
        line = f"mirror: step {step} is on the mirror ({reason}, waited {seconds:.1f} s)"
    else:
        newest = waited.newest_mirrored
        have = "nothing yet" if newest is None else f"step {newest}"
        line = (
            f"mirror: step {step} did not reach the mirror within {seconds:.0f} s ({reason}"
            + ("" if cut is None else f"; {_cut_text(cut, reason)}")
            + f"); the mirror holds {have} from this run"
            + (f"; last failure: {waited.error}" if waited.error else "")
            + "; the checkpoint directory keeps it"
            + ("" if where is None else f" ({where}) and {_next_copy(reason)}")
        )
    fields = {
        "step": step,
        "done": waited.done,
        "seconds": round(seconds, 3),
        "reason": reason,
        "newest_mirrored": waited.newest_mirrored,
        "error": waited.error,
    }
    if cut is not None:
        fields.update(cut_to=round(cut.bound, 3), job_end=cut.job_end)
    return line, fields


def _cut_text(cut: MirrorCut, reason: str) -> str:
    after = "take the step down and requeue the job" if reason == "stop" else "end the job"
    return (
        f"mirror_wait {cut.wait:g} s cut for the time limit: the job ends in {cut.left:.0f} s "
        f"and the wrapper needs {requeue_lead():g} s after the ranks to {after}"
    )


def _next_copy(reason: str) -> str:
    if reason == "stop":
        return "the next run copies it"
    return "a run started on it with this mirror copies it"


def keys_text(result: RestoreResult) -> str:
    """What a ``restore(strict=False)`` did with the keys that differ, in words."""
    parts = []
    if result.skipped_keys:
        parts.append(f"left {list(result.skipped_keys)} as they were (not in the checkpoint)")
    if result.added_keys:
        parts.append(f"added {list(result.added_keys)} (not in the state)")
    if result.ignored_keys:
        parts.append(f"ignored {list(result.ignored_keys)} (no longer in the object)")
    return "strict=False: " + ", ".join(parts)


def stop_reason(stop: str, signal_name: str | None) -> str:
    """Why the run stops, in words: "signal USR1", "deadline"..."""
    return f"signal {signal_name}" if stop == "signal" and signal_name else stop
