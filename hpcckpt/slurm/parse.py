"""What Slurm's clients print, parsed once: ``scontrol show job``, ``squeue``, ``sinfo``.

Pure functions over text (no command is run here; :mod:`hpcckpt.slurm.commands` runs
them). A node counts as *failed* when ``sinfo`` reports it ``down``, ``fail``/``failing``
or not responding (a trailing ``*``): what Slurm shows after a node stopped answering
for ``SlurmdTimeout``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime

# What squeue prints for %e when there is no end time.
_NO_TIME = {"", "unknown", "n/a", "none", "invalid"}
# `scontrol show job -o` prints KEY=VALUE pairs separated by spaces; a value may contain
# spaces (Command= shows the script's arguments joined by spaces), so split before
# every " Key=" rather than at every space.
_PAIR_START = re.compile(r" (?=[A-Za-z][A-Za-z0-9_:/]*=)")
_SLURM_TIME = "%Y-%m-%dT%H:%M:%S"


def parse_end_time(text: str) -> datetime | None:
    """Parse squeue's ``%e`` (``2026-11-22T04:15:00``, local time); None for ``Unknown``/``N/A``.

    Only the first non-empty line counts (a heterogeneous job prints one per component).
    Raises ValueError for anything else.
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if first.lower() in _NO_TIME:
        return None
    try:
        return datetime.strptime(first, _SLURM_TIME)
    except ValueError:
        raise ValueError(f"unexpected end time from squeue: {first!r}") from None


def parse_show_job(text: str) -> dict[str, str]:
    """``scontrol show job -o`` output (first line) as a dict of strings."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    info: dict[str, str] = {}
    for part in _PAIR_START.split(line):
        key, sep, value = part.partition("=")
        if sep and key not in info:
            info[key] = value.strip()
    return info


def config_seconds(text: str, key: str) -> float | None:
    """A duration of ``scontrol show config`` (``KillWait = 30 sec``) in seconds; None when
    the key is missing or its value is not ``N sec``."""
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            words = value.split()
            if len(words) == 2 and words[1] == "sec" and words[0].isdigit():
                return float(words[0])
            if len(words) == 1 and words[0].isdigit():
                return float(words[0])
            return None
    return None


def requeue_allowed(job: Mapping[str, str]) -> bool | None:
    """``scontrol show job`` fields: may the job be requeued (``Requeue=1``)? None when
    they do not say. ``Requeue=0``: submitted with ``--no-requeue``, or without
    ``--requeue`` where ``JobRequeue=0`` is the site's default."""
    return {"1": True, "0": False}.get(job.get("Requeue", "").strip())


def parse_sinfo(text: str) -> dict[str, str]:
    """``sinfo -h -N -o "%N %T"`` output -> ``{node: state}`` (states lower case)."""
    states: dict[str, str] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) >= 2:
            states[parts[0]] = parts[1].lower()
    return states


def parse_sinfo_reasons(text: str) -> dict[str, tuple[str, float | None]]:
    """``sinfo -h -R -N -o "%N|%H|%E"`` -> ``{node: (reason, when set as Unix time or None)}``."""
    out: dict[str, tuple[str, float | None]] = {}
    for line in (text or "").splitlines():
        parts = line.split("|", 2)
        if len(parts) != 3:
            continue
        try:
            when: float | None = datetime.strptime(parts[1], _SLURM_TIME).timestamp()
        except ValueError:
            when = None
        out[parts[0]] = (parts[2].strip(), when)
    return out


def parse_job_ids(text: str) -> list[str]:
    """``squeue -h -o %i`` (or ``-s`` for steps): the ids, one per word."""
    return (text or "").split()


def is_cancelled(job: Mapping[str, str]) -> bool:
    """``scontrol show job`` fields of a job being cancelled (``scancel``): ``CANCELLED``, or
    ``COMPLETING`` with no reason while its processes are killed (at the time limit the
    reason is ``TimeLimit``; a preemption or a node failure name theirs too)."""
    state, reason = job.get("JobState", ""), job.get("Reason", "")
    return state == "CANCELLED" or (state == "COMPLETING" and reason in ("", "None"))


def is_failed(state: str) -> bool:
    """A ``sinfo %T`` state meaning the node is lost: down, fail(ing), not responding (``*``)."""
    s = (state or "").strip().lower()
    if not s:
        return False
    base = s.rstrip("*~#!%$@^-").split("+")[0]
    return s.endswith("*") or base in ("down", "fail", "failing")


def is_usable(state: str) -> bool:
    """A ``sinfo %T`` state of a node that answers and can run jobs."""
    return not state.endswith("*") and state.split("+")[0] in (
        "idle",
        "mixed",
        "allocated",
        "completing",
    )
