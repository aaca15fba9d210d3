"""How much memory this process may still take, and how much it has used: /proc and cgroups.

A staged save copies the state into host memory; before it does, it asks how much
memory is left: the kernel's ``MemAvailable`` (free memory plus what the page cache can
give back), or less when the process sits in a memory cgroup with a limit (a Slurm job
with ``ConstrainRAMSpace``, a ``systemd-run -p MemoryMax=`` scope): the limit minus the
cgroup's usage, its reclaimable file pages given back. cgroup v2 and the v1 memory
controller are both read. The peak resident set (``VmHWM``) can be reset
(``/proc/self/clear_refs``), so each save reports its own peak.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

#: A cgroup v1 "no limit" is the largest page-aligned int64; anything above this is none.
_NO_LIMIT = 1 << 60
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _kib_field(path: str, field: str) -> int | None:
    """A ``Name:  value kB`` field of a /proc file (``meminfo``, ``self/status``) in bytes."""
    try:
        with open(path, encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name == field:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _meminfo(field: str) -> int | None:
    return _kib_field("/proc/meminfo", field)


def _status(field: str) -> int | None:
    """A memory field of this process (``VmRSS``, ``VmHWM``) in bytes."""
    return _kib_field("/proc/self/status", field)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _NO_LIMIT else value


def _stat(path: Path, *names: str) -> int:
    """Sum of the named fields of a cgroup's ``memory.stat``."""
    total = 0
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in names:
                total += int(value)
    except (OSError, ValueError):
        pass
    return total


def _cgroup_paths() -> tuple[str | None, str | None]:
    """(v2 path, v1 memory controller path) of this process, from ``/proc/self/cgroup``."""
    v2 = v1 = None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def cgroup_room(root: Path = _CGROUP_ROOT) -> int | None:
    """Bytes this process's memory cgroup may still take (the tightest limit up its tree,
    minus usage, plus reclaimable file pages), or None when no limit applies."""
    v2, v1 = _cgroup_paths()
    rooms: list[int] = []
    if v1 is not None:
        base = root / "memory" / v1.lstrip("/")
        stat = base / "memory.stat"
        limit = _read_int(base / "memory.limit_in_bytes")
        hier = _stat(stat, "hierarchical_memory_limit") or None
        limits = [x for x in (limit, hier) if x is not None and x < _NO_LIMIT]
        usage = _read_int(base / "memory.usage_in_bytes")
        if limits and usage is not None:
            reclaimable = _stat(stat, "total_inactive_file")
            rooms.append(min(limits) - usage + reclaimable)
    if v2 is not None and (root / "cgroup.controllers").exists():
        node = root / v2.lstrip("/")
        while True:
            limit = _read_int(node / "memory.max")
            usage = _read_int(node / "memory.current")
            if limit is not None and usage is not None:
                rooms.append(limit - usage + _stat(node / "memory.stat", "inactive_file"))
            if node == root or root not in node.parents:
                break
            node = node.parent
    return max(0, min(rooms)) if rooms else None


#: Bytes this process mapped and is populating in a background thread (a staging
#: reservation, a node-local data file): not yet out of ``MemAvailable``, already spoken for.
_promised = 0
_promised_lock = threading.Lock()


def promise(nbytes: int) -> None:
    """``nbytes`` are being populated in the background: count them as taken until
    :func:`settle` (two reservations made at once must not both count them as free)."""
    global _promised
    with _promised_lock:
        _promised += nbytes


def settle(nbytes: int) -> None:
    """The ``nbytes`` of a :func:`promise` are populated (or given up)."""
    global _promised
    with _promised_lock:
        _promised = max(0, _promised - nbytes)


def available_bytes() -> int | None:
    """Memory this process may still take: ``MemAvailable``, or its cgroup's room if less,
    less what it is still populating (:func:`promise`)."""
    values = [v for v in (_meminfo("MemAvailable"), cgroup_room()) if v is not None]
    return max(0, min(values) - _promised) if values else None


def rss_bytes() -> int:
    """This process's resident set now (0 where /proc is missing)."""
    return _status("VmRSS") or 0


def peak_rss_bytes() -> int:
    """This process's largest resident set since it started or since :func:`reset_peak`."""
    return _status("VmHWM") or 0


def reset_peak() -> None:
    """Make the peak resident set start again from the current one (Linux >= 4.0)."""
    try:
        fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
    except OSError:
        return
    try:
        os.write(fd, b"5")
    except OSError:
        pass
    finally:
        os.close(fd)
