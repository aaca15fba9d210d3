"""The event log: one JSON object per line in ``DIR/events.jsonl``.

Both the wrapper and the Checkpointer (rank 0 only) append to it. Each line is
written with a single ``write`` on an ``O_APPEND`` descriptor, so concurrent
writers on one node never interleave within a line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"


def job_context() -> dict[str, Any]:
    """Slurm identifiers worth stamping on every event (absent outside Slurm)."""
    ctx: dict[str, Any] = {}
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        ctx["job_id"] = job
    restarts = os.environ.get("SLURM_RESTART_COUNT")
    ctx["restart_count"] = int(restarts) if restarts and restarts.isdigit() else 0
    chain = os.environ.get("HPCCKPT_CHAIN_COUNT")
    if chain and chain.isdigit():
        ctx["chain_count"] = int(chain)
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
        text = path.read_text()
    except FileNotFoundError:
        return
    for line in text.splitlines():
        try:
            yield json.loads(line)
        except ValueError:
            continue
