"""The reliability suite's record: every fault injected and what came of it.

Tests add rows with the ``reliability_log`` fixture (``log.add(table, **row)``). At the
end of the session the tables are written to ``.pytest_cache/hpcckpt-reliability.txt``
(or ``$HPCCKPT_RELIABILITY_REPORT``) and echoed in pytest's terminal summary, whatever
``-s``/``-q`` say, so a plain ``make test`` shows the phase x outcome matrix.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

TITLES = {
    "crash": "Crash at every phase (SIGKILL via HPCCKPT_FAULT), then restore + next save",
    "corruption": "Corruption of the newest checkpoint: verify, then restore falls back",
    "disk": "Full disk (tmpfs)",
    "lock": "Two jobs on one directory",
    "hostile": "Hostile or foreign files",
    "permissions": "Permissions",
}


class ReliabilityLog:
    def __init__(self) -> None:
        self.tables: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.unwritten: str | None = None  # why the report file could not be written

    def add(self, table: str, **row: Any) -> None:
        self.tables[table].append(row)

    def render(self) -> list[str]:
        lines: list[str] = []
        for table in list(TITLES) + sorted(set(self.tables) - set(TITLES)):
            rows = self.tables.get(table)
            if not rows:
                continue
            keys = list(dict.fromkeys(k for row in rows for k in row))
            cells = [[str(row.get(k, "")) for k in keys] for row in rows]
            widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
            lines.append(f"{TITLES.get(table, table)}:")
            lines.append("  " + "  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
            lines.extend(
                "  " + "  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True))
                for cell in cells
            )
            lines.append("")
        lines.extend(self.figures())
        return lines

    def figures(self) -> list[str]:
        crash = self.tables.get("crash", [])
        corr = self.tables.get("corruption", [])
        out = []
        if crash:
            ok = sum(1 for r in crash if r.get("outcome") == "recovered")
            out.append(f"crashes injected: {len(crash)}, recovered to the newest committed: {ok}")
        if corr:
            tried = sum(int(r.get("tried", 1)) for r in corr)
            detected = sum(int(r.get("detected", 0)) for r in corr)
            harmless = sum(int(r.get("harmless", 0)) for r in corr)
            wrong = sum(int(r.get("wrong", 0)) for r in corr)
            crashed = sum(int(r.get("crashed", 0)) for r in corr)
            hung = sum(int(r.get("hung", 0)) for r in corr)
            out.append(
                f"corruptions tried: {tried}, detected: {detected}, harmless (data restored "
                f"exactly): {harmless}, wrong data restored: {wrong}, hung: {hung}, "
                f"process killed by an HDF5 crash: {crashed}"
            )
        for table in ("disk", "lock", "hostile", "permissions"):
            rows = self.tables.get(table, [])
            if rows:
                ok = sum(1 for r in rows if r.get("outcome") == "ok")
                out.append(f"{table}: {ok}/{len(rows)} cases as guaranteed")
        return out


_LOG = ReliabilityLog()
#: When this process loaded the plugin: a report file older than that is a past run's.
_STARTED = time.time()


@pytest.fixture(scope="session")
def reliability_log() -> ReliabilityLog:
    return _LOG


def _report_path(config: pytest.Config) -> Path:
    given = os.environ.get("HPCCKPT_RELIABILITY_REPORT")
    return Path(given) if given else config.rootpath / ".pytest_cache" / "hpcckpt-reliability.txt"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:  # noqa: ARG001
    """Write the table where this session ran the reliability tests (under ``pytest -n``, a
    worker: the controller prints the file)."""
    if not _LOG.tables:
        return
    path = _report_path(session.config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(_LOG.render()) + "\n")
    except OSError as exc:
        _LOG.unwritten = f"(could not write {path}: {exc})"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    path = _report_path(config)
    if _LOG.unwritten:
        lines, where = _LOG.render(), _LOG.unwritten
    elif path.exists() and path.stat().st_mtime >= _STARTED:
        lines, where = path.read_text().splitlines(), f"(written to {path})"
    else:
        return
    terminalreporter.write_sep("=", "hpcckpt reliability: faults injected and outcomes")
    for line in lines:
        terminalreporter.write_line(line)
    terminalreporter.write_line(where)
