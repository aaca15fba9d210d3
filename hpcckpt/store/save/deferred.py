"""A staged save that blocks for its copy only: the ranks agree on it, rank 0 creates its
file and every rank writes it, all in a background thread over a group of its own.

Otherwise a staged save in memory agrees on the encoding and the staging budget and
creates the file (a gather, rank 0's HDF5 file creation, a bcast, a reduction) while the
ranks wait, and the slowest rank sets everyone's pace. Here, once the group is made
(:meth:`~hpcckpt.store.comm.base.Comm.background`, by a restore or the first staged
save), each rank encodes its state and copies it into its host buffers alone and hands
the rest to its thread. The ranks' threads meet in the same order: at most one staged
save is pending, committed before the next begins. A rank whose budget holds no copy
writes from its live state and waits for that write (``Unstaged``); the others go on.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from typing import Any

from hpcckpt.store.agreement import Agreement
from hpcckpt.store.comm import MAX
from hpcckpt.store.io import blocks, faults, memory, safety
from hpcckpt.store.save import staging_budget
from hpcckpt.store.save.background import BackgroundWrite, DeferredWrite
from hpcckpt.store.save.pending import PendingSave
from hpcckpt.store.save.staging import HostBuffers
from hpcckpt.store.save.staging_budget import StagingPlan
from hpcckpt.store.save.staging_modes import (
    HostCopy,
    MemoryThenLocal,
    NodeLocal,
    Pieces,
    Staged,
    StagingMode,
    Unstaged,
)
from hpcckpt.store.tree.encoding import LocalEncoding, encode_local

#: The :class:`~hpcckpt.store.save.commit.Saver` these saves belong to (which imports
#: this module): its public steps are what a deferred save runs.
Saver = Any


class DeferredSaves:
    """Staged saves in memory whose collective steps run in a background thread, over
    ``agreement`` (the same ranks as the saver's, in a group made for it)."""

    def __init__(self, agreement: Agreement) -> None:
        self.agreement = agreement
        self.job: DeferredWrite | None = None  # the last save's
        # One thread for every save: handing it a save costs no thread start (which
        # waits up to the interpreter's switch interval for the new thread).
        self._queue: queue.SimpleQueue[DeferredWrite | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="hpcckpt-save", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            job.run()

    def close(self) -> None:
        """Stop the thread and release its group, unless a save may still hold them (one
        never committed: a rank failed); the process's end releases them then."""
        if self.job is None or self.job.done():
            self._queue.put(None)
            self._thread.join()
            self.agreement.comm.free()

    def begin(
        self,
        saver: Saver,
        step: int,
        state: dict[str, Any],
        extra_meta: dict[str, Any] | None,
        buffers: HostBuffers | None,
    ) -> PendingSave:
        """Encode and copy this rank's state (no collective) and start the thread that
        makes the checkpoint's file and writes it; :meth:`Saver.finish_save` commits.
        With a node-local tier the copy is sealed by each rank alone in the thread
        (``NodeLocalTier.seals_alone``): it goes into ``buffers`` when their budget holds
        it, and from there into the tier in the thread; otherwise straight into the tier."""
        t0 = time.perf_counter()
        memory.reset_peak()
        final, partial = saver.names(step)
        stage_error: BaseException | None = None
        mode: StagingMode
        if buffers is None:
            local = encode_local(state)
        else:
            buffers.reset_peak()
            with buffers.lending(saver.changes.device_copies(saver.last, saver.chain_policy)):
                local = encode_local(state)
        if saver.tier is not None:  # through memory when the budget holds both copies
            plan = StagingPlan(staging_budget.COPY, 0, 0, None)  # the tier's own room
            mode = NodeLocal(saver.tier, hash_later=True)
            if buffers is not None and _fits(saver, buffers, local.arrays):
                mode = MemoryThenLocal(saver.tier, buffers)
        else:
            assert buffers is not None
            try:
                plan = saver.local_plan(buffers, local.arrays)
            except Exception as exc:  # every rank must reach the agreement (in the thread)
                plan, stage_error = StagingPlan(staging_budget.SYNC, 0, 0, None, str(exc)), exc
            mode = _mode(saver, buffers, plan)
        faults.fault_point("save.begin", step)
        staged = Staged(local.arrays)
        if local.error is None and stage_error is None:
            try:
                staged = mode.stage(step, local.arrays)
            except Exception as exc:  # every rank must reach the agreement (in the thread)
                stage_error = exc
        faults.fault_point("stage.written")
        pending = PendingSave(
            step=step,
            partial=partial,
            final=final,
            written=None,
            writer=None,  # type: ignore[arg-type]  # the thread, made next
            foreground=0.0,
            blocked=0.0,
            bytes_total=0,
            staging=mode.name,
            staging_bytes=mode.held_bytes,
            deferred=True,
            begun=t0,
        )
        job = _Job(self.agreement, saver, pending, local, staged, stage_error, mode, plan)
        write = DeferredWrite(
            lambda: job.run(extra_meta),
            launch=lambda: self._queue.put(write),
            seals=isinstance(mode, NodeLocal),
            # The thread commits too: the next save() does not wait for it.
            after=lambda: _commit_behind(saver, pending, self.agreement),
        )
        pending.writer = self.job = write  # its thread takes it at go(), after save()'s last word
        if plan.mode != staging_budget.COPY:  # its live state is written: it waits
            write.wait()
        pending.foreground = pending.blocked = time.perf_counter() - t0
        return pending


def _commit_behind(saver: Saver, pending: PendingSave, agreement: Agreement) -> None:
    """Steps 4-5 in the deferred saves' thread, right after this rank's write and seal
    (every rank's thread comes here), over that thread's ``agreement``: the next
    ``save()`` finds the checkpoint committed instead of committing it in its blocked
    window. The outcome, or the error every rank raised alike, goes into
    ``pending.behind`` (raised by :meth:`Saver.finish_save`)."""
    try:
        pending.behind = saver.commit_staged(pending, agreement)
    except BaseException as exc:  # raised by finish_save, on every rank alike
        pending.behind = exc


def _fits(saver: Saver, buffers: HostBuffers, arrays: dict[str, Any]) -> bool:
    """Whether this rank's budget holds a whole copy of ``arrays`` in ``buffers`` and the
    tier's copy beside it (a memory file system's pages are the node's memory too)."""
    try:
        return saver.local_plan(buffers, arrays, copies=2).mode == staging_budget.COPY
    except Exception:  # no room said otherwise: the copy goes straight to the tier
        return False


def _mode(saver: Saver, buffers: HostBuffers, plan: StagingPlan) -> StagingMode:
    """This rank's staging for ``plan``: a copy (never hashed here: the thread hashes
    the copy, before it plans a delta or while it writes a full file), pieces through
    a ring of the budget's size, or none."""
    if plan.mode == staging_budget.COPY:
        return HostCopy(buffers, saver.block_size, hashed=False)
    if plan.mode == staging_budget.PIECES:
        return Pieces(buffers, plan)
    return Unstaged(buffers, saver.block_size)


class _Job:
    """The steps a deferred save runs in its thread, in the order every rank runs them."""

    def __init__(
        self,
        agreement: Agreement,
        saver: Saver,
        pending: PendingSave,
        local: LocalEncoding,
        staged: Staged,
        stage_error: BaseException | None,
        mode: StagingMode,
        plan: StagingPlan,
    ) -> None:
        self.agreement, self.saver, self.pending = agreement, saver, pending
        self.local, self.staged, self.stage_error = local, staged, stage_error
        self.mode, self.plan = mode, plan
        #: Whether the save may be a delta: the same on every rank (what each knows of
        #: the last checkpoint and of the deltas lately; the chain's check is agreed).
        self.compare = saver.may_compare()

    def run(self, extra_meta: dict[str, Any] | None) -> BackgroundWrite:
        """Steps 1-3 over the thread's group; the started write of this rank's extents.
        Raises on every rank alike (kept by the thread for the commit's agreement)."""
        comm, saver, pending = self.agreement.comm, self.saver, self.pending
        step, partial = pending.step, pending.partial
        saver.settle()  # a prune under way ends before rank 0 reads the directory
        if isinstance(self.mode, MemoryThenLocal) and self.stage_error is None:
            try:  # every rank must reach the agreement below
                self.staged = self.mode.to_tier(step, self.staged)
            except Exception as exc:
                self.stage_error = exc
            else:  # the next save's plan (both copies), measured here
                self.mode.buffers.look(copies=2)
        sync = self.plan.mode == staging_budget.SYNC
        short = comm.allreduce(saver.rank if sync else -1, MAX)
        if short >= 0:  # said once, at the commit
            pending.refused = f"rank {short}: {comm.bcast(self.plan.reason, root=short)}"
        try:
            answer = saver.chain_intact()
        except OSError:  # an unreadable chain: this save is full
            answer = False
        arrays = self.staged.arrays  # the copies (or, unstaged, the live arrays)
        encoded = saver.encoder.agree_on(
            step, LocalEncoding(self.local.tree, arrays, self.local.error), answer, self.agreement
        )
        uid = copied = None  # in memory: the uid comes with the file's plan
        if isinstance(self.mode, NodeLocal):
            # Its seal describes the copy as written (a rank other than 0 holds its own copy
            # of a replicated array, which the file stands in for): hashed here, whole; the
            # file takes the hashes of the arrays it writes as they are.
            uid = self.agreement.from_root(lambda: uuid.uuid4().hex)
            self.mode.staged(step, uid, encoded.tree, arrays, self.staged, encoded.replicated)
            copied = self.staged.hashes or {
                n: blocks.block_hashes(a, saver.block_size) for n, a in arrays.items()
            }
        # A copy may be a delta: hashed first, then planned. Otherwise, as a classic
        # staged save does, a staging not hashed in the foreground is written full.
        copy = self.mode.name == "copy" or copied is not None
        delta = self.compare if copy else not self.mode.hash_later
        parent = saver.last if encoded.answer and delta else None
        # Nothing was hashed in the foreground: the file's writer hashes the staging, before
        # it plans a delta or while it writes a full file.
        saver.tune(encoded.state_bytes, self.agreement)  # the first save, after a restore
        known = None
        if copied is not None:
            known = {n: h for n, h in copied.items() if encoded.arrays.get(n) is arrays[n]}
        written, error = saver.create(
            partial, step, encoded, encoded.arrays, extra_meta, parent, self.agreement,
            hashes=known, uid=uid,
            hash_while_writing=parent is None and self.mode.hash_later and copied is None,
        )  # fmt: skip
        error = safety.explain_write_error(error, saver.directory, encoded.state_bytes)
        saver.agree_or_discard(
            self.stage_error or error,
            f"staging checkpoint of step {step}{self.mode.where} and creating its file",
            partial,
            self.agreement,
        )
        assert written is not None
        saver.learn(written, parent if self.mode.name == "copy" else None)
        pending.written, pending.bytes_total = written, written.all_bytes
        if isinstance(self.mode, HostCopy):
            self.mode.buffers.look()  # the next save's plan, measured here
        return self.mode.start(
            partial,
            list(written.extents),
            saver.direct_io,
            written.hashing,
            written.state.hashes if copied is None else copied,
        )
