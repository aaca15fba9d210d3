"""Restart files of applications without the Python API: when complete, checksums, sets.

An application launched by ``hpcckpt run/srun --app-signal SIG --restart-files GLOB``
writes its own restart files when it receives SIG. The wrapper cannot see inside them;
it watches the files matching GLOB (relative paths: from the wrapper's working
directory):

- **complete** (:meth:`RestartFiles.poll`): with ``--restart-marker FILE``, once FILE was
  written after the signal; otherwise once every matching file was written after the
  signal (its mtime is not older than the signal) and none changed — size and
  nanosecond mtime — for ``settle`` seconds. The measured cost is the time from the
  signal to the last change.
- **registered** (:meth:`RestartFiles.register`): each file is checksummed (xxh3-128)
  and copied into ``DIR/restart-sets/<n>/`` with a ``manifest.json`` written last
  (temporary file, rename). A set directory without a manifest is incomplete and is
  ignored. The newest ``keep`` sets stay. Copies rather than hard links: an application
  that rewrites its file in place (``open(..., "w")``) would truncate a hard link too.
- **checked at start** (:meth:`RestartFiles.ensure_good`): the live files are compared
  with the newest manifest; if any is missing or differs (the previous attempt died
  while writing), the damaged file is moved aside and the newest good set is copied back.
- **cut files of a series set aside** (:meth:`RestartFiles.set_aside_cut`): a code that
  writes a *new* file each time (``restart.1000.bin``, ``restart.2000.bin``) and reads the
  newest one it finds would read a file cut mid-write. So at the start, a live file that
  is newer than the newest good set and in no kept set (its checksum matches no kept
  copy), or that was still being written when the previous step died (``unfinished.json``,
  written by the wrapper), is moved into ``DIR/restart-sets/cut/``: never deleted, and the
  application's older files are never touched.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from hpcckpt.atomicfile import atomic_path, atomic_write

SETS_DIR = "restart-sets"
MANIFEST = "manifest.json"
#: Where cut files of a series are moved at the start (under the sets directory).
CUT_DIR = "cut"
#: The files a write under way had touched when the step died (written by the wrapper).
UNFINISHED = "unfinished.json"
DEFAULT_SETTLE = 2.0
DEFAULT_KEEP = 2
_CHUNK = 4 << 20
#: File-system timestamps can lag the clock a little (coarse mtime granularity).
_MTIME_SLACK_NS = 50_000_000


def checksum(path: str | os.PathLike[str]) -> str:
    """xxh3-128 of the file's content, hex."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


@dataclass
class PendingSet:
    """A checkpoint the wrapper asked for and is watching."""

    signal_wall_ns: int  # time.time_ns() when the signal was sent
    signal_mono: float
    stop: bool  # the checkpoint before a stop (time limit, preemption)
    seen: dict[str, tuple[int, int]] = field(default_factory=dict)
    last_change_mono: float = 0.0
    last_change_wall: float = 0.0
    #: Seconds without a change that make the files complete, when more than ``settle``:
    #: twice the longest pause seen after they had looked complete once.
    quiet: float = 0.0


@dataclass
class RegisteredSet:
    number: int
    path: Path
    files: list[dict[str, Any]]
    seconds: float | None
    bytes: int


