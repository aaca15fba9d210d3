"""Names in a checkpoint directory and what they mean.

A committed checkpoint is ``ckpt-<step>.h5`` (step zero-padded to 10 digits). A file
being written is ``ckpt-<step>.h5.partial``: never read by restore, removed by the
next save. A checkpoint found corrupt gets a sidecar ``ckpt-<step>.h5.bad`` (JSON
with the reason) and is skipped from then on; nothing is deleted silently.

A mark belongs to the file it judged: it records that file's inode, size and mtime, and
holds only while the file at that name is still that one. A new file of the step (a run
that fell back and saved that step again) is judged afresh; its commit removes the mark
(:func:`clear_marks`), and a mark left behind by a crash in between is ignored. A mark
without that record (written by an older hpcckpt) holds while the file is older than the
mark; one that is not hpcckpt's JSON (``touch ckpt-<step>.h5.bad``) always holds.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcckpt.store.io.durability import atomic_write, fsync_path
from hpcckpt.store.io.safety import FILE_MODE

PREFIX = "ckpt-"
SUFFIX = ".h5"
PARTIAL = ".partial"
BAD = ".bad"
#: Left by rank 0 while a restore reads a checkpoint; still there = that read killed us.
READING = ".reading"
#: Suffix of a checkpoint kept aside because its state failed the check (coord/validate.py).
REJECTED = ".rejected"
#: Sidecar next to it: JSON with the step, the ranks and their problems.
REJECTED_INFO = ".rejected.json"
_NAME = re.compile(r"^ckpt-(\d{10,})\.h5$")
_PARTIAL_NAME = re.compile(r"^ckpt-(\d{10,})\.h5\.partial$")


def checkpoint_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, not {step}")
    return f"{PREFIX}{step:010d}{SUFFIX}"


def step_of(name: str) -> int | None:
    """The step of a committed checkpoint file name, or None for any other name."""
    match = _NAME.match(name)
    return int(match.group(1)) if match else None


def partial_step(name: str) -> int | None:
    """The step of a ``.partial`` file name, or None for any other name."""
    match = _PARTIAL_NAME.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class Entry:
    step: int
    path: Path
    bad_reason: str | None

    @property
    def good_candidate(self) -> bool:
        return self.bad_reason is None


def scan(directory: str | os.PathLike[str]) -> list[Entry]:
    """Committed checkpoints in ``directory``, newest step first."""
    root = Path(directory)
    entries = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    present = set(names)
    for name in names:
        step = step_of(name)
        if step is None:
            continue
        reason = read_bad(root / name) if name + BAD in present else None
        entries.append(Entry(step, root / name, reason))
    entries.sort(key=lambda e: e.step, reverse=True)
    return entries


def partials(directory: str | os.PathLike[str]) -> list[Path]:
    root = Path(directory)
    try:
        return sorted(
            root / n for n in os.listdir(root) if n.startswith(PREFIX) and n.endswith(PARTIAL)
        )
    except FileNotFoundError:
        return []


#: The reason of a mark that says none (made by hand, or unreadable).
MARKED = "marked bad"


def mark_bad(path: Path, reason: str) -> None:
    """Record that a checkpoint failed verification, and which file it was (see the
    module's docs); keeps the data for inspection."""
    record: dict[str, Any] = {"reason": reason, "time": time.time()}
    try:
        record["file"] = _identity(path)
    except OSError:  # no file to judge: the mark says so by leaving the record out
        pass
    sidecar = path.with_name(path.name + BAD)
    # Durable, as clear_bad is: a restore after a crash must not take the file again.
    atomic_write(sidecar, json.dumps(record) + "\n", mode=FILE_MODE, temp=sidecar.name + ".tmp")


def _identity(path: Path) -> dict[str, int]:
    """What tells one file at ``path`` from the next one put there (a link is not followed)."""
    st = os.lstat(path)
    return {"inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _judged_another(path: Path, record: dict[str, Any]) -> bool:
    """Whether the mark ``record`` judged another file than the one now at ``path``."""
    try:
        st = os.lstat(path)
    except OSError:  # nothing there to restore: the mark may stand
        return False
    judged = record.get("file")
    if isinstance(judged, dict):
        return [judged.get(k) for k in ("inode", "size", "mtime_ns")] != [
            st.st_ino,
            st.st_size,
            st.st_mtime_ns,
        ]
    when = record.get("time")  # an older hpcckpt's mark: a file newer than it is another
    return isinstance(when, (int, float)) and not isinstance(when, bool) and st.st_mtime > when


def _mark_reason(sidecar: Path) -> tuple[str, dict[str, Any]] | None:
    """(reason, record) of the mark ``sidecar``; None when there is none."""
    try:
        text = sidecar.read_text()
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # there, but not readable: it still marks the file
        return MARKED, {}
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        return MARKED, {}  # made by hand
    reason = record.get("reason")
    return (MARKED if reason is None else str(reason)), record


def clear_bad(path: Path) -> None:
    """Remove a checkpoint's bad mark (durably: restore must not find it again after a
    crash); only for a checkpoint that has just verified in every byte."""
    path.with_name(path.name + BAD).unlink()
    fsync_path(path.parent)


def read_bad(path: Path) -> str | None:
    """Why checkpoint ``path`` is marked bad; None when it is not, or when its mark judged
    another file than the one now there (see the module's docs)."""
    found = _mark_reason(path.with_name(path.name + BAD))
    if found is None or _judged_another(path, found[1]):
        return None
    return found[0]


def clear_marks(path: Path) -> str | None:
    """A new file was just committed at ``path``: the bad mark and the restore's reading
    marker beside it judged the file it replaced, and are removed. The reason the bad
    mark gave (None: there was none). Not fsynced: a mark that comes back after a crash
    judged another file, and :func:`read_bad` ignores it."""
    sidecar = path.with_name(path.name + BAD)
    found = _mark_reason(sidecar)
    sidecar.unlink(missing_ok=True)
    path.with_name(path.name + READING).unlink(missing_ok=True)
    return None if found is None else found[0]


def set_aside_name(name: str) -> str:
    """A node-local manifest (a rank's copy, or its redundancy) found damaged: renamed
    ``<name>.bad``, so no restore lists it again; its data stays for inspection."""
    return name + BAD


def rejected_name(step: int) -> str:
    """``ckpt-<step>.h5.rejected``: a file restore never reads."""
    return checkpoint_name(step) + REJECTED


def rejected_files(directory: str | os.PathLike[str]) -> list[Path]:
    """Rejected checkpoints kept in ``directory``, oldest step first."""
    root = Path(directory)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(root / n for n in names if n.startswith("ckpt-") and n.endswith(".h5" + REJECTED))


def rejected_step(name: str) -> int | None:
    """The step of a ``ckpt-<step>.h5.rejected`` file name, or None."""
    if not name.endswith(REJECTED):
        return None
    return step_of(name[: -len(REJECTED)])


def read_rejected_info(path: Path) -> dict[str, Any]:
    """The sidecar of a rejected checkpoint (empty when missing or unreadable)."""
    try:
        data = json.loads(path.with_name(path.name + ".json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
