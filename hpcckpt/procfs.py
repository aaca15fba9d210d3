"""What Linux's ``/proc`` says about processes: the one place that parses it.

Stdlib only, a leaf every layer may import (the store's lock, the wrapper, the local
cluster). Everything answers "nothing" rather than raising when a process is gone or
``/proc`` is absent (another OS): callers treat that as "not running".
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import NamedTuple


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name: ``[state, ppid, ...]``
    (field 3 of proc(5) is index 0), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()
    return fields or None


def command_name(pid: int) -> str | None:
    """The process's command name (``/proc/PID/comm``, e.g. ``slurmstepd``), None when gone."""
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def parent_of(pid: int) -> int | None:
    """The parent's pid, None when the process is gone."""
    fields = stat_fields(pid)
    try:
        return int(fields[1]) if fields else None
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int | str) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22), or None."""
    fields = stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    fields = stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    """The process's argument vector (empty when gone or a kernel thread)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


class MemoryArea(NamedTuple):
    """One line of ``/proc/PID/maps``: a virtual memory area of the process."""

    start: int
    end: int
    perms: str  # e.g. "rw-p": read, write, execute, p(rivate) or s(hared)
    inode: int
    path: str  # "" for anonymous memory, "[heap]", "[stack]", or the mapped file

    @property
    def private_anonymous(self) -> bool:
        """Private memory backed by no file: only this process's writes change it."""
        anonymous = self.path in ("", "[heap]") or self.path.startswith("[anon:")
        return self.perms[3:4] == "p" and self.inode == 0 and anonymous


def memory_maps(pid: int | str = "self") -> list[MemoryArea]:
    """The process's memory areas, sorted by address (empty when unreadable)."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        lo, _, hi = fields[0].partition("-")
        try:
            start, end, inode = int(lo, 16), int(hi, 16), int(fields[4])
        except ValueError:
            continue
        out.append(MemoryArea(start, end, fields[1], inode, fields[5] if len(fields) > 5 else ""))
    return out


def environ(pid: int) -> dict[str, str]:
    """The process's environment as it was started (empty when unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def environs_with(key: str) -> dict[int, dict[str, str]]:
    """``{pid: environment}`` of every process whose environment has ``key``."""
    found = {}
    for pid in all_pids():
        env = environ(pid)
        if key in env:
            found[pid] = env
    return found


def topmost(pids: set[int]) -> list[int]:
    """Those of ``pids`` whose parent is not one of them (a rank started through ``sh -c``
    is the shell, as its launcher sees it), sorted."""
    return sorted(pid for pid in pids if parent_of(pid) not in pids)


def all_pids() -> list[int]:
    """Every process id in ``/proc``."""
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def self_and_ancestors() -> set[int]:
    """This process and every process above it (up to, not including, init)."""
    pids = set()
    pid: int | None = os.getpid()
    while pid is not None and pid > 1 and pid not in pids:
        pids.add(pid)
        pid = parent_of(pid)
    return pids


def parent_map() -> dict[int, int]:
    """``{pid: parent pid}`` of every process."""
    parents = {}
    for pid in all_pids():
        parent = parent_of(pid)
        if parent is not None:
            parents[pid] = parent
    return parents


def descends_from(pid: int, ancestors: set[int], parents: Mapping[int, int]) -> bool:
    """True if one of ``ancestors`` is above ``pid`` in ``parents``."""
    seen = set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        pid = parents.get(pid, 0)
        if pid in ancestors:
            return True
    return False


def descendants(pid: int) -> dict[int, int]:
    """``{pid: start ticks}`` of every process below ``pid`` (empty without /proc)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for child in all_pids():
        fields = stat_fields(child)
        try:
            parent, start = int(fields[1]), int(fields[19])  # type: ignore[index]
        except (TypeError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(child)
        starts[child] = start
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = starts[child]
                todo.append(child)
    return found


def alive(processes: Mapping[int, int]) -> dict[int, int]:
    """Those of ``{pid: start ticks}`` still running (same pid, same start, not a zombie)."""
    out = {}
    for pid, start in processes.items():
        fields = stat_fields(pid)
        try:
            same = fields is not None and int(fields[19]) == start and fields[0] != "Z"
        except (IndexError, ValueError):
            same = False
        if same:
            out[pid] = start
    return out


def process_start_monotonic() -> float:
    """When this process was exec'd, on the ``time.monotonic()`` clock (Linux; else now).

    Elapsed times in the wrapper's log then count from its exec, which is what matters
    when judging how early Slurm's signal came.
    """
    now = time.monotonic()
    ticks = start_ticks("self")
    if ticks is None:
        return now
    try:
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return now
    return now - age if 0 <= age < 86400 * 365 else now