class RestartFiles:
    """Watch, register and restore one application's restart files."""

    def __init__(
        self,
        patterns: Sequence[str],
        ckpt_dir: str | os.PathLike[str],
        *,
        marker: str | None = None,
        settle: float = DEFAULT_SETTLE,
        keep: int = DEFAULT_KEEP,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        base = Path(cwd or os.getcwd())
        self.patterns = [str(p if Path(p).is_absolute() else base / p) for p in patterns]
        self.marker = None if marker is None else str(Path(base, marker))
        self.sets_dir = Path(ckpt_dir) / SETS_DIR
        self.settle = float(settle)
        self.keep = max(1, int(keep))

    # -- what exists -----------------------------------------------------------------
    def current(self) -> list[str]:
        """The live files matching the patterns (sorted, without the sets directory)."""
        found: set[str] = set()
        sets = str(self.sets_dir) + os.sep
        for pattern in self.patterns:
            for path in glob.glob(pattern):
                if os.path.isfile(path) and not path.startswith(sets) and path != self.marker:
                    found.add(os.path.abspath(path))
        return sorted(found)

    def sets(self) -> list[tuple[int, Path, dict[str, Any]]]:
        """Complete sets (those with a readable manifest), oldest first."""
        out = []
        try:
            entries = list(self.sets_dir.iterdir())
        except OSError:
            return []
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                manifest = json.loads((entry / MANIFEST).read_text())
            except (OSError, ValueError):
                continue
            out.append((int(entry.name), entry, manifest))
        return sorted(out, key=lambda item: item[0])

    def newest(self) -> tuple[int, Path, dict[str, Any]] | None:
        sets = self.sets()
        return sets[-1] if sets else None

    # -- watching a checkpoint -------------------------------------------------------
    def begin(self, stop: bool) -> PendingSet:
        return PendingSet(time.time_ns(), time.monotonic(), stop)

    def written_since(self, pending: PendingSet) -> bool:
        """Was any restart file (or the marker) written since ``pending``'s signal?"""
        since = pending.signal_wall_ns - _MTIME_SLACK_NS
        paths = [*self.current(), *([self.marker] if self.marker is not None else [])]
        return any((st := _stat(p)) is not None and st[1] >= since for p in paths)

    def poll(self, pending: PendingSet) -> bool:
        """Advance the watch; True once the restart files are complete (see module doc)."""
        now = time.monotonic()
        since = pending.signal_wall_ns - _MTIME_SLACK_NS
        snapshot = {p: s for p in self.current() if (s := _stat(p)) is not None}
        if self.marker is not None:
            mark = _stat(self.marker)
            snapshot[self.marker] = mark if mark is not None else (-1, 0)
        if snapshot != pending.seen:
            pending.seen = snapshot
            pending.last_change_mono = now
            newest = max((m for _, m in snapshot.values()), default=0)
            pending.last_change_wall = max(newest / 1e9, pending.signal_wall_ns / 1e9)
            return False
        if now - pending.last_change_mono < max(self.settle, pending.quiet):
            return False
        if self.marker is not None:
            mark = snapshot.get(self.marker)
            return mark is not None and mark[1] >= since and len(snapshot) > 1
        return bool(snapshot) and all(m >= since for _, m in snapshot.values())

    def cost(self, pending: PendingSet) -> float:
        """Seconds from the signal to the last change of the files."""
        return max(0.0, pending.last_change_wall - pending.signal_wall_ns / 1e9)

    # -- registering -----------------------------------------------------------------
    def register(
        self, *, attempt: str, seconds: float | None, paths: Sequence[str] | None = None
    ) -> RegisteredSet:
        """Checksum the live files (``paths``: only these, the files one write burst of a
        series wrote) and copy them into a new set; prune old sets."""
        files = sorted(paths) if paths is not None else self.current()
        if not files:
            raise OSError("no restart files match " + " ".join(self.patterns))
        newest = self.newest()
        number = (newest[0] + 1) if newest else 1
        while (self.sets_dir / str(number)).exists():
            number += 1
        target = self.sets_dir / str(number)
        target.mkdir(parents=True, mode=0o700)
        entries = []
        total = 0
        newest_ns = 0
        for i, path in enumerate(files):
            newest_ns = max(newest_ns, os.stat(path).st_mtime_ns)
            name = f"{i:04d}-{os.path.basename(path)}"
            shutil.copy2(path, target / name)
            digest = checksum(target / name)
            size = (target / name).stat().st_size
            total += size
            entries.append({"path": path, "name": name, "size": size, "xxh3_128": digest})
        manifest = {
            "set": number,
            "time": round(time.time(), 6),
            "attempt": attempt,
            "seconds": None if seconds is None else round(seconds, 6),
            "bytes": total,
            "newest_mtime_ns": newest_ns,
            "files": entries,
        }
        atomic_write(
            target / MANIFEST, json.dumps(manifest, indent=1), mode=None, temp=f".{MANIFEST}.tmp"
        )
        self.prune()
        return RegisteredSet(number, target, entries, seconds, total)

    def prune(self) -> list[int]:
        """Delete all but the newest ``keep`` complete sets, and incomplete leftovers."""
        complete = self.sets()
        keep = {n for n, _, _ in complete[-self.keep :]}
        removed = []
        try:
            entries = list(self.sets_dir.iterdir())
        except OSError:
            return removed
        newest = max(keep, default=0)
        for entry in entries:
            if not entry.name.isdigit() or int(entry.name) in keep:
                continue
            if int(entry.name) > newest and not (entry / MANIFEST).exists():
                continue  # possibly being written right now by someone else
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(int(entry.name))
        return sorted(removed)

    # -- at start --------------------------------------------------------------------
    def verify_live(self, manifest: dict[str, Any]) -> list[str]:
        """Problems of the live files against ``manifest`` (empty: they match)."""
        return [problem for _, problem in self._live_problems(manifest)]

    def _live_problems(self, manifest: dict[str, Any]) -> list[tuple[str, str]]:
        problems = []
        for entry in manifest.get("files", []):
            path = entry["path"]
            st = _stat(path)
            if st is None:
                problems.append(("", f"{path} is missing"))
            elif st[0] != entry["size"]:
                problems.append((path, f"{path} has {st[0]} bytes, not {entry['size']}"))
            elif checksum(path) != entry["xxh3_128"]:
                problems.append((path, f"{path} has a different checksum"))
        return problems

    def ensure_good(self) -> tuple[int | None, list[str]]:
        """Make the live files the newest good set; (set number or None, what was wrong).

        Also verifies the stored copies; a damaged set is skipped for an older one.
        """
        wrong: list[str] = []
        for number, path, manifest in reversed(self.sets()):
            bad = [
                e["name"]
                for e in manifest.get("files", [])
                if not (path / e["name"]).is_file() or checksum(path / e["name"]) != e["xxh3_128"]
            ]
            if bad:
                wrong.append(f"set {number} is damaged ({', '.join(bad)}); trying an older one")
                continue
            found = self._live_problems(manifest)
            if not found:
                return number, wrong
            wrong.extend(problem for _, problem in found)
            self.move_aside([path for path, _ in found if path])  # never deleted
            for entry in manifest["files"]:
                dest = Path(entry["path"])
                dest.parent.mkdir(parents=True, exist_ok=True)
                # Not durable: a copy a crash cuts fails this check at the next start,
                # and is copied back again.
                temp = f".{dest.name}.hpcckpt-restore"
                with atomic_path(dest, mode=None, durable=False, temp=temp) as tmp:
                    shutil.copy2(path / entry["name"], tmp)
            return number, wrong
        return None, wrong

    # -- a series: files cut mid-write -------------------------------------------------
    @property
    def cut_dir(self) -> Path:
        return self.sets_dir / CUT_DIR

    def note_unfinished(self, paths: Sequence[str]) -> None:
        """Record the files a write under way had touched when the step died (empty: none)."""
        target = self.sets_dir / UNFINISHED
        if not paths:
            target.unlink(missing_ok=True)
            return
        self.sets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write(target, json.dumps(sorted(paths)), mode=None, temp=f".{UNFINISHED}.tmp")

    def cut_candidates(self) -> list[str]:
        """Live files of the series that a step died writing (see the module doc)."""
        kept = self.sets()
        digests = {e["xxh3_128"] for _, _, m in kept for e in m.get("files", [])}
        kept_paths = {e["path"] for _, _, m in kept[-1:] for e in m.get("files", [])}
        try:
            unfinished = set(json.loads((self.sets_dir / UNFINISHED).read_text()))
        except (OSError, ValueError):
            unfinished = set()
        newest_ns = None
        if kept:
            manifest = kept[-1][2]
            newest_ns = manifest.get("newest_mtime_ns") or int(manifest["time"] * 1e9)
        out = []
        for path in self.current():
            if path in kept_paths:
                continue  # a file of the newest set: ensure_good's business
            st = _stat(path)
            if st is None:
                continue
            newer = newest_ns is not None and st[1] > newest_ns
            if not (newer or path in unfinished):
                continue  # the application's older files are never touched
            if checksum(path) in digests:
                continue  # a good copy of a kept file
            out.append(path)
        return out

    def move_aside(self, paths: Sequence[str]) -> list[tuple[str, str]]:
        """Move ``paths`` into ``DIR/restart-sets/cut/`` (never deleted); (from, to) pairs."""
        moved: list[tuple[str, str]] = []
        if not paths:
            return moved
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target = self.cut_dir / stamp
        target.mkdir(parents=True, exist_ok=True, mode=0o700)
        for path in paths:
            dest = target / os.path.basename(path)
            n = 1
            while dest.exists():
                dest = target / f"{os.path.basename(path)}.{n}"
                n += 1
            shutil.move(path, dest)
            moved.append((path, str(dest)))
        return moved

    def set_aside_cut(self) -> list[tuple[str, str]]:
        """At the start: move the series' cut files aside; (from, to) of each moved file."""
        moved = self.move_aside(self.cut_candidates())
        (self.sets_dir / UNFINISHED).unlink(missing_ok=True)
        return moved
