"""The run-status file: how the application tells the wrapper how its step ended.

The Checkpointer (rank 0) writes ``DIR/hpcckpt-status.json`` atomically at three
moments: ``running`` once its signal handlers are installed, ``stopped`` after the
checkpoint taken on a stop request (signal or deadline), ``finished`` when the
application calls ``finish()``. The wrapper passes a fresh attempt token in
``HPCCKPT_ATTEMPT``; a status carrying another token is stale and ignored.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpcckpt.atomicfile import atomic_write

STATUS_FILE = "hpcckpt-status.json"

RUNNING = "running"
STOPPED = "stopped"
FINISHED = "finished"
STATES = (RUNNING, STOPPED, FINISHED)


@dataclass
class RunStatus:
    """One snapshot of what the application reported."""

    state: str
    attempt: str | None = None
    step: int | None = None
    reason: str = ""
    time: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"run status state must be one of {STATES}, not {self.state!r}")


def status_path(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / STATUS_FILE


def write_status(directory: str | os.PathLike[str], status: RunStatus) -> None:
    """Replace the status file atomically (write a temporary file, then rename)."""
    path = status_path(directory)
    text = json.dumps(asdict(status)) + "\n"
    atomic_write(path, text, mode=None, temp=f".{path.name}.{os.getpid()}.tmp")


def read_status(directory: str | os.PathLike[str]) -> RunStatus | None:
    """The last status written, or None if there is none or it cannot be parsed."""
    try:
        data = json.loads(status_path(directory).read_text())
        return RunStatus(**{k: data[k] for k in data if k in RunStatus.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None
