"""Which checkpoint a restore takes: the newest that verifies on every rank.

The sequence (docs/format.md, "Restore"): list the directory's committed checkpoints,
newest first, skipping those marked bad; take a node-local copy instead when the tier
has one newer than all of them (:mod:`.tier.node_local`); guard each read against a crash of
HDF5 itself (a marker only a completed read removes); read and verify it
(:mod:`.restore.load`); mark one that fails bad (never delete it) and fall back to the next.
With a mirror (:mod:`.mirror.copy`), its good checkpoints the directory lacks join the list:
rank 0 pulls one (and its chain) into the directory, checked against its manifest, when
its turn comes, so the newest good checkpoint of either tier wins; a copy that fails
is marked bad on the mirror too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpcckpt.store.agreement import Agreement, Refused
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.file import layout
from hpcckpt.store.io import faults, safety
from hpcckpt.store.io.blocks import ChainState
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror import index as mirror_index
from hpcckpt.store.mirror.backend import MirrorBackend, MirrorUnavailable
from hpcckpt.store.restore.load import Loader
from hpcckpt.store.results import RestoreResult
from hpcckpt.store.tier.node_local import NodeLocalTier
from hpcckpt.store.tree.encoding import Encoder
from hpcckpt.store.tree.matching import key_differences
from hpcckpt.store.tree.state_tree import Targets

log = logging.getLogger("hpcckpt.store")

#: Why a checkpoint whose reading killed an earlier restore is skipped.
READ_CRASH = (
    "an earlier restore died while reading it (HDF5 crashed on damaged metadata, or the "
    "job was killed mid-restore); remove its .bad file to try it again"
)


class Restorer:
    """Restores from one directory, its node-local tier and its mirror (``mirror``: rank
    0's backend, None elsewhere); methods are collective."""

    def __init__(
        self,
        directory: Path,
        agreement: Agreement,
        loader: Loader,
        encoder: Encoder,
        file_mode: int,
        tier: NodeLocalTier | None,
        mirror: MirrorBackend | None = None,
        mirrored: bool = False,
    ) -> None:
        self.directory = directory
        self.mirror = mirror
        #: Whether a mirror is set (rank 0 holds the backend; every rank knows there is one,
        #: from the same options).
        self.mirrored = mirrored
        self.agreement = agreement
        self.loader = loader
        self.encoder = encoder
        self.file_mode = file_mode
        self.tier = tier
        self.rank = agreement.rank

    def entries(self) -> list[layout.Entry]:
        """Committed checkpoints as rank 0 sees them, newest first (same list on every rank)."""
        return self.agreement.from_root(lambda: layout.scan(self.directory))

    def restore(
        self, state: dict[str, Any], only: tuple[str, ...] | None = None, strict: bool = True
    ) -> tuple[RestoreResult | None, ChainState | None]:
        """Fill ``state`` from the newest checkpoint that verifies on every rank (see
        :meth:`.CheckpointStore.restore`); with it, what the next save needs to be a
        delta of it (None: the next save is full)."""
        targets = Targets(strict)
        skipped: list[tuple[int, str]] = []
        local_skipped: list[tuple[int, str]] = []  # node-local checkpoints that could not be
        entries, died = self._listing(guard_first=self.tier is None and not self.mirrored)
        remote: list[int] = []
        if self.mirrored:  # no collective for a store without a mirror
            remote = self.agreement.from_root(lambda: self._mirror_steps(entries))
        if self.tier is not None and only is None:
            newest = max((e.step for e in entries if e.good_candidate), default=-1)
            newest = max(newest, *remote) if remote else newest
            local = self.tier.restore(state, newest, local_skipped, targets)
            if local is not None:
                return local, None  # the next save is a full one, in the directory
        order: list[tuple[int, layout.Entry | None]] = [(e.step, e) for e in entries]
        order += [(step, None) for step in remote]
        order.sort(key=lambda pair: pair[0], reverse=True)
        for step, found in order:
            source = "directory"
            if found is None:  # only on the mirror: rank 0 pulls it into the directory
                pulled = self.agreement.from_root(lambda s=step: self._pull(s))
                if isinstance(pulled, str):
                    skipped.append((step, pulled))
                    continue
                found, source, died = pulled, "mirror", None
            entry = found
            if not entry.good_candidate:
                skipped.append((entry.step, f"marked bad earlier: {entry.bad_reason}"))
                continue
            if died is None:  # not guarded with the listing: one more bcast
                died = self.agreement.from_root(lambda e=entry: self._died_reading(e))
            if died:
                died = None
                skipped.append((entry.step, READ_CRASH))
                continue
            died = None  # the next candidate (a fallback) is guarded on its own
            try:
                faults.fault_point("restore.reading", entry.step)
                loaded = self.loader.load(entry, state, targets, only)
            except Refused as exc:
                raise CheckpointError(str(exc)) from None
            except CorruptCheckpoint as exc:
                reason = str(exc)
                if self.rank == 0:
                    log.warning(
                        "checkpoint %s is bad (%s); trying the previous one",
                        entry.path.name,
                        reason,
                    )
                    self._mark_bad(entry, exc.culprit or [entry.path], reason)
                    if source == "mirror":
                        self._mark_mirror_bad(entry, reason)
                skipped.append((entry.step, reason))
                continue
            finally:
                # Every rank is past the read (its last agreement): it did not kill us.
                if self.rank == 0:
                    reading_marker(entry.path).unlink(missing_ok=True)
            keys = None if strict else key_differences(state, loaded.tree, targets, only)
            self.encoder.decode(state, loaded.tree, loaded.arrays, targets)
            result = RestoreResult(
                step=entry.step,
                path=entry.path,
                skipped=skipped,
                saved_ranks=loaded.saved_ranks,
                local_skipped=tuple(local_skipped),
                source=source,
            ).with_keys(keys)
            return result, loaded.chain
        if order:
            where = f"{self.directory}" + (" and on its mirror" if remote else "")
            detail = "; ".join(f"step {s}: {r}" for s, r in skipped[:4])
            raise CheckpointError(
                f"none of the {len(order)} checkpoints in {where} is good ({detail}). "
                "Move them aside to start from scratch, or inspect them with 'hpcckpt verify'"
            )
        return None, None

    def _mirror_steps(self, entries: list[layout.Entry]) -> list[int]:
        """Rank 0: the steps of the mirror's good checkpoints the directory does not
        hold, newest first (none when the mirror cannot be reached: it says why)."""
        if self.mirror is None:
            return []
        try:
            listing = mirror_index.load(self.mirror).listing()  # not every manifest
        except (MirrorUnavailable, OSError) as exc:
            log.warning(
                "restore: the mirror %s cannot be read (%s); directory only", self.mirror.url, exc
            )
            return []
        here = {e.step for e in entries}
        return [m.step for m in listing if m.good and m.step not in here]

    def _pull(self, step: int) -> layout.Entry | str:
        """Rank 0: the mirror's checkpoint of ``step``, pulled into the directory with
        the files of its chain it lacks and checked against its manifest; else why not."""
        assert self.mirror is not None
        name = layout.checkpoint_name(step)
        try:
            known = mirror_index.confirm(self.mirror, [name])  # its own objects, now
            path = mirror.pull(self.mirror, name, self.directory, mode=self.file_mode, known=known)
        except (CheckpointError, MirrorUnavailable, OSError) as exc:
            log.warning("restore: %s from the mirror %s: %s", name, self.mirror.url, exc)
            return f"on the mirror: {exc}"
        log.info("restore: pulled %s from the mirror %s", name, self.mirror.url)
        return layout.Entry(step, path, None)

    def _mark_mirror_bad(self, entry: layout.Entry, reason: str) -> None:
        """Rank 0: a checkpoint pulled from the mirror failed its checks: mark it there."""
        if self.mirror is None:
            return
        try:
            mirror.mark_bad(self.mirror, entry.path.name, f"failed at restore: {reason}")
        except (MirrorUnavailable, OSError) as exc:
            log.warning("restore: cannot mark %s bad on the mirror: %s", entry.path.name, exc)

    def _listing(self, guard_first: bool) -> tuple[list[layout.Entry], bool | None]:
        """:meth:`entries` and, with ``guard_first``, whether an earlier restore died
        reading the first good candidate (:meth:`_died_reading`, which guards it for the
        read that follows): both in one bcast. None: not guarded."""

        def listing() -> tuple[list[layout.Entry], bool | None]:
            entries = layout.scan(self.directory)
            first = next((e for e in entries if e.good_candidate), None)
            died = self._died_reading(first) if guard_first and first is not None else None
            return entries, died

        return self.agreement.from_root(listing)

    def _died_reading(self, entry: layout.Entry) -> bool:
        """Rank 0: whether an earlier restore died reading this checkpoint (then mark it bad);
        otherwise leave a marker that only a completed read removes.

        A few damaged HDF5 headers crash the library itself (a segfault, not an error):
        without this, every restart would crash on the same file and never fall back.
        """
        marker = reading_marker(entry.path)
        if os.path.lexists(marker):
            log.warning("checkpoint %s: %s; trying the previous one", entry.path.name, READ_CRASH)
            self._mark_bad(entry, [entry.path], READ_CRASH)
            marker.unlink(missing_ok=True)
            return True
        try:
            safety.write_private(marker, f"{os.getpid()}\n", self.file_mode)
        except OSError as exc:  # a read-only directory: restore still works, unguarded
            log.debug("cannot leave %s: %s", marker.name, exc)
        return False

    def _mark_bad(self, entry: layout.Entry, culprits: Iterable[Any], reason: str) -> None:
        """Rank 0: mark the files at fault bad; a checkpoint whose chain needs one is
        skipped from then on by the reader. A missing file is not marked (it cannot be)."""
        for culprit in culprits:
            path = Path(culprit)
            if path.parent != entry.path.parent or layout.step_of(path.name) is None:
                path = entry.path
            if os.path.lexists(path) and layout.read_bad(path) is None:
                why = (
                    reason
                    if path == entry.path
                    else f"found while restoring {entry.path.name}: {reason}"
                )
                layout.mark_bad(path, why)


def reading_marker(path: Path) -> Path:
    """The marker a restore leaves beside checkpoint ``path`` while it reads it."""
    return path.with_name(path.name + layout.READING)
