"""The event log: one JSON object per line in ``DIR/events.jsonl`` (schema: docs/events.md).

Both the wrapper and the Checkpointer (rank 0 only) append to it. Each line is
written with a single ``write`` on an ``O_APPEND`` descriptor, so concurrent
writers on one node never interleave within a line.

Every record carries ``time``, ``event``, ``restart_count`` and, when known, ``job_id``,
``chain_count``, ``restart`` (the sum of both counts), ``attempt`` (the wrapper's token
from ``HPCCKPT_ATTEMPT``) and ``nranks`` (``SLURM_NTASKS``); explicit fields win.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from hpcckpt.rundir.env import ATTEMPT_ENV, CHAIN_COUNT_ENV, chain_count
from hpcckpt.slurm import env as slurm_env
from hpcckpt.slurm import jobid

EVENTS_FILE = "events.jsonl"

# -- event names (docs/events.md) -------------------------------------------------------------
# written by the wrapper
WRAPPER_START = "wrapper_start"
SIGNAL = "signal"
SIGNAL_FORWARDED = "signal_forwarded"
STEP_END = "step_end"
FINISHED = "finished"
CRASHED = "crashed"
STOPPED = "stopped"
REQUEUE = "requeue"
REQUEUE_FAILED = "requeue_failed"
CHAIN = "chain"
CHAIN_FAILED = "chain_failed"
CHAIN_SUBMITTED = "chain_submitted"
GIVE_UP = "give_up"
HANG = "hang"
HANG_KILLED = "hang_killed"
LEAD_TIME_WARNING = "lead_time_warning"
NODE_FAILURE = "node_failure"
RELAUNCH = "relaunch"
CHECKPOINT_REQUEST = "checkpoint_request"
RESTART_SET = "restart_set"
RESTART_SET_FAILED = "restart_set_failed"
RESTART_TIMEOUT = "restart_timeout"
RESTART_FILES_CHECKED = "restart_files_checked"
RESTART_FILES_CUT = "restart_files_cut"
SIGNAL_DELIVERED = "signal_delivered"
NOT_BATCH_SHELL = "not_batch_shell"
END_TIME_STOP = "end_time_stop"
END_TIME_MOVED = "end_time_moved"
PREEMPTED = "preempted"
CANCELLED = "cancelled"
# written by the Checkpointer's rank 0
START = "start"
RESTORE = "restore"
SKIP_BAD = "skip_bad"
CHECKPOINT_BEGIN = "checkpoint_begin"
CHECKPOINT_STAGED = "checkpoint_staged"
CHECKPOINT = "checkpoint"
CHECKPOINT_FAILED = "checkpoint_failed"
REJECTED = "rejected"
STOP = "stop"
FINISH = "finish"
STAGING_REFUSED = "staging_refused"
LOCAL_SKIPPED = "local_skipped"
LOCAL_SET_ASIDE = "local_set_aside"
WRITE_PATH = "write_path"
BAD_MARK_CLEARED = "bad_mark_cleared"
# the Checkpointer's mirror (second tier), from rank 0's background copy
MIRRORED = "mirrored"
MIRROR_FAILED = "mirror_failed"
MIRROR_PRUNED = "mirror_pruned"
MIRROR_WAIT = "mirror_wait"

#: Events whose ``seconds`` is what one checkpoint cost (the Checkpointer's, or the
#: restart files of an application without the API): also what counts as progress.
COST_EVENTS = (CHECKPOINT, RESTART_SET)
#: Wrapper events that end an attempt's run of the application: an attempt without any
#: was cut off (its wrapper died with its node, or was SIGKILLed).
END_EVENTS = frozenset(
    {
        STEP_END,
        FINISHED,
        CRASHED,
        STOPPED,
        REQUEUE,
        REQUEUE_FAILED,
        CHAIN,
        CHAIN_FAILED,
        CHAIN_SUBMITTED,
        GIVE_UP,
        CANCELLED,
    }
)

# -- the outcome of a step, as ``step_end`` records it ------------------------------------------
OUTCOME_FINISHED = "finished"  # the work is done
OUTCOME_STOPPED = "stopped"  # it checkpointed on a stop request: continue later
OUTCOME_CRASHED = "crashed"  # anything else
OUTCOME_POISONED = "poisoned"  # crashed after rejecting its state: no restart


def restart_number(environ: Mapping[str, str] | None = None) -> int:
    """``SLURM_RESTART_COUNT`` + ``HPCCKPT_CHAIN_COUNT``: how many runs came before."""
    env = os.environ if environ is None else environ
    return slurm_env.restart_count(env) + chain_count(env)


def restart_of(event: Mapping[str, Any]) -> int:
    """The restart number an event was written in (older records lack ``restart``)."""
    value = event.get("restart")
    if isinstance(value, int):
        return value
    total = 0
    for key in ("restart_count", "chain_count"):
        v = event.get(key)
        total += v if isinstance(v, int) else 0
    return total


def checkpoint_costs(
    events: Iterable[Mapping[str, Any]], kinds: Iterable[str] = COST_EVENTS
) -> list[float]:
    """The measured ``seconds`` of every checkpoint in the log, in order (the one reading
    of "what a checkpoint costs" from the events)."""
    wanted = tuple(kinds)
    return [
        float(ev["seconds"])
        for ev in events
        if ev.get("event") in wanted and isinstance(ev.get("seconds"), (int, float))
    ]


def job_context(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Slurm and wrapper identifiers worth stamping on every event (absent when unknown)."""
    env = os.environ if environ is None else environ
    ctx: dict[str, Any] = {}
    job = slurm_env.job_id(env)
    if job:
        ctx["job_id"] = job
    task = jobid.identity(env)
    if task.is_array_task:  # the task's unambiguous name
        ctx["array_task"] = task.target
    restarts = slurm_env.restart_count(env)
    ctx["restart_count"] = restarts
    if (env.get(CHAIN_COUNT_ENV) or "").strip().isdigit():
        ctx["chain_count"] = chain_count(env)
    ctx["restart"] = restarts + chain_count(env)
    attempt = env.get(ATTEMPT_ENV)
    if attempt:
        ctx["attempt"] = attempt
    ntasks = slurm_env.ntasks(env)
    if ntasks:
        ctx["nranks"] = ntasks
    return ctx


