"""What a save and a restore of the store return (:class:`SaveResult`, :class:`RestoreResult`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcckpt.store.tree.matching import KeyDifferences

#: The kind a deferred staged save's result says before its commit: the ranks decide in
#: the background whether it is full or incremental.
STAGED = "staged"


@dataclass(frozen=True)
class SaveResult:
    step: int
    path: Path
    bytes_written: int  # summed over ranks
    seconds: float  # wall time of the slowest rank, commit included
    kind: str = "full"  # or "incremental": only the changed blocks were written
    dirty_blocks: int = 0  # blocks written, over all ranks
    total_blocks: int = 0  # blocks of the whole state, over all ranks
    #: Staged saves: seconds the ranks were blocked (``seconds`` is staging to commit).
    blocked_seconds: float | None = None
    #: The largest resident set of a rank from the start of the save to its commit.
    peak_rss: int = 0
    #: Staged in memory: "copy" (whole) or "pieces" (through a ring), and the bytes held.
    staging: str | None = None
    staging_bytes: int = 0
    #: Synchronous saves: "direct" or "buffered", and the choice made after it, if any
    #: (:mod:`.io.write_path`: the rates measured, the path kept).
    write_path: str | None = None
    write_decision: dict[str, Any] | None = None
    #: "directory" (committed there), or "cache": a node-local checkpoint only.
    tier: str = "directory"
    #: How the changed blocks were found: "kernel" (written pages, :mod:`.save.write_tracking`)
    #: or "hashes" (every block hashed); the most pages the kernel reported, bytes hashed
    #: and seconds scanning on a rank.
    change_detection: str = "hashes"
    pages_written: int = 0
    bytes_hashed: int = 0
    scan_seconds: float = 0.0
    #: The self-audit found a change the kernel did not report: why (tracking is now off).
    tracking_audit: str | None = None
    #: A full checkpoint: why it is not a delta of the last one (ChainPolicy.why_full).
    full_reason: str | None = None
    #: This save replaced a file of its step marked bad: that mark's reason (the commit
    #: removed the mark, which judged the old file).
    cleared_bad_mark: str | None = None

    @property
    def dirty_fraction(self) -> float:
        """Fraction of the state's blocks this save wrote (1.0 for a full checkpoint)."""
        return self.dirty_blocks / self.total_blocks if self.total_blocks else 1.0


@dataclass(frozen=True)
class RestoreResult:
    step: int
    path: Path
    skipped: list[tuple[int, str]]  # newer checkpoints found bad, with the reason
    saved_ranks: int = 0  # how many ranks wrote the restored checkpoint
    #: "directory", "cache" (a node-local copy newer than the directory's) or "mirror"
    #: (pulled from the mirror into the directory: it held nothing newer that was good)
    source: str = "directory"
    rebuilt: tuple[int, ...] = ()  # ranks whose node-local data was rebuilt
    rebuilt_from: str | None = None  # "partner" or "xor"
    moved: tuple[int, ...] = ()  # ranks whose node-local files came from another node
    #: Node-local checkpoints newer than the one restored that could not be, with why.
    local_skipped: tuple[tuple[int, str], ...] = ()
    #: ``restore(strict=False)`` only (a strict one raises instead), as this rank found
    #: them (key paths, matching.KeyDifferences): the state's keys the checkpoint
    #: lacks (left as they were), the checkpoint's keys added to the state's dicts, and
    #: an object's saved keys its state_dict() no longer has (not given to it).
    skipped_keys: tuple[str, ...] = ()
    added_keys: tuple[str, ...] = ()
    ignored_keys: tuple[str, ...] = ()

    def with_keys(self, keys: KeyDifferences | None) -> RestoreResult:
        """This result with the key differences a non-strict restore found (None: none)."""
        if not keys:
            return self
        return dataclasses.replace(
            self, skipped_keys=keys.skipped, added_keys=keys.added, ignored_keys=keys.ignored
        )
