"""How a synchronous save finds the blocks that changed: told by the kernel, or by hashing.

With ``"kernel"`` tracking (:mod:`.save.write_tracking`), an incremental save takes the
previous checkpoint's block hashes and hashes again only the blocks the kernel saw
written, so it never reads unchanged memory. Arrays the kernel cannot vouch for
(shared or file-backed memory, new or moved arrays, a region whose scan failed) are
hashed in full, as with ``"hashes"``.

The self-audit costs nothing extra: a save that is full anyway (the chain restarts)
hashes every block; the blocks the kernel did not report must then hash as before. If
one does not, tracking is switched off for the rest of the run and the save says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcckpt import procfs
from hpcckpt.store.io import blocks
from hpcckpt.store.io.blocks import ChainPolicy, ChainState
from hpcckpt.store.save import write_tracking

log = logging.getLogger("hpcckpt.store")

MODES = ("auto", "kernel", "hashes")
#: An array whose blocks were more than this fraction written since the last save is
#: rewritten as a whole between saves: tracking it costs its pages a fault each after
#: every save (~1.2 us per 4 KiB page here, 0.15 s per 512 MiB, against 0.02-0.04 s to
#: hash it), so it is hashed instead for the next REST_SAVES saves, then tried again.
DENSE = 0.5
REST_SAVES = 4


def check_mode(mode: str) -> str:
    """``mode`` if valid and possible here; ValueError naming the reason and the fix."""
    if mode not in MODES:
        raise ValueError(f"change_detection must be one of {', '.join(MODES)}, not {mode!r}")
    why = write_tracking.why_unavailable() if mode == "kernel" else None
    if why is not None:
        raise ValueError(
            f"change_detection='kernel': this kernel cannot track writes ({why}); "
            f"{write_tracking.FIX}"
        )
    return mode


@dataclass(frozen=True)
class Finding:
    """How one rank's save found its changed blocks."""

    method: str  # "kernel" (some array's hashes came from tracking) or "hashes"
    pages: int  # pages the kernel reported written or zeroed
    bytes_hashed: int  # bytes this rank read to hash (the rest was not read)
    scan_seconds: float


class ChangeDetector:
    """One store's change detection: the mode, the tracker, the self-audit."""

    def __init__(self, mode: str = "auto") -> None:
        self.mode = check_mode(mode)
        self.tracker: write_tracking.WriteTracker | None = None
        if mode != "hashes" and write_tracking.available():
            self.tracker = write_tracking.WriteTracker()
        #: Why tracking was switched off during this run (the self-audit), or None.
        self.off: str | None = None
        self._audit: dict[str, np.ndarray] = {}  # arrays hashed in full, with what the kernel said
        self._resting: dict[str, int] = {}  # densely written arrays: saves left untracked

    def hashes(
        self,
        arrays: dict[str, Any],
        last: ChainState | None,
        parent: ChainState | None,
        policy: ChainPolicy,
        block_size: int,
        specs: dict[str, Any],
        skip: set[str],
        nranks: int,
    ) -> tuple[dict[str, np.ndarray], Finding]:
        """Block hashes of the arrays known without reading them all (the others are
        hashed by the save), and how. Registers every trackable array before the save
        hashes it. ``last``: the last committed checkpoint; ``parent``: the one this save
        may be a delta of (``last`` or None)."""
        self._audit = {}
        tracker = self.tracker
        total = sum(a.nbytes for p, a in arrays.items() if p not in skip)
        if tracker is None or not policy.incremental:  # full files only: nothing to find
            return {}, Finding("hashes", 0, total, 0.0)
        tracker.scan = write_tracking.Scan()
        paths = {p for p, a in arrays.items() if p not in skip and isinstance(a, np.ndarray)}
        resting = {p for p in paths if self._resting.get(p, 0) > 0}
        tracker.keep_only(paths - resting)
        usable = (
            last is not None
            and tracker.baseline == last.uid
            and last.fits(nranks, block_size, specs)
        )
        delta = usable and parent is last and not policy.full_by_count(parent)
        maps: list[procfs.MemoryArea] | None = None  # read only if an array is new
        out: dict[str, np.ndarray] = {}
        hashed = total
        for p in sorted(paths):
            a = arrays[p]
            if p in resting:
                self._resting[p] -= 1
                continue
            step = blocks.block_bytes(a.dtype, block_size)
            found = tracker.candidate_blocks(p, a, step) if usable else None
            if found is not None and found.size > DENSE * -(-a.nbytes // step):
                self._resting[p] = REST_SAVES
                tracker.keep_only(tracker.tracked - {p})  # its pages fault no more
                log.debug("array %s is rewritten between saves: hashed for a while", p)
            else:
                if (
                    maps is None
                    and not tracker.registered(p, a)
                    and tracker.why_not(p, a, step) is None
                ):
                    maps = procfs.memory_maps()
                why = tracker.track(p, a, step, maps)
                if why is not None:
                    log.debug("array %s is hashed: %s", p, why)
            if found is None:
                continue
            assert last is not None
            if delta:
                h = last.hashes[p].copy()
                hashed += blocks.rehash(a, block_size, h, found) - a.nbytes
                out[p] = h
            else:
                self._audit[p] = found
        method = "kernel" if out else "hashes"
        return out, Finding(method, tracker.scan.pages, hashed, tracker.scan.seconds)

    def device_copies(self, last: ChainState | None, policy: ChainPolicy) -> str:
        """What a staged save copies of device tensors (:mod:`.save.device_checksums`):
        ``"changed"``, the blocks whose checksums changed on the device; ``"all"`` for a
        save full by count (every byte, the checksums refreshed); ``"off"`` with
        ``"hashes"`` or when saves are never incremental (every byte copied and hashed,
        no checksums: nothing would ever compare them)."""
        if self.mode == "hashes" or not policy.incremental:
            return "off"
        return "all" if policy.full_by_count(last) else "changed"

    def audit(self, hashes: dict[str, np.ndarray], last: ChainState | None) -> str | None:
        """After a save that hashed tracked arrays in full: a block whose hash changed
        although the kernel reported no write to it, described; None when all agree."""
        for p, found in sorted(self._audit.items()):
            if last is None or p not in last.hashes or p not in hashes:
                continue
            quiet = np.ones(hashes[p].size, dtype=bool)
            quiet[found] = False
            missed = np.flatnonzero((hashes[p] != last.hashes[p]) & quiet)
            if missed.size:
                return (
                    f"array {p!r}: {missed.size} block(s) changed although the kernel "
                    f"reported no write to them (first: {missed[:4].tolist()})"
                )
        return None

    def committed(self, uid: str, audit_failed: str | None) -> None:
        """The save committed as ``uid``; with ``audit_failed`` (this or another rank's
        self-audit), tracking is off for the rest of the run."""
        if self.tracker is None:
            return
        if audit_failed is not None:
            self.tracker.close()
            self.tracker = None
            self.off = audit_failed
            return
        self.tracker.committed(uid)

    def reset(self) -> None:
        """Forget what was tracked (a restore rewrote the arrays)."""
        if self.tracker is not None:
            self.tracker.reset()