def _line(kind: str, fields: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    record: dict[str, Any] = {"time": round(time.time(), 6), "event": kind, **job_context()}
    record.update(fields)
    return record, (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()


def _open(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)


def append_event(directory: str | os.PathLike[str], kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event; returns the record written."""
    record, line = _line(kind, fields)
    fd = _open(Path(directory) / EVENTS_FILE)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return record


class EventLog:
    """One writer's appends to ``DIR/events.jsonl`` through a descriptor kept open until
    :meth:`close`: an event costs one write, not an open and a close (each a request to
    the metadata server on Lustre or GPFS), and with ``O_APPEND`` each line still lands
    whole after every other writer's. Thread-safe (the mirror's thread reports too)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / EVENTS_FILE
        self._fd: int | None = None
        self._lock = threading.Lock()

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one event; returns the record written."""
        record, line = _line(kind, fields)
        with self._lock:
            if self._fd is None:
                self._fd = _open(self.path)
            os.write(self._fd, line)
        return record

    def close(self) -> None:
        """Close the descriptor (a later event opens it again)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def read_log(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of an event-log file in order, skipping lines that are not
    (a torn last line after a crash, garbage). Raises FileNotFoundError if absent."""
    text = Path(path).read_text(errors="replace")
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record


def read_events(directory: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the events of ``DIR/events.jsonl`` in file order (none if there is no log)."""
    try:
        yield from read_log(Path(directory) / EVENTS_FILE)
    except FileNotFoundError:
        return
