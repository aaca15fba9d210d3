"""The node-local tier of a store: checkpoints in a node-local directory, sealed with
their redundancy across nodes, and restored from there when newer than the directory's.

The files themselves are :mod:`.tier.copies`'s (copies) and :mod:`.tier.redundancy`'s (partner
copies, XOR parity); moving and rebuilding copies is :mod:`.tier.rebuild`'s. This
module is the collective sequence around them, and :class:`NodeLocalTier` holds all
that the tier knows of its copies: whether one is newer than the directory's newest
checkpoint, which step that is, the copy a drain reads, the files set aside.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcckpt.store.agreement import Agreement
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.io import faults, safety
from hpcckpt.store.results import RestoreResult, SaveResult
from hpcckpt.store.tier import copies as fast_tier
from hpcckpt.store.tier import rebuild as local_restore
from hpcckpt.store.tier import redundancy
from hpcckpt.store.tier.data_map import DataMap, file_bytes, maps_well
from hpcckpt.store.tier.options import TierOptions
from hpcckpt.store.tree.encoding import Encoder
from hpcckpt.store.tree.matching import check_fits, check_keys, key_differences
from hpcckpt.store.tree.state_tree import Targets

log = logging.getLogger("hpcckpt.store")


@dataclass(frozen=True)
class Place:
    """Where the tier's copies belong: the directory they drain to, the block size their
    hashes use, and the modes of the files and directories it creates."""

    directory: Path
    block_size: int
    file_mode: int
    dir_mode: int


class NodeLocalTier:
    """One rank's view of the node-local tier; its methods are collective unless said."""

    def __init__(
        self, options: TierOptions, place: Place, agreement: Agreement, encoder: Encoder
    ) -> None:
        assert options.path is not None
        self.path = options.path
        self.redundancy = options.redundancy
        self.place = place
        self.agreement = agreement
        self.encoder = encoder
        self.rank, self.nranks = agreement.rank, agreement.nranks
        #: This rank's node name: the failure group of the redundancy sets.
        self.node = options.node_name or fast_tier.host()
        self._holds_newest = False
        self._newest_step: int | None = None
        self._drain_copy: fast_tier.LocalCopy | None = None
        self._set_aside: list[tuple[int, str, str, str]] = []
        self._sets: redundancy.SetLayout | None = None
        #: This rank's data file kept mapped between saves on a memory file system.
        self._data_map: DataMap | None = None
        if options.redundancy is not None:  # a layout without distinct nodes fails here
            self._sets = redundancy.SetLayout.build(
                agreement.comm, self.node, options.redundancy, options.redundancy_set
            )
            self._log_sets(self._sets, options.redundancy_set)

    # -- what the tier knows (read-only outside) -------------------------------------------
    @property
    def holds_newest(self) -> bool:
        """Whether this rank's copy is newer than the directory's newest checkpoint
        (restored from it, not drained yet, or its drain failed): it must be kept."""
        return self._holds_newest

    @property
    def newest_step(self) -> int | None:
        """The newest checkpoint this run sealed or restored on the tier (None: none)."""
        return self._newest_step

    def take_set_aside(self) -> list[tuple[int, str, str, str]]:
        """Copies the last restore found damaged and set aside, never tried again:
        (step, node, file, reason); the list is emptied (not collective)."""
        out, self._set_aside = self._set_aside, []
        return out

    # -- saves ------------------------------------------------------------------------------
    def save_local(self, step: int, state: dict[str, Any]) -> SaveResult:
        """A checkpoint on the tier only (no drain): every rank's copy and its redundancy
        are written and sealed when this returns.

        It is restorable from then on, never from the directory, until a later save or
        the scavenge (a drain of :meth:`hold_for_drain`'s copy) drains one. Raises
        CheckpointError on every rank when any rank fails; nothing is sealed then.
        """
        t0 = time.perf_counter()
        encoded = self.encoder.encode(step, state)
        faults.fault_point("save.begin", step)
        uid = self.agreement.from_root(lambda: uuid.uuid4().hex)
        error: BaseException | None = None
        hashes: dict[str, Any] = {}
        offsets: dict[str, int] = {}
        try:
            _, hashes, offsets = self.stage(step, encoded.arrays)
        except Exception as exc:  # every rank must reach the agreement below
            error = exc
        self.agreement.agree(error, f"writing node-local checkpoint of step {step} in {self.path}")
        why = self.seal(
            step, uid, encoded.tree, encoded.arrays, hashes, offsets, encoded.replicated
        )
        if why is not None:
            raise CheckpointError(f"sealing node-local checkpoint of step {step} failed ({why})")
        self._holds_newest = True
        faults.fault_point("stage.written")
        total = self.agreement.total(sum(a.nbytes for a in encoded.arrays.values()))
        (seconds,) = self.agreement.slowest(time.perf_counter() - t0)
        nblocks = self.agreement.total(sum(len(h) for h in hashes.values()))
        return SaveResult(
            step=step,
            path=self.path / fast_tier.manifest_name(step, self.rank),
            bytes_written=total,
            seconds=seconds,
            kind="full",
            dirty_blocks=nblocks,
            total_blocks=nblocks,
            blocked_seconds=seconds,
            tier="cache",
        )

    def stage(
        self, step: int, arrays: dict[str, Any], hashed: bool = True
    ) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, int]]:
        """This rank writes its copy of ``arrays`` (not sealed; not collective): the
        copy's arrays, their block hashes (``hashed``; else none: :meth:`seal_alone`
        takes them later) and their offsets in the data file. Older copies go first
        unless this rank's is newer than the directory's; without redundancy the newest
        of them gives its data file's pages to this copy (:func:`.tier.copies.recycle`)."""
        safety.make_directory(self.path, self.place.dir_mode)
        reuse = False
        if not self._holds_newest:  # older copies are durable in the directory
            reuse = self._sets is None and fast_tier.recycle(self.path, self.rank, step)
            keep = step if reuse else None
            fast_tier.remove(self.path, self.rank, keep=keep, nranks=self.nranks)
        if self._data_map is None and maps_well(self.path):
            self._data_map = DataMap()
        write = fast_tier.write_data if self._data_map is None else self._data_map.write
        return write(
            self.path,
            step,
            self.rank,
            arrays,
            self.place.block_size,
            self.place.file_mode,
            hashed=hashed,
            reuse=reuse,
        )

    def reserve(self, state: Any) -> int:
        """Before this rank's first copy (a restore; not collective): on a memory file
        system, the data file of ``state``'s copy made and its pages allocated in the
        background (:meth:`.tier.data_map.DataMap.reserve`), when the first save would
        otherwise make a new one (no data file of this rank to recycle, no redundancy).
        The bytes reserved (0: none)."""
        size = file_bytes(state)
        if self._holds_newest or self._sets is not None or not size:
            return 0
        if not maps_well(self.path) or any(self.path.glob(f"ckpt-*.rank{self.rank}.data")):
            return 0
        try:
            safety.make_directory(self.path, self.place.dir_mode)
            room = os.statvfs(self.path)
            if room.f_bavail * room.f_frsize < size:
                return 0
        except OSError:
            return 0
        if self._data_map is None:
            self._data_map = DataMap()
        made = self._data_map.reserve(self.path, self.rank, size, self.place.file_mode)
        return 0 if made is None else size

    def seals_alone(self) -> bool:
        """Whether a staged save's copy may be sealed by each rank on its own, in the
        background once hashed (:meth:`seal_alone`): without redundancy (no collective
        step in the seal) and when no copy of the tier is newer than the directory's
        (the older copies were removed at :meth:`stage`, none is left to replace)."""
        return self._sets is None and not self._holds_newest

    def seal_alone(
        self,
        step: int,
        uid: str,
        tree: Any,
        arrays: dict[str, np.ndarray],
        hashes: dict[str, Any],
        offsets: dict[str, int],
        replicated: set[str],
    ) -> None:
        """Seal this rank's copy alone (not collective; any thread): its manifest, once
        ``hashes`` are those of the copy's data file. Raises OSError when it cannot."""
        doc = fast_tier.manifest_doc(
            step=step,
            uid=uid,
            rank=self.rank,
            nranks=self.nranks,
            directory=self.place.directory,
            block_size=self.place.block_size,
            tree=tree,
            arrays=arrays,
            hashes=hashes,
            offsets=offsets,
            node=self.node,
            replicated=replicated,
        )
        path = self.path / fast_tier.manifest_name(step, self.rank)
        fast_tier.write_manifest(path, doc, self.place.file_mode)

    def sealed_alone(self, step: int, everyone: bool) -> None:
        """The ranks sealed ``step`` alone (:meth:`seal_alone`); ``everyone``: all of them
        did (the caller agreed on it), so it is the tier's newest copy."""
        if everyone:
            self._newest_step = step
        else:
            log.warning("rank %d: the copies of step %d in %s were not all sealed",
                        self.rank, step, self.path)  # fmt: skip

    def seal_staged(
        self, step: int, uid: str, tree: Any, arrays: dict[str, Any], **parts: Any
    ) -> None:
        """Seal the copy a staged save just wrote (:meth:`stage`); the drain goes on
        when it cannot be sealed (that copy just cannot be restored)."""
        why = self.seal(step, uid, tree, arrays, **parts)
        if why is None:
            self._holds_newest = False  # the drain under way will hold it durably
        else:
            log.warning("rank %d: cannot seal its copy in %s: %s", self.rank, self.path, why)

    def seal(
        self,
        step: int,
        uid: str,
        tree: Any,
        arrays: dict[str, np.ndarray],
        hashes: dict[str, Any],
        offsets: dict[str, int],
        replicated: set[str],
    ) -> str | None:
        """Write the redundancy (if any), then seal every rank's copy.

        Returns None when every rank sealed, else the ranks' errors (the copies that
        were sealed stay valid: each one verifies on its own).
        """
        doc = fast_tier.manifest_doc(
            step=step,
            uid=uid,
            rank=self.rank,
            nranks=self.nranks,
            directory=self.place.directory,
            block_size=self.place.block_size,
            tree=tree,
            arrays=arrays,
            hashes=hashes,
            offsets=offsets,
            node=self.node,
            replicated=replicated,
        )
        red_doc = None
        if self._sets is not None:
            sets = self._sets
            error: BaseException | None = None
            data = self.path / fast_tier.data_name(step, self.rank)
            out = self.path / redundancy.file_name(step, self.rank, sets.scheme)
            encoded: dict[str, Any] = {}
            try:
                encoded = redundancy.encode(sets, data, out, self.place.file_mode)
            except OSError as exc:
                error = exc
            faults.fault_point("redundancy.encoded", step)
            manifests = sets.comm.allgather(doc)
            try:
                self.agreement.agree(error, f"writing the {sets.scheme} redundancy of step {step}")
            except CheckpointError as exc:
                return str(exc)
            red_doc = redundancy.redundancy_doc(
                step=step,
                uid=uid,
                rank=self.rank,
                nranks=self.nranks,
                directory=self.place.directory,
                layout=sets,
                encoded=encoded,
                manifests=manifests,
            )
        problem = None
        try:
            mode = self.place.file_mode
            fast_tier.write_manifest(
                self.path / fast_tier.manifest_name(step, self.rank), doc, mode
            )
            if red_doc is not None:
                path = self.path / redundancy.manifest_name(step, self.rank)
                fast_tier.write_manifest(path, red_doc, mode)
        except OSError as exc:
            problem = f"rank {self.rank}: {exc}"
        problems = [p for p in self.agreement.comm.allgather(problem) if p]
        if problems:
            return "; ".join(problems[:4])
        fast_tier.remove(self.path, self.rank, keep=step, nranks=self.nranks)
        self._newest_step = step
        return None

    # -- the directory's side of a save ------------------------------------------------------
    def committed(self, step: int) -> None:
        """The directory committed ``step`` (not collective): a copy of the tier is the
        newest only if sealed after it, while ``step`` drained."""
        newest = self._newest_step
        self._holds_newest = newest is not None and newest > step

    def drain_failed(self) -> None:
        """A drain failed (not collective): the sealed copy is now the newest."""
        self._holds_newest = True

    def hold_for_drain(self, step: int) -> bool:
        """Keep this rank's copy of ``step`` as the one the next drain reads (a
        :meth:`drain_copy` with ``redrain``), when every rank holds its own."""
        copies = fast_tier.scan(self.path, self.place.directory, self.rank, self.nranks)
        mine = next((c for c in copies if c.step == step), None)
        if not self.agreement.everyone(mine is not None):
            log.warning("cannot drain node-local step %d: not every rank holds it", step)
            return False
        self._drain_copy = mine
        return True

    def drain_copy(self, step: int) -> fast_tier.LocalCopy:
        """The copy of ``step`` the last restore took (or :meth:`hold_for_drain` kept),
        to drain as it is (not collective); ValueError when there is none."""
        copy = self._drain_copy
        if copy is None or copy.step != step:
            raise ValueError(f"nothing to drain again: step {step} is not a node-local copy")
        return copy

    def free(self) -> None:
        """The job is done: delete every rank's files and the node's directory once empty."""
        comm = self.agreement.comm
        moved = self.redundancy is not None  # ranks may have left files here
        if self._data_map is not None:
            self._data_map.close()
        comm.barrier()
        fast_tier.remove(self.path, self.rank, nranks=self.nranks, every_rank=moved)
        comm.barrier()
        try:
            self.path.rmdir()  # one rank per node succeeds, once all copies are gone
        except OSError:
            pass

    # -- restore ----------------------------------------------------------------------------
    def restore(
        self, state: dict[str, Any], newest: int, skipped: list[tuple[int, str]], targets: Targets
    ) -> RestoreResult | None:
        """Restore the newest copy newer than the directory's step ``newest`` (moved and
        rebuilt with redundancy, as it is without); those that could not be, into
        ``skipped`` with the reason. None when none could."""
        if self._sets is not None:
            return self._restore_rebuilt(state, newest, skipped, targets)
        return self._restore_as_is(state, newest, skipped, targets)

    def _restore_rebuilt(
        self, state: dict[str, Any], newest: int, skipped: list[tuple[int, str]], targets: Targets
    ) -> RestoreResult | None:
        try:  # a node new to this job (a spare, a replaced node) has no directory yet
            safety.make_directory(self.path, self.place.dir_mode)
        except OSError as exc:
            log.warning("rank %d: cannot create %s: %s", self.rank, self.path, exc)
        found = local_restore.restore(
            self.agreement.comm,
            self.path,
            self.place.directory,
            newest,
            self.place.file_mode,
            self.node,
        )
        for step, why in found.skipped:
            if self.rank == 0:
                log.warning("node-local checkpoint of step %d not used: %s", step, why)
            skipped.append((step, why))
        self._set_aside = list(found.set_aside)
        for step, node, name, why in found.set_aside:
            if self.rank == 0:
                log.warning("node-local %s on %s set aside (step %d): %s", name, node, step, why)
        if found.step is None:
            return None
        assert found.copy is not None
        arrays = self._with_replicated(found.copy, dict(found.arrays))
        refused = check_keys(state, found.copy.tree, found.step, targets)
        fatal = None if refused else check_fits(state, found.copy.tree, arrays, targets)
        outcome = self.agreement.comm.allgather((refused, fatal))
        _refuse_keys([k for k, _ in outcome if k])
        fatals = [f for _, f in outcome if f]
        if fatals:
            if self.rank == 0:
                log.warning("node-local copy of step %d not used (%s)", found.step, fatals[0])
            return None
        result = self._adopt(state, found.copy, arrays, targets, skipped)
        return dataclasses.replace(
            result,
            rebuilt=tuple(found.rebuilt),
            rebuilt_from=found.scheme,
            moved=tuple(found.moved),
        )

    def _restore_as_is(
        self, state: dict[str, Any], newest: int, skipped: list[tuple[int, str]], targets: Targets
    ) -> RestoreResult | None:
        """The copy newer than ``newest`` if every rank has it whole (one copy per rank is
        kept: a sealed copy replaces the older ones). Without redundancy a damaged part
        cannot be rebuilt: the rank that holds it sets it aside (never tried again); the
        other ranks' sound parts stay until the next save replaces them."""
        comm = self.agreement.comm
        mine = fast_tier.scan(self.path, self.place.directory, self.rank, self.nranks)
        offers = comm.allgather({(c.step, c.uid) for c in mine if c.step > newest})
        common = set.intersection(*offers)
        if not common:
            if any(offers) and self.rank == 0:
                log.info("node-local copies in %s are not complete on every rank", self.path)
            return None
        step, uid = max(common)
        copy = next(c for c in mine if (c.step, c.uid) == (step, uid))
        problem = fatal = aside = refused = None
        arrays: dict[str, Any] = {}
        try:
            arrays = fast_tier.load(copy)
        except (CorruptCheckpoint, OSError, ValueError) as exc:
            problem = f"rank {self.rank}: {exc}"
            if fast_tier.set_aside_file(copy.path):
                aside = (step, self.node, copy.path.name, problem)
        if not any(comm.allgather(problem)):
            arrays = self._with_replicated(copy, arrays)
            refused = check_keys(state, copy.tree, step, targets)
            fatal = None if refused else check_fits(state, copy.tree, arrays, targets)
        outcome = comm.allgather((problem, fatal, aside, refused))
        _refuse_keys([k for _, _, _, k in outcome if k])
        problems = [p for p, _, _, _ in outcome if p]
        fatals = [f for _, f, _, _ in outcome if f]
        if problems or fatals:
            why = "; ".join((problems or fatals)[:4])
            if self.rank == 0:
                log.warning("node-local copy of step %d not used (%s)", step, why)
            skipped.append((step, why))
            self._set_aside += [a for _, _, a, _ in outcome if a]
            return None
        return self._adopt(state, copy, arrays, targets, skipped)

    def _with_replicated(self, copy: fast_tier.LocalCopy, arrays: dict[str, Any]) -> dict[str, Any]:
        """Replicated arrays are in rank 0's copy only (the others hold stand-ins)."""
        for name in self.agreement.from_root(lambda: copy.replicated):
            arrays[name] = self.agreement.bcast_array(arrays.get(name))
        return arrays

    def _adopt(
        self,
        state: dict[str, Any],
        copy: fast_tier.LocalCopy,
        arrays: dict[str, Any],
        targets: Targets,
        skipped: list[tuple[int, str]],
    ) -> RestoreResult:
        """The tail of both restores: fill the state from ``copy``, which becomes the
        tier's newest and the copy the next drain reads."""
        keys = None if targets.strict else key_differences(state, copy.tree, targets)
        self.encoder.decode(state, copy.tree, arrays, targets)
        self._holds_newest = True
        self._newest_step = copy.step
        self._drain_copy = copy
        return RestoreResult(
            step=copy.step,
            path=copy.path,
            skipped=[],
            saved_ranks=self.nranks,
            source="cache",
            local_skipped=tuple(skipped),
        ).with_keys(keys)

    def _log_sets(self, sets: redundancy.SetLayout, asked: int) -> None:
        """One line: the sets the ranks formed (smaller than asked when nodes are few)."""
        if self.rank != 0:
            return
        sizes = sorted({len(s) for s in sets.sets})
        log.info(
            "%s redundancy: %d set(s) of %s rank(s) on distinct nodes%s",
            sets.scheme,
            len(sets.sets),
            "/".join(map(str, sizes)),
            f" (fewer nodes than redundancy_set={asked})" if max(sizes) < asked else "",
        )


def _refuse_keys(refusals: list[str]) -> None:
    """A strict restore whose state's keys differ from the newest copy's stops on every
    rank (CheckpointError, nothing read into the state), as it would from the directory:
    falling back to an older checkpoint, or to none, would restart silently wrong."""
    if refusals:
        raise CheckpointError(refusals[0])
