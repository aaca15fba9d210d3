"""How the wrapper's parts tell what they decide: one log line, one event.

The wrapper is the only writer of both (its job log on stderr, ``DIR/events.jsonl``);
the parts that decide (continuation, lead time, node failures) get it as a
:class:`Reporter`, nothing more.
"""

from __future__ import annotations

from typing import Any, Protocol

from hpcckpt.rundir import verbosity

#: Levels of log lines: shown even with --quiet, or only with --verbose.
WARN, DETAIL = verbosity.QUIET, verbosity.VERBOSE


class Reporter(Protocol):
    """Where a decision is told: the job log and the event log."""

    def log(self, message: str, level: int = verbosity.NORMAL) -> None: ...

    def event(self, kind: str, **fields: Any) -> bool:
        """Append an event; False if it could not be written."""
        ...
