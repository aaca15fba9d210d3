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
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"
CHAIN_COUNT_ENV = "HPCCKPT_CHAIN_COUNT"
ATTEMPT_ENV = "HPCCKPT_ATTEMPT"


def _count(value: str | None) -> int | None:
    value = (value or "").strip()
    return int(value) if value.isdigit() else None


def job_context(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Slurm and wrapper identifiers worth stamping on every event (absent when unknown)."""
    env = os.environ if environ is None else environ
    ctx: dict[str, Any] = {}
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if job:
        ctx["job_id"] = job
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:  # the task's unambiguous name (hpcckpt.job.jobid)
        ctx["array_task"] = f"{array_job}_{array_task}"
    restarts = _count(env.get("SLURM_RESTART_COUNT")) or 0
    ctx["restart_count"] = restarts
    chain = _count(env.get(CHAIN_COUNT_ENV))
    if chain is not None:
        ctx["chain_count"] = chain
    ctx["restart"] = restarts + (chain or 0)
    attempt = env.get(ATTEMPT_ENV)
    if attempt:
        ctx["attempt"] = attempt
    ntasks = _count(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS"))
    if ntasks:
        ctx["nranks"] = ntasks
    return ctx


def append_event(directory: str | os.PathLike[str], kind: str, **fields: Any) -> dict[str, Any]:
    """Append one event; returns the record written."""
    record: dict[str, Any] = {"time": round(time.time(), 6), "event": kind, **job_context()}
    record.update(fields)
    line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    path = Path(directory) / EVENTS_FILE
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return record


def read_events(directory: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the events in file order, skipping a torn last line from a crash."""
    path = Path(directory) / EVENTS_FILE
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            yield record
