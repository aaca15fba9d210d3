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
  while writing), the newest good set is copied back first.
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

SETS_DIR = "restart-sets"
MANIFEST = "manifest.json"
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
        if now - pending.last_change_mono < self.settle:
            return False
        if self.marker is not None:
            mark = snapshot.get(self.marker)
            return mark is not None and mark[1] >= since and len(snapshot) > 1
        return bool(snapshot) and all(m >= since for _, m in snapshot.values())

    def cost(self, pending: PendingSet) -> float:
        """Seconds from the signal to the last change of the files."""
        return max(0.0, pending.last_change_wall - pending.signal_wall_ns / 1e9)

    # -- registering -----------------------------------------------------------------
    def register(self, *, attempt: str, seconds: float | None) -> RegisteredSet:
        """Checksum the live files and copy them into a new set; prune old sets."""
        files = self.current()
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
        for i, path in enumerate(files):
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
            "files": entries,
        }
        tmp = target / f".{MANIFEST}.tmp"
        with open(tmp, "w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target / MANIFEST)
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
        problems = []
        for entry in manifest.get("files", []):
            path = entry["path"]
            st = _stat(path)
            if st is None:
                problems.append(f"{path} is missing")
            elif st[0] != entry["size"]:
                problems.append(f"{path} has {st[0]} bytes, not {entry['size']}")
            elif checksum(path) != entry["xxh3_128"]:
                problems.append(f"{path} has a different checksum")
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
            problems = self.verify_live(manifest)
            if not problems:
                return number, wrong
            wrong.extend(problems)
            for entry in manifest["files"]:
                dest = Path(entry["path"])
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.hpcckpt-restore")
                shutil.copy2(path / entry["name"], tmp)
                os.replace(tmp, dest)
            return number, wrong
        return None, wrong
