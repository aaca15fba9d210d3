"""The restart budget: after a crash, continue from the last checkpoint, or give up?

A crashed attempt is continued (requeued or chained) only when both hold:

- **budget**: fewer than ``max_restarts`` crash continuations were spent on this
  computation. They are counted in ``DIR/events.jsonl``: every ``requeue``/``chain``
  event with ``cause: "crash"`` since the last ``wrapper_start`` whose restart number
  (``SLURM_RESTART_COUNT`` + ``HPCCKPT_CHAIN_COUNT``) was 0, i.e. since the computation
  was submitted by hand, and every ``relaunch`` on spare nodes and every requeue or
  chain with ``cause: "node_failure"``. Continuations after a time-limit or
  preemption stop do not count: a long computation may need any number of those. If
  the log cannot be read, the restart number itself is used (every earlier restart
  counts as a crash).
- **progress**: the attempt wrote a checkpoint of its own (a ``checkpoint`` or
  ``restart_set`` event carrying its attempt token), or it ran for at least
  ``min_progress`` seconds. An application that fails before its first checkpoint every
  time would otherwise be requeued until the budget ran out, each time repeating the
  same failure from the same checkpoint.

Pure functions over event records: no I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcckpt.rundir import events as ev

DEFAULT_MAX_RESTARTS = 5
DEFAULT_MIN_PROGRESS = 300.0  # seconds
#: Events that mean "this attempt saved its state": the checkpoints it paid for.
PROGRESS_EVENTS = ev.COST_EVENTS
CONTINUE_EVENTS = (ev.REQUEUE, ev.CHAIN)
CRASH_CAUSE = "crash"
NODE_FAILURE_CAUSE = "node_failure"
#: Continuations that spend the budget: after a crash, and after a node failure (a
#: relaunch on spare nodes, or a requeue).
FAILURE_CAUSES = (CRASH_CAUSE, NODE_FAILURE_CAUSE)


def crash_restarts_used(events: Iterable[Mapping[str, Any]]) -> int:
    """Crash continuations since the computation was last submitted by hand."""
    used = 0
    for record in events:
        kind = record.get("event")
        if kind == ev.WRAPPER_START and ev.restart_of(record) == 0:
            used = 0
        elif kind in (*CONTINUE_EVENTS, ev.RELAUNCH) and record.get("cause") in FAILURE_CAUSES:
            used += 1
    return used


def progress_of(events: Iterable[Mapping[str, Any]], attempt: str) -> dict[str, Any] | None:
    """The newest checkpoint (or restart set) this attempt wrote, or None."""
    found = None
    for record in events:
        if record.get("event") in PROGRESS_EVENTS and record.get("attempt") == attempt:
            found = dict(record)
    return found


@dataclass(frozen=True)
class CrashDecision:
    restart: bool
    used: int  # crash continuations spent before this crash
    max_restarts: int
    progress: str  # what counted as progress, or why there was none
    message: str


def decide_after_crash(
    events: list[Mapping[str, Any]] | None,
    *,
    attempt: str,
    restart: int,
    runtime: float,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    min_progress: float = DEFAULT_MIN_PROGRESS,
) -> CrashDecision:
    """Continue after this crash, or give up? ``events``: the log (None if unreadable)."""
    used = restart if events is None else crash_restarts_used(events)
    saved = None if events is None else progress_of(events, attempt)
    if saved is not None:
        where = f" at step {saved['step']}" if saved.get("step") is not None else ""
        progress = f"it wrote a checkpoint{where}"
    elif runtime >= min_progress:
        progress = f"it ran {runtime:.0f} s (>= --min-progress {min_progress:g} s)"
    else:
        progress = ""
    if not progress:
        return CrashDecision(
            False,
            used,
            max_restarts,
            f"no checkpoint, {runtime:.0f} s of runtime (< --min-progress {min_progress:g} s)",
            "giving up: the attempt crashed before writing any checkpoint and after only "
            f"{runtime:.0f} s (--min-progress {min_progress:g} s); starting again would most "
            "likely repeat the same failure from the same checkpoint",
        )
    if used >= max_restarts:
        return CrashDecision(
            False,
            used,
            max_restarts,
            progress,
            f"giving up: {used} restart(s) after crashes already (--max-restarts {max_restarts})",
        )
    return CrashDecision(
        True,
        used,
        max_restarts,
        progress,
        f"restarting from the last good checkpoint ({progress}); crash restart "
        f"{used + 1} of {max_restarts}",
    )
