"""The commit protocol: save a state collectively and durably, or not at all.

One save, all ranks taking part (docs/format.md):

1. every rank encodes its state while rank 0 checks that the last checkpoint's chain
   is intact (reading the directory only); one reduction agrees on both
   (:mod:`.tree.encoding`);
2. rank 0 creates the directory (owner-only), removes ``*.partial`` leftovers and
   checks the free space, right before step 3 and within its agreement; on the first
   save it also applies the file-system tuning (``lfs setstripe`` on Lustre);
3. rank 0 creates ``ckpt-<step>.h5.partial`` with all its metadata and contiguous
   datasets allocated, from every rank's specs (a gather; plain HDF5, no MPI-IO); every
   rank learns its offsets (a bcast, which also carries step 2's outcome, and a prefix
   sum) and writes its own part (tree, checksums, block hashes, array bytes:
   ``O_DIRECT`` where the file system takes it, :mod:`.io.direct_io`) and fsyncs;
4. the ranks agree that every one of them succeeded (one reduction); if not, rank 0
   deletes the partial file and every rank raises;
5. rank 0 renames it to ``ckpt-<step>.h5`` and fsyncs the directory (the file itself
   is durable already: every rank fsynced it after its last write, rank 0 after
   creating it and setting its mode, and step 4 agreed that every fsync succeeded);
   a ``.bad`` mark of a file it replaced is removed (:func:`.file.layout.clear_marks`).

Only step 5 makes the checkpoint visible, so a crash at any moment leaves either the
previous set of checkpoints or the previous set plus this complete one.

A *staged* save (:meth:`Saver.begin_save`) runs steps 1-2, copies the state to a
staging area (:mod:`.save.staging_modes`), creates the ``.partial`` file with all its
metadata and returns; a thread per rank writes the array bytes and fsyncs.
:meth:`Saver.finish_save` then runs steps 4-5. After a restore or the first save, a
staged save runs steps 1-3 but the copy in a thread, over a group of its own
(:mod:`.save.deferred`): it blocks for the copy only.

Saves are incremental by default: each rank remembers the block hashes of the last
committed (or restored) checkpoint (:class:`~.io.blocks.ChainState`) and the next save
writes only the blocks whose hash changed, into a file that names the files it is built
on (its chain), within the bounds of :class:`~.io.blocks.ChainPolicy`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcckpt.store.agreement import Agreement
from hpcckpt.store.comm import MAX
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.file.writer import Written, write_file
from hpcckpt.store.io import (
    blocks,
    direct_io,
    durability,
    faults,
    filesystem,
    memory,
    safety,
    write_path,
)
from hpcckpt.store.io.blocks import ChainState, delta_did_not_pay
from hpcckpt.store.io.options import FileOptions
from hpcckpt.store.results import SaveResult
from hpcckpt.store.save import staging_budget
from hpcckpt.store.save.change_detection import ChangeDetector
from hpcckpt.store.save.deferred import DeferredSaves
from hpcckpt.store.save.options import IncrementalOptions, Modes
from hpcckpt.store.save.pending import PendingSave, StagingRefused
from hpcckpt.store.save.staging import HostBuffers
from hpcckpt.store.save.staging_budget import StagingPlan
from hpcckpt.store.save.staging_modes import (
    HostCopy,
    NodeLocal,
    Pieces,
    Redrain,
    Staged,
    StagingMode,
)
from hpcckpt.store.tier import copies as fast_tier
from hpcckpt.store.tier.node_local import NodeLocalTier
from hpcckpt.store.tree.encoding import Encoded, Encoder
from hpcckpt.store.tree.options import Split

log = logging.getLogger("hpcckpt.store")

#: Staged saves that go full (hashed in the background) after one whose delta did not
#: pay; the one after them compares again.
FULL_AFTER_CHANGED = 4


class Saver:
    """The save side of one checkpoint directory: steps 1-5 and what they remember
    between saves (the chain, the tuning, the write path, the change detector)."""

    def __init__(
        self,
        directory: Path,
        agreement: Agreement,
        encoder: Encoder,
        incremental: IncrementalOptions,
        files: FileOptions,
        splits: Mapping[str, Split | None],
        modes: Modes,
        tier: NodeLocalTier | None,
        settle: Callable[[], None] = lambda: None,
    ) -> None:
        self.directory = directory
        #: Waits for what else changes the directory (a prune): before a save reads it.
        self.settle = settle
        self.agreement = agreement
        self.encoder = encoder
        self.files = files
        self.splits = splits
        self.modes = modes
        self.tier = tier
        self.rank, self.nranks = agreement.rank, agreement.nranks
        self.block_size = int(incremental.block_size)  # type: ignore[arg-type]
        self.chain_policy = incremental.chain_policy
        #: How synchronous saves find changed blocks (:mod:`.save.change_detection`).
        self.changes = ChangeDetector(incremental.change_detection)
        #: This rank's hashes of the last committed or restored checkpoint (None: next is full).
        self.last: ChainState | None = None
        self.tuning: filesystem.Tuning | None = None  # decided at the first save
        self.paths: write_path.WritePathChooser | None = None  # made at the first save
        self._local_ranks: int | None = None  # ranks on this node (the first staged save)
        self._full_ahead = 0  # staged saves left that go full without comparing (learn)
        self.deferred: DeferredSaves | None = None  # staged saves made in the background
        self._deferred_tried = False

    def defers(self, state: Any, buffers: HostBuffers | None, redrain: bool = False) -> bool:
        """Whether :meth:`begin_save` runs its collective steps in the background
        (:mod:`.save.deferred`): after a restore or the first, a save staged in memory or
        on a node-local tier whose copies each rank seals alone (no redundancy)."""
        return self.deferred is not None and self._may_defer(state, buffers, redrain)

    def _may_defer(self, state: Any, buffers: HostBuffers | None, redrain: bool) -> bool:
        """A staged save in memory, or one whose node-local copy each rank seals alone."""
        if state is None or redrain:
            return False
        return self.tier.seals_alone() if self.tier is not None else buffers is not None

    def prepare_deferred(self, state: Any, buffers: HostBuffers | None) -> None:
        """Collective, before the first save (at a restore): the first staged save of
        ``state`` blocks for its copy only too (its file's tuning made in the background)."""
        if self._may_defer(state, buffers, False):
            self._make_deferred()

    def _make_deferred(self) -> None:
        """The background saves' group, made once by every rank (if the comm can)."""
        if not self._deferred_tried:
            self._deferred_tried = True
            background = self.agreement.comm.background()
            if background is not None:
                self.deferred = DeferredSaves(Agreement(background))

    # -- what the restore side tells it ----------------------------------------------------
    def remember(self, chain: ChainState | None) -> None:
        """The checkpoint just restored: the next save may be a delta of it (None: full)."""
        self.last = chain

    def forget_changes(self) -> None:
        """A restore writes into the arrays: what was tracked as written is moot."""
        self.changes.reset()

    @property
    def direct_io(self) -> bool:
        """Whether array bytes go past the page cache, written and read back: the tuning
        plan's choice, or before the first save (a restore) the same rule for this
        directory's file system."""
        if self.tuning is not None:
            return self.tuning.direct_io
        tuning = self.files.tuning
        return filesystem.direct_io(filesystem.detect(self.directory), tuning)

    # -- synchronous -------------------------------------------------------------------------
    def save(
        self, step: int, state: dict[str, Any], extra_meta: dict[str, Any] | None = None
    ) -> SaveResult:
        """Steps 1-5 for ``state``; returns after the commit (see the module's docs)."""
        t0 = time.perf_counter()
        memory.reset_peak()
        final, partial = self.names(step)
        encoded, parent = self._prepare(step, state)
        arrays = encoded.arrays
        known, found = self.changes.hashes(
            arrays,
            self.last,
            parent,
            self.chain_policy,
            self.block_size,
            blocks.specs_of(arrays, self.splits),
            set(encoded.known_hashes),
            self.nranks,
        )
        written, error = self.create(
            partial,
            step,
            encoded,
            arrays,
            extra_meta,
            parent,
            hashes={**encoded.known_hashes, **known},
            hash_while_writing=True,  # a full file: hashed while the device writes
        )
        direct, t_write, per_rank = False, time.perf_counter(), 0
        if written is not None:  # the ranks agree once, on creating and writing alike
            per_rank = written.data_bytes // self.nranks
            direct = self._path_chooser().direct(per_rank)
            t_write = time.perf_counter()
            error = self._write_data(partial, written, direct)
        write_seconds = time.perf_counter() - t_write
        faults.fault_point("write.closed")
        error = safety.explain_write_error(error, self.directory, encoded.state_bytes)  # ENOSPC
        self.agree_or_discard(error, f"writing checkpoint of step {step}", partial)
        assert written is not None
        audit = self.changes.audit(written.state.hashes, self.last)
        (seconds, peak, slowest_write, hashed, pages, scan, audits), cleared = self._commit(
            partial,
            final,
            step,
            lambda: (
                time.perf_counter() - t0,
                memory.peak_rss_bytes(),
                write_seconds,
                found.bytes_hashed,
                found.pages,
                found.scan_seconds,
                float(audit is not None),
            ),
        )
        decision = self._path_chooser().record(per_rank, direct, slowest_write)
        if audits:
            audit = audit or "another rank's self-audit found a change the kernel did not report"
            log.warning("rank %d: write tracking switched off: %s", self.rank, audit)
        self.changes.committed(written.uid, audit)
        self.last = written.state
        if self.tier is not None:
            self.tier.committed(step)  # the directory's newest is newer than any copy
        return SaveResult(
            step=step,
            path=final,
            bytes_written=written.all_bytes,
            seconds=seconds,
            kind=written.kind,
            dirty_blocks=written.dirty_blocks,
            total_blocks=written.total_blocks,
            peak_rss=int(peak),
            write_path="direct" if direct else "buffered",
            write_decision=decision,
            change_detection=found.method,
            pages_written=int(pages),
            bytes_hashed=int(hashed),
            scan_seconds=scan,
            tracking_audit=audit,
            full_reason=written.full_reason,
            cleared_bad_mark=cleared,
        )

    # -- staged ------------------------------------------------------------------------------
    def begin_save(
        self,
        step: int,
        state: dict[str, Any] | None,
        extra_meta: dict[str, Any] | None = None,
        *,
        buffers: HostBuffers | None = None,
        redrain: bool = False,
    ) -> PendingSave:
        """Steps 1-3 with the array bytes written by a thread per rank; returns at once.

        The state is staged in ``buffers`` (host memory) or, with a node-local tier, in
        this rank's files there; with both, a deferred save copies into ``buffers`` and
        its thread into the tier (:class:`~.save.staging_modes.MemoryThenLocal`).
        ``redrain``: drain the tier's copy of ``step`` (just restored, or held for the
        drain) as it is; with ``state=None`` the copy's own tree and arrays stand for the
        state. :meth:`finish_save` commits.
        """
        if buffers is None and self.tier is None:
            raise ValueError(
                "a staged save needs a staging area: host buffers (async_save) or a cache"
            )
        if self.defers(state, buffers, redrain):  # blocks for the copy only
            assert self.deferred is not None and state is not None
            return self.deferred.begin(self, step, state, extra_meta, buffers)
        if self.tier is not None:
            buffers = None  # the tier stages it; host buffers serve deferred saves only
        if self._may_defer(state, buffers, redrain):  # the saves after this one are deferred
            self._make_deferred()
        copy = None
        if redrain:
            if self.tier is None:
                raise ValueError(f"nothing to drain again: step {step} is not a node-local copy")
            copy = self.tier.drain_copy(step)
        t0 = time.perf_counter()
        memory.reset_peak()
        final, partial = self.names(step)
        if buffers is not None:  # device tensors are copied straight into its buffers
            buffers.reset_peak()
            with buffers.lending(self.changes.device_copies(self.last, self.chain_policy)):
                encoded, parent = self._prepare(step, state, copy if state is None else None)
        else:
            encoded, parent = self._prepare(step, state, copy if state is None else None)
        mode: StagingMode
        if copy is not None:
            assert self.tier is not None
            mode = Redrain(self.tier, copy, self.block_size)
        elif self.tier is not None:  # a full save: the copy hashed and sealed in the background
            mode = NodeLocal(self.tier, hash_later=parent is None and self.tier.seals_alone())
        else:
            assert buffers is not None
            mode = self._in_memory(buffers, encoded.arrays, parent)  # or StagingRefused
            if mode.hash_later:
                parent = None  # a full file (no parent, or deltas have not paid lately)
        # In memory the uid comes with the file's plan and a failed copy is agreed on with
        # the file's creation: two collectives fewer in the blocked window.
        in_memory = mode.name is not None
        uid = None if in_memory else self.agreement.from_root(_new_uid)
        stage_error: BaseException | None = None
        staged = None
        try:
            staged = mode.stage(step, encoded.arrays)
        except Exception as exc:  # every rank must reach the agreement below
            stage_error = exc
        if not in_memory:
            self.agreement.agree(stage_error, f"staging checkpoint of step {step}{mode.where}")
        if staged is None:  # the file is created all the same, then discarded by every rank
            staged = Staged(encoded.arrays)
        uid = staged.uid or uid
        mode.staged(step, uid, encoded.tree, encoded.arrays, staged, encoded.replicated)
        faults.fault_point("stage.written")
        written, error = self.create(
            partial, step, encoded, staged.arrays, extra_meta, parent,
            hashes=staged.hashes or None, uid=uid, hash_while_writing=mode.hash_later,
        )  # fmt: skip
        error = safety.explain_write_error(error, self.directory, encoded.state_bytes)  # ENOSPC
        what = f"creating the file of checkpoint of step {step}"
        if in_memory:
            what = f"staging checkpoint of step {step}{mode.where} and {what}"
        self.agree_or_discard(stage_error or error, what, partial)
        assert written is not None
        self.learn(written, parent if mode.name == "copy" else None)
        writer = mode.start(
            partial, list(written.extents), self.direct_io, written.hashing, written.state.hashes
        )
        foreground = time.perf_counter() - t0
        (blocked,) = self.agreement.slowest(foreground)
        return PendingSave(
            step=step,
            partial=partial,
            final=final,
            written=written,
            writer=writer,
            foreground=foreground,
            blocked=blocked,
            bytes_total=written.all_bytes,
            staging=mode.name,
            staging_bytes=mode.held_bytes,
        )

    def finish_save(self, pending: PendingSave) -> SaveResult:
        """Steps 4-5 of a staged save, once every rank's background write is done.

        If any rank's write failed, the partial file is deleted and CheckpointError is
        raised on every rank: the checkpoint never becomes good.
        """
        t_wait = time.perf_counter()
        pending.writer.wait()
        log.debug("rank %d waited %.3f s for its background write",
                  self.rank, time.perf_counter() - t_wait)  # fmt: skip
        if pending.behind is None:  # not committed by the deferred saves' thread
            try:
                pending.behind = self.commit_staged(pending)
            except CheckpointError as exc:
                pending.behind = exc
        if isinstance(pending.behind, BaseException):
            if self.tier is not None and isinstance(pending.behind, CheckpointError):
                self.tier.drain_failed()  # the node-local copy is the newest
            raise pending.behind
        return self._result(pending, *pending.behind)

    def commit_staged(
        self, pending: PendingSave, agreement: Agreement | None = None
    ) -> tuple[list[float], str | None]:
        """Steps 4-5 once this rank's background write ended: whether every rank sealed
        its node-local copy alone, if so; raise on every rank if any rank's write failed,
        else rename into place durably (:meth:`_commit`); agreed over ``agreement`` (the
        deferred saves' thread's, when that thread commits)."""
        if pending.writer.seals:
            assert self.tier is not None
            if pending.writer.seal_error is not None:
                log.warning("rank %d: cannot seal its copy in %s: %s",
                            self.rank, self.tier.path, pending.writer.seal_error)  # fmt: skip
            everyone = (agreement or self.agreement).everyone(pending.writer.sealed)
            self.tier.sealed_alone(pending.step, everyone)
        error = safety.explain_write_error(
            pending.writer.error, self.directory, pending.bytes_total
        )
        what = f"writing checkpoint of step {pending.step} in the background"
        self.agree_or_discard(error, what, pending.partial, agreement)
        t_commit = time.perf_counter()
        # Staging to durable bytes, plus the commit: what a synchronous save would have cost.
        return self._commit(
            pending.partial,
            pending.final,
            pending.step,
            lambda: (
                pending.foreground + pending.writer.seconds + (time.perf_counter() - t_commit),
                memory.peak_rss_bytes(),
                pending.staging_bytes,
                # a deferred save's: this rank's, still counting if its save() waits for this
                pending.blocked or time.perf_counter() - pending.begun,
            ),
            agreement,
        )

    def _result(
        self, pending: PendingSave, measured: Sequence[float], cleared: str | None
    ) -> SaveResult:
        """The committed save's result, and what the saver learns from it."""
        seconds, peak, held, pending.blocked = measured
        assert pending.written is not None
        self.last = pending.written.state
        if self.tier is not None:
            self.tier.committed(pending.step)
        w = pending.written
        return SaveResult(
            step=pending.step,
            path=pending.final,
            bytes_written=pending.bytes_total,
            seconds=seconds,
            kind=w.kind,
            dirty_blocks=w.dirty_blocks,
            total_blocks=w.total_blocks,
            blocked_seconds=pending.blocked,
            peak_rss=int(peak),
            staging=pending.staging,
            staging_bytes=int(held),
            full_reason=w.full_reason,
            cleared_bad_mark=cleared,
        )

    def learn(self, written: Written, parent: ChainState | None) -> None:
        """After a staged save in memory that hashed in the foreground to compare with
        ``parent``: when the chain policy still wrote it full because a delta would not
        pay (most blocks changed), the next :data:`FULL_AFTER_CHANGED` staged saves skip
        the comparison (full, hashed in the background). Every rank decides alike:
        ``written``'s kind and reason, and ``parent``, are the same on every rank."""
        if parent is not None and delta_did_not_pay(written, parent):
            self._full_ahead = FULL_AFTER_CHANGED
        elif self._full_ahead:
            self._full_ahead -= 1

    def _in_memory(
        self, buffers: HostBuffers, arrays: dict[str, Any], parent: ChainState | None = None
    ) -> StagingMode:
        """This rank's way to stage ``arrays`` in host memory within its budget: one copy,
        hashed during it only when the save may be a delta of ``parent`` (and deltas
        paid lately: :meth:`_learn`).

        Raises StagingRefused on every rank when any rank is too short of memory
        (:mod:`.save.staging_budget`): then nothing is staged, nothing written.
        """
        plan = self.local_plan(buffers, arrays)
        short = self.agreement.comm.allreduce(
            self.rank if plan.mode == staging_budget.SYNC else -1, MAX
        )
        if short >= 0:
            buffers.release()  # a synchronous save comes next: give the memory back
            why = self.agreement.comm.bcast(plan.reason, root=short)
            raise StagingRefused(f"rank {short}: {why}")
        if plan.mode == staging_budget.PIECES:
            return Pieces(buffers, plan)
        compare = parent is not None and not self._full_ahead
        return HostCopy(buffers, self.block_size, hashed=compare)

    def local_plan(
        self, buffers: HostBuffers, arrays: dict[str, Any], copies: int = 1
    ) -> StagingPlan:
        """How this rank can stage ``arrays`` within its budget, decided alone (the ranks
        on its node are counted at the first staged save); ``copies``: of the arrays'
        bytes counted against it (2: a cache save's host copy and the tier's own)."""
        if self._local_ranks is None:
            self._local_ranks = buffers.local_ranks  # learnt by its reserve(), if any
        if self._local_ranks is None:
            node = self.agreement.comm.split_node()
            self._local_ranks = buffers.local_ranks = node.size
            node.free()
        mine = copies * sum(a.nbytes for a in arrays.values())
        return buffers.plan(mine, self._local_ranks)

    def may_compare(self) -> bool:
        """Whether a staged save may be a delta of the last checkpoint, as far as this
        rank knows before the ranks agree (the chain's check rides on their agreement):
        then a deferred save's thread hashes its copy before it plans the file."""
        incremental = self.chain_policy.incremental and not self._full_ahead
        return incremental and self.last is not None

    # -- the steps ---------------------------------------------------------------------------
    def names(self, step: int) -> tuple[Path, Path]:
        final = self.directory / layout.checkpoint_name(step)
        return final, final.with_name(final.name + layout.PARTIAL)

    def _prepare(
        self, step: int, state: dict[str, Any] | None, copy: fast_tier.LocalCopy | None = None
    ) -> tuple[Encoded, ChainState | None]:
        """Steps 1-2 up to the file, agreed in one reduction: the encoded state and the
        checkpoint this one may be a delta of. With ``copy`` (a node-local copy drained
        as it is) its tree and arrays stand for the state.

        While the ranks encode, rank 0 checks the chain the next delta would extend;
        the reduction that agrees on the encoding carries its answer. Rank 0 writes to
        the directory (:meth:`_prepare_directory`) only once every rank's state encoded,
        just before it creates the file, whose agreement covers it.
        """
        if copy is None:
            encoded = self.encoder.encode(step, state, self.chain_intact())
        else:
            arrays = fast_tier.maps(copy)
            mine = sum(a.nbytes for a in arrays.values())
            state_bytes, chain = self.agreement.agree(
                None, f"reading node-local step {step}", extra=(mine, self.chain_intact())
            )
            encoded = Encoded(
                copy.tree, arrays, state_bytes, bool(chain), replicated=set(copy.replicated)
            )
        faults.fault_point("save.begin", step)
        self.tune(encoded.state_bytes)
        return encoded, self.last if encoded.answer else None

    def chain_intact(self) -> bool:
        """Rank 0: whether the next save may be a delta of the last checkpoint: every file
        of its chain still there and not marked bad (someone may have moved or pruned
        them). Other ranks: False (the agreement sums rank 0's answer)."""
        if self.rank != 0 or not self.chain_policy.incremental or self.last is None:
            return False
        return all(
            (self.directory / name).is_file() and layout.read_bad(self.directory / name) is None
            for name, _, _ in self.last.chain
        )

    def tune(self, state_bytes: int, agreement: Agreement | None = None) -> None:
        """At the first save (no :attr:`tuning` yet), rank 0 detects the file system and
        stripes the directory; every rank keeps the plan in :attr:`tuning` (over
        ``agreement``'s ranks: the saver's own when None). Once every rank's state encoded:
        rank 0 creates the directory here so that it can be striped (a failure is reported
        by the file's creation, which tries again)."""
        if self.tuning is not None:
            return
        options = self.files.tuning

        def decide() -> filesystem.Tuning:
            try:
                safety.make_directory(self.directory, self.modes.directory)
            except OSError as exc:
                log.debug("cannot create %s yet: %s", self.directory, exc)
            fs = filesystem.detect(self.directory)
            plan = filesystem.plan(self.directory, fs, self.nranks, state_bytes, options)
            if plan.setstripe_argv:
                why = filesystem.apply_setstripe(plan.setstripe_argv)
                if why:
                    log.warning("could not stripe %s (%s); writing anyway", self.directory, why)
            log.info("file system %s (%s), direct I/O %s", fs.kind, fs.name, plan.direct_io)
            return plan

        self.tuning = (agreement or self.agreement).from_root(decide)

    def _prepare_directory(self, state_bytes: int) -> None:
        """Step 2, rank 0, right before it creates the file: the directory (owner-only),
        no ``*.partial`` leftovers, room for ``state_bytes`` (ENOSPC before HDF5 sees it)."""
        safety.make_directory(self.directory, self.modes.directory)
        for leftover in layout.partials(self.directory):
            log.info("removing leftover %s from an interrupted save", leftover.name)
            safety.remove_leftover(leftover)  # a link is unlinked, never followed
        safety.check_free_space(self.directory, state_bytes)

    def create(
        self,
        partial: Path,
        step: int,
        encoded: Encoded,
        arrays: dict[str, Any],
        extra_meta: dict[str, Any] | None,
        parent: ChainState | None,
        agreement: Agreement | None = None,
        **options: Any,
    ) -> tuple[Written | None, BaseException | None]:
        """Step 3 without the agreement: (what this rank writes, or the error it met);
        over ``agreement``'s ranks (the saver's own when None)."""
        error: BaseException | None = None
        written: Written | None = None
        try:
            written = write_file(
                partial,
                (agreement or self.agreement).comm,
                step,
                encoded.tree,
                arrays,
                extra_meta,
                distributed=self.splits,
                alignment=self.tuning.alignment if self.tuning else None,
                block_size=self.block_size,
                parent=parent,
                policy=self.chain_policy,
                replicated=encoded.replicated,
                prepare=self._prepare_directory,
                **options,
            )
            faults.fault_point("save.prepared")
            if self.rank == 0:  # now, so that the ranks' fsyncs make the mode durable too
                safety.set_mode(partial, self.modes.file)  # created with the umask
        except Exception as exc:  # every rank must reach the agreement
            error = exc
        return written, error

    def _path_chooser(self) -> write_path.WritePathChooser:
        """Direct or buffered writes for synchronous saves (decided at the first save)."""
        if self.paths is None:
            chosen = self.files.tuning.direct_io
            self.paths = write_path.WritePathChooser(self.direct_io, chosen)
        return self.paths

    def _write_data(self, partial: Path, written: Written, direct: bool) -> BaseException | None:
        """Step 3b: this rank writes its part into the created ``.partial`` and fsyncs it
        (:mod:`.io.direct_io`), hashing its arrays meanwhile if they were not hashed yet;
        the error it met, for the agreement."""
        hashing = written.hashing
        try:
            direct_io.write_extents(
                partial,
                written.extents,
                direct=direct,
                before=None if hashing is None else hashing.before,
                after=lambda i: faults.fault_point("write.data"),  # tests: die mid-data
                progress=None if hashing is None else hashing.progress,
            )
        except Exception as exc:  # every rank must reach the agreement
            return exc
        return None

    def agree_or_discard(
        self,
        error: BaseException | None,
        what: str,
        partial: Path,
        agreement: Agreement | None = None,
    ) -> None:
        """Step 4: raise on every rank if any failed, rank 0 deleting the ``.partial``."""
        try:
            (agreement or self.agreement).agree(error, what)
        except CheckpointError:
            if self.rank == 0:
                safety.remove_leftover(partial)  # never a directory someone put there
            raise

    def _commit(
        self,
        partial: Path,
        final: Path,
        step: int,
        measure: Callable[[], Sequence[float]],
        agreement: Agreement | None = None,
    ) -> tuple[list[float], str | None]:
        """Step 5: rank 0 renames the file into place durably; agreed in the same reduction
        that gives the largest of each of ``measure()`` over the ranks. With them, on every
        rank, the reason of the bad mark of the file this one replaced (None: none), which
        rank 0 removed: it judged that file, not this one."""
        error: BaseException | None = None
        cleared: str | None = None
        if self.rank == 0:
            try:
                durability.publish(partial, final)
                faults.fault_point("commit.renamed")
            except OSError as exc:
                error = exc
            else:
                cleared = self._clear_marks(final)
        agreement = agreement or self.agreement
        *out, failed, marked = agreement.slowest(
            *measure(), float(error is not None), float(cleared is not None)
        )
        if failed:
            agreement.agree_root(error, f"committing checkpoint of step {step}")
        if marked:  # rare: one more bcast for its reason
            cleared = agreement.from_root(lambda: cleared)
        return out, cleared

    def _clear_marks(self, final: Path) -> str | None:
        """Rank 0, after the rename: the marks of the file ``final`` replaced are removed
        (a failure is only logged: a mark left there is ignored, :func:`.file.layout.read_bad`)."""
        try:
            return layout.clear_marks(final)
        except OSError as exc:
            log.warning("cannot remove the bad mark of the file %s replaced: %s", final.name, exc)
            return None


def _new_uid() -> str:
    return uuid.uuid4().hex
