"""The checkpoint store: save a state collectively and durably, restore the newest good one.

Commit protocol of one save (all ranks take part; see docs/format.md):

1. every rank encodes its state while rank 0 checks that the last checkpoint's chain
   is intact (reading the directory only); one reduction agrees on both;
2. rank 0 creates the directory (owner-only), removes ``*.partial`` leftovers and
   checks the free space, right before step 3 and within its agreement; on the first
   save it also applies the file-system tuning (``lfs setstripe`` on Lustre);
3. rank 0 creates ``ckpt-<step>.h5.partial`` with all its metadata and contiguous
   datasets allocated, from every rank's specs (a gather; plain HDF5, no MPI-IO); every
   rank learns its offsets (a bcast, which also carries step 2's outcome, and a prefix
   sum) and writes its own part (tree,
   checksums, block hashes, array bytes: ``O_DIRECT`` where the file system takes it,
   :mod:`.direct_io`) and fsyncs;
4. the ranks agree that every one of them succeeded (one reduction); if not, rank 0
   deletes the partial file and every rank raises;
5. rank 0 renames it to ``ckpt-<step>.h5`` and fsyncs the directory (the file itself
   is durable already: every rank fsynced it after its last write, rank 0 after
   creating it and setting its mode, and step 4 agreed that every fsync succeeded).

Only step 5 makes the checkpoint visible, so a crash at any moment leaves either
the previous set of checkpoints or the previous set plus this complete one.

A *staged* save (:meth:`CheckpointStore.begin_save`, used by ``Checkpointer(async_save=True)``
and ``Checkpointer(cache=PATH)``) runs steps 1-2, copies the state to a staging area
(host buffers, or node-local files: :mod:`hpcckpt.store.fast_tier`), creates the
``.partial`` file with all its metadata and returns; a thread per rank writes the
array bytes and fsyncs (:mod:`hpcckpt.store.staging`). :meth:`CheckpointStore.finish_save`
then runs steps 4-5. Until then the checkpoint is not visible, exactly as above.

Saves are incremental by default: each rank hashes its arrays' blocks while saving
and remembers the hashes of the last committed (or restored) checkpoint; the next
save writes only the blocks whose hash changed, into a file that names the files it
is built on (its chain). The chain is bounded (``max_chain``, ``max_chain_fraction``):
past either bound, or when the layout changed, the save is a full checkpoint.

Over 500 lines on purpose: the commit protocol (write, verify, rename, fsync, retain)
is one sequence that must be read as a whole to be trusted.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcckpt.store import (
    blocks,
    direct_io,
    durability,
    fast_tier,
    faults,
    filesystem,
    layout,
    local_tier,
    memory,
    read_plan,
    retention,
    safety,
    staging_budget,
    tensors,
    write_path,
)
from hpcckpt.store import redundancy as redundancy_mod
from hpcckpt.store.blocks import ChainPolicy, ChainState
from hpcckpt.store.change_detection import ChangeDetector
from hpcckpt.store.checkpoint_file import Written, write_file
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.reader import CheckpointReader
from hpcckpt.store.replicated import check_and_stand_in, normalize
from hpcckpt.store.resharding import Split, common_tree, even_split, resolve_ranges
from hpcckpt.store.results import RestoreResult, SaveResult
from hpcckpt.store.staging import BackgroundWrite, HostBuffers, stream_pieces
from hpcckpt.store.state_tree import (
    Targets,
    check_fits,
    decode_into,
    encode,
    escape,
    lookup,
    select_keys,
)

log = logging.getLogger("hpcckpt.store")

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "CorruptCheckpoint",
    "PendingSave",
    "RestoreResult",
    "SaveResult",
    "StagingRefused",
]


@dataclass
class PendingSave:
    """A staged save whose bytes are being written in the background (not committed)."""

    step: int
    partial: Path
    final: Path
    written: Written
    writer: BackgroundWrite
    foreground: float  # this rank's seconds in begin_save
    blocked: float  # the slowest rank's seconds in begin_save
    bytes_total: int  # over all ranks
    staging: str | None = None  # in memory: "copy" or "pieces" (staging_budget)
    staging_bytes: int = 0  # host bytes this rank's staging holds

    def done(self) -> bool:
        """Whether this rank's background write has finished (well or not); never blocks."""
        return self.writer.done()


class StagingRefused(Exception):
    """Raised on every rank by :meth:`CheckpointStore.begin_save` when some rank has too
    little memory to stage its state: nothing was written; save synchronously instead."""


class _Fatal(Exception):
    """A checkpoint that is fine but cannot be restored into this run: stop, do not fall back."""


class _Findings:
    """What one rank found while reading its part of a checkpoint, for the agreement
    that follows: damage (``problem``, the file at fault in ``culprit``) or a refusal
    (``fatal``). Used as a context manager around the read, it takes those errors."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.problem: str | None = None
        self.fatal: str | None = None
        self.culprit: Any = None

    def __enter__(self) -> _Findings:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, CorruptCheckpoint):
            self.problem, self.culprit = str(exc), exc.culprit
        elif isinstance(exc, CheckpointError):
            self.fatal = str(exc)
        elif isinstance(exc, (OSError, ValueError)):
            self.problem = f"{self.file}: unreadable ({type(exc).__name__}: {exc})"
        else:
            return False
        return True


class CheckpointStore:
    """A directory of checkpoints shared by the ranks of ``comm``.

    ``distributed`` names the arrays split along axis 0 across ranks (array paths:
    the state's keys joined by '/', e.g. ``"fields/u"``), as a collection or as a
    mapping to a split function ``split(global_rows, nranks, rank) -> (lo, hi)`` (or
    None). A distributed array is stored as the global array and can be restored on
    any number of ranks. ``tuning`` adjusts the file-system tuning
    (:class:`hpcckpt.store.filesystem.TuningOptions`).

    ``incremental`` (default True) writes only the blocks of ``block_size`` bytes
    that changed since the previous checkpoint; a full checkpoint is written after
    ``max_chain`` incremental ones, or once the incrementals since the last full one
    would hold more than ``max_chain_fraction`` of a full one's bytes, and a save is full
    when a delta would leave out fewer than ``min_delta_saving`` bytes (64 KiB) per
    array and rank, as with states of many small arrays
    (:class:`hpcckpt.store.blocks.ChainPolicy`, docs/format.md).

    ``change_detection``: how a synchronous save finds the changed blocks: "kernel"
    (the pages written since the last save, :mod:`.write_tracking`), "hashes" (hash every
    block), or "auto" (the kernel's when it can, else hashes).

    ``replicated`` names key paths (e.g. ``"model"``) whose values are identical on every
    rank: checked equal by checksum at each save, written once from rank 0, restorable
    on any rank count (:mod:`hpcckpt.store.replicated`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        comm: MPI.Comm,
        *,
        distributed: Iterable[str] | Mapping[str, Split | None] = (),
        tuning: filesystem.TuningOptions | None = None,
        share_group: bool = False,
        incremental: bool = True,
        block_size: int = blocks.DEFAULT_BLOCK_SIZE,
        max_chain: int = 8,
        max_chain_fraction: float = 0.5,
        min_delta_saving: int = blocks.DEFAULT_MIN_DELTA_SAVING,
        change_detection: str = "auto",
        replicated: Iterable[str] = (),
        redundancy: str | None = None,
        redundancy_set: int = redundancy_mod.DEFAULT_SET_SIZE,
        node: str | None = None,
    ) -> None:
        self.replicated = normalize(replicated)
        declared = [distributed] if isinstance(distributed, str) else list(distributed)
        clash = sorted(n for n in self.replicated if n in declared)
        if clash:
            raise ValueError(f"{clash} declared both distributed and replicated; choose one")
        #: Per save: the replicated array paths and rank 0's block hashes of them.
        self._replicated_paths: set[str] = set()
        self._known_hashes: dict[str, np.ndarray] = {}
        redundancy_mod.check_scheme(redundancy, redundancy_set)
        #: "partner", "xor" or None: how node-local copies survive a node (:mod:`.redundancy`).
        self.redundancy = redundancy
        self.redundancy_set = int(redundancy_set)
        #: This rank's node name: the failure group of the redundancy sets.
        self.node = node or fast_tier.host()
        self._sets: redundancy_mod.SetLayout | None = None
        #: The newest node-local checkpoint this run sealed (None: none yet).
        self.local_step: int | None = None
        self.block_size = blocks.check_block_size(block_size)
        self.chain_policy = ChainPolicy(
            bool(incremental), max_chain, max_chain_fraction, min_delta_saving
        )
        #: How synchronous saves find changed blocks (:mod:`.change_detection`).
        self.changes = ChangeDetector(change_detection)
        #: This rank's hashes of the last committed or restored checkpoint (None: next is full).
        self.last: ChainState | None = None
        self.directory = Path(directory).absolute()
        self.file_mode, self.dir_mode = safety.modes(share_group)  # 0600/0700, group: 0640/0750
        self.comm = comm
        self.rank = comm.Get_rank()
        self.nranks = comm.Get_size()
        if isinstance(distributed, str):
            distributed = [distributed]
        splits = dict(distributed) if isinstance(distributed, Mapping) else {}
        self.distributed: dict[str, Split | None] = {name: splits.get(name) for name in distributed}
        self.tuning_options = tuning or filesystem.TuningOptions()
        self.tuning: filesystem.Tuning | None = None  # decided at the first save
        #: This rank's node-local copy is newer than the directory's newest checkpoint
        #: (restored from it, or its drain failed): keep it until a newer one is sealed.
        self.local_newer = False
        #: This rank's node-local copy the last restore took (see ``begin_save(redrain=)``).
        self.restored_copy: fast_tier.LocalCopy | None = None
        #: Node-local files the last restore found damaged and set aside, never tried
        #: again: (step, node, file, reason) (:mod:`.local_restore`).
        self.local_set_aside: list[tuple[int, str, str, str]] = []
        self._local_ranks: int | None = None  # ranks on this node (the first staged save)
        self.paths: write_path.WritePathChooser | None = None  # made at the first save
        if redundancy is not None:  # collective; a layout without distinct nodes fails here
            self._sets = redundancy_mod.SetLayout.build(
                comm, self.node, redundancy, self.redundancy_set
            )
            local_tier.log_sets(self, self._sets)

    def _agree(
        self,
        error: BaseException | None,
        what: str,
        kind: type[Exception] = CheckpointError,
        extra: Sequence[int] = (),
    ) -> list[int]:
        """Raise on every rank if any rank failed; the message names the ranks and reasons.

        One reduction when all went well (the reasons are gathered only on failure);
        returns the sum over the ranks of each of ``extra``, which ride on it.
        """
        mine = np.array([error is not None, *extra], dtype=np.int64)
        total = np.empty_like(mine)
        self.comm.Allreduce(mine, total, op=MPI.SUM)
        if total[0]:
            errors = self.comm.allgather(
                None if error is None else f"{type(error).__name__}: {error}"
            )
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
            detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:4])
            raise kind(f"{what} failed ({detail})") from error
        return [int(x) for x in total[1:]]

    def _agree_root(self, error: BaseException | None, what: str) -> None:
        """Like :meth:`_agree` for what only rank 0 does: one broadcast of its outcome."""
        why = self.comm.bcast(None if error is None else f"{type(error).__name__}: {error}")
        if why is not None:
            raise CheckpointError(f"{what} failed (rank 0: {why})") from error

    # -- save ------------------------------------------------------------------------------
    def _tune(self, state_bytes: int) -> filesystem.Tuning:
        """Rank 0 detects the file system and stripes the directory; every rank gets the plan.

        At a store's first save, once every rank's state encoded: rank 0 creates the
        directory here so that it can be striped (a failure is reported by the file's
        creation, which tries again).
        """
        plan = None
        if self.rank == 0:
            try:
                safety.make_directory(self.directory, self.dir_mode)
            except OSError as exc:
                log.debug("cannot create %s yet: %s", self.directory, exc)
            fs = filesystem.detect(self.directory)
            plan = filesystem.plan(
                self.directory, fs, self.nranks, state_bytes, self.tuning_options
            )
            if plan.setstripe_argv:
                why = filesystem.apply_setstripe(plan.setstripe_argv)
                if why:
                    log.warning("could not stripe %s (%s); writing anyway", self.directory, why)
            log.info("file system %s (%s), direct I/O %s", fs.kind, fs.name, plan.direct_io)
        return self.comm.bcast(plan)

    def save(
        self, step: int, state: dict[str, Any], extra_meta: dict[str, Any] | None = None
    ) -> SaveResult:
        """Write ``state`` as the checkpoint of ``step``; collective; returns after commit.

        A value that cannot be checkpointed raises TypeError on every rank (naming the
        rank and key path); any other failure raises CheckpointError on every rank.
        """
        t0 = time.perf_counter()
        memory.reset_peak()
        final = self.directory / layout.checkpoint_name(step)
        partial = final.with_name(final.name + layout.PARTIAL)
        tree, arrays, state_bytes, parent = self._prepare(step, state)
        known, found = self.changes.hashes(
            arrays,
            self.last,
            parent,
            self.chain_policy,
            self.block_size,
            blocks.specs_of(arrays, self.distributed),
            set(self._known_hashes),
            self.nranks,
        )
        written, error = self._create(
            partial,
            step,
            tree,
            arrays,
            extra_meta,
            parent,
            hashes={**self._known_hashes, **known},
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
        error = safety.explain_write_error(error, self.directory, state_bytes)  # ENOSPC
        self._agree_or_discard(error, f"writing checkpoint of step {step}", partial)
        assert written is not None
        audit = self.changes.audit(written.state.hashes, self.last)
        seconds, peak, slowest_write, hashed, pages, scan, audits = self._commit(
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
        self.local_newer = False  # the directory's newest is newer than any node-local copy
        return SaveResult(
            step,
            final,
            written.all_bytes,
            seconds,
            written.kind,
            written.dirty_blocks,
            written.total_blocks,
            peak_rss=int(peak),
            write_path="direct" if direct else "buffered",
            write_decision=decision,
            change_detection=found.method,
            pages_written=int(pages),
            bytes_hashed=int(hashed),
            scan_seconds=scan,
            tracking_audit=audit,
            full_reason=written.full_reason,
        )

    def _path_chooser(self) -> write_path.WritePathChooser:
        """Direct or buffered writes for synchronous saves (decided at the first save)."""
        if self.paths is None:
            self.paths = write_path.WritePathChooser(self._direct_io, self.tuning_options.direct_io)
        return self.paths

    def _slowest(self, *values: float) -> list[float]:
        """The largest of each value over the ranks, in one reduction."""
        out = np.empty(len(values))
        self.comm.Allreduce(np.asarray(values, dtype=np.float64), out, op=MPI.MAX)
        return out.tolist()

    def _plan_staging(self, buffers: HostBuffers, arrays: dict[str, Any]) -> Any:
        """This rank's way to stage ``arrays`` within its budget; collective.

        Raises StagingRefused on every rank when any rank is too short of memory
        (:mod:`.staging_budget`): then nothing is staged, nothing written.
        """
        if self._local_ranks is None:
            node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
            self._local_ranks = node.Get_size()
            node.Free()
        mine = sum(a.nbytes for a in arrays.values())
        plan = staging_budget.plan(
            mine, buffers.budget, memory.available_bytes(), self._local_ranks, buffers.nbytes
        )
        short = self.comm.allreduce(
            self.rank if plan.mode == staging_budget.SYNC else -1, op=MPI.MAX
        )
        if short >= 0:
            buffers.release()  # a synchronous save comes next: give the memory back
            why = self.comm.bcast(plan.reason, root=short)
            raise StagingRefused(f"rank {short}: {why}")
        return plan

    def _prepare(
        self,
        step: int,
        state: dict[str, Any] | None,
        copy: fast_tier.LocalCopy | None = None,
    ) -> tuple[Any, dict[str, Any], int, ChainState | None]:
        """Steps 1-2 of a save up to the file, agreed in one reduction: (tree, arrays,
        bytes over all ranks, the checkpoint this one may be a delta of). With ``copy``
        (a node-local copy drained as it is) its tree and arrays stand for the state.

        While the ranks encode, rank 0 checks the chain the next delta would extend
        (reading the directory only); the reduction that agrees on the encoding carries
        its answer. Rank 0 writes to the directory (creates it, removes leftovers,
        checks the free space: :meth:`_prepare_directory`) only once every rank's state
        encoded, just before it creates the file, whose agreement covers it.
        """
        if copy is None:
            tree, arrays, state_bytes, chain_ok = self._encode(step, state, self._chain_intact())
        else:
            tree, arrays = copy.tree, fast_tier.maps(copy)
            self._replicated_paths, self._known_hashes = set(copy.replicated), {}
            mine = sum(a.nbytes for a in arrays.values())
            state_bytes, chain = self._agree(
                None, f"reading node-local step {step}", extra=(mine, self._chain_intact())
            )
            chain_ok = bool(chain)
        faults.fault_point("save.begin", step)
        if self.tuning is None:
            self.tuning = self._tune(state_bytes)
        return tree, arrays, state_bytes, self.last if chain_ok else None

    def _encode(
        self, step: int, state: Any, chain_ok: bool = False
    ) -> tuple[Any, dict[str, Any], int, bool]:
        """Step 1: the state's tree and arrays (replicated ones checked equal and left to
        rank 0), the bytes to store over all ranks and rank 0's ``chain_ok``, in one
        reduction; TypeError on every rank if any rank fails."""
        error: BaseException | None = None
        tree, arrays = None, {}
        try:
            tree, arrays = encode(state)
        except (TypeError, ValueError) as exc:
            error = exc
        mine = sum(a.nbytes for a in arrays.values())
        state_bytes, chain = self._agree(
            error, f"encoding the state of step {step}", TypeError, (mine, chain_ok)
        )
        self._replicated_paths, self._known_hashes = set(), {}
        if self.replicated:
            before = arrays
            arrays, self._known_hashes, self._replicated_paths = check_and_stand_in(
                self.comm, self.replicated, tree, arrays, self.block_size
            )
            # Checked equal on every rank: all but rank 0 dropped the same bytes.
            replicated_bytes = sum(before[p].nbytes for p in self._replicated_paths)
            state_bytes -= (self.nranks - 1) * replicated_bytes
        return tree, arrays, state_bytes, bool(chain)

    def _chain_intact(self) -> bool:
        """Rank 0: whether the next save may be a delta of the last checkpoint: every file
        of its chain still there and not marked bad (someone may have moved or pruned
        them). Other ranks: False (the agreement sums rank 0's answer)."""
        if self.rank != 0 or not self.chain_policy.incremental or self.last is None:
            return False
        return all(
            (self.directory / name).is_file()
            and not (self.directory / (name + layout.BAD)).exists()
            for name, _, _ in self.last.chain
        )

    def _prepare_directory(self, state_bytes: int) -> None:
        """Step 2, rank 0, right before it creates the file: the directory (owner-only),
        no ``*.partial`` leftovers, room for ``state_bytes`` (ENOSPC before HDF5 sees it)."""
        safety.make_directory(self.directory, self.dir_mode)
        for leftover in layout.partials(self.directory):
            log.info("removing leftover %s from an interrupted save", leftover.name)
            safety.remove_leftover(leftover)  # a link is unlinked, never followed
        safety.check_free_space(self.directory, state_bytes)

    # -- staged saves ------------------------------------------------------------------------
    def begin_save(
        self,
        step: int,
        state: dict[str, Any] | None,
        extra_meta: dict[str, Any] | None = None,
        *,
        buffers: HostBuffers | None = None,
        cache: Path | None = None,
        redrain: bool = False,
    ) -> PendingSave:
        """Stage ``state`` and start writing it in the background; collective.

        The arrays are copied into ``buffers`` (host memory reused between saves) or,
        with ``cache``, into this rank's node-local files there (sealed once every rank
        has its copy, see :mod:`.fast_tier`). The checkpoint file is created with all
        its metadata, then a thread per rank writes the array bytes and fsyncs.
        Returns at once; :meth:`finish_save` commits. Raises like :meth:`save` when
        staging fails; nothing is committed then.

        ``redrain``: ``state`` was just restored from the node-local copy in ``cache``
        (:attr:`restored_copy`); drain that copy as it is, without writing it again.
        With ``state=None`` the copy's own tree and arrays are drained (the scavenge of a
        node-local checkpoint the directory does not have yet).
        """
        if (buffers is None) == (cache is None):
            raise ValueError("begin_save needs exactly one staging area: buffers or cache")
        t0 = time.perf_counter()
        memory.reset_peak()
        final = self.directory / layout.checkpoint_name(step)
        partial = final.with_name(final.name + layout.PARTIAL)
        copy = self.restored_copy if redrain else None
        if redrain and (copy is None or copy.step != step or cache is None):
            raise ValueError(f"nothing to drain again: step {step} is not a node-local copy")
        drained = copy if copy is not None and state is None else None
        tree, arrays, state_bytes, parent = self._prepare(step, state, drained)
        plan = None
        if buffers is not None:
            plan = self._plan_staging(buffers, arrays)  # StagingRefused: go synchronous
        pieces = plan is not None and plan.mode == staging_budget.PIECES
        uid = self.comm.bcast(uuid.uuid4().hex if self.rank == 0 else None)
        error: BaseException | None = None
        staged: dict[str, Any] = {}
        hashes: dict[str, Any] = {}
        offsets: dict[str, int] = {}
        try:
            if copy is not None:
                staged = fast_tier.maps(copy)
                hashes = {p: blocks.block_hashes(a, self.block_size) for p, a in staged.items()}
                uid = copy.uid
            elif cache is not None:
                safety.make_directory(cache, self.dir_mode)
                if not self.local_newer:  # older copies are durable in the directory
                    fast_tier.remove(cache, self.rank, nranks=self.nranks)
                staged, hashes, offsets = fast_tier.write_data(
                    cache, step, self.rank, arrays, self.block_size, self.file_mode
                )
            elif pieces:
                staged = arrays  # hashed by write_file, copied piece by piece below
            else:
                assert buffers is not None
                staged, hashes = buffers.stage(arrays, self.block_size)
        except Exception as exc:  # every rank must reach the agreement below
            error = exc
        where = f" in {cache}" if cache is not None else " in memory"
        self._agree(error, f"staging checkpoint of step {step}{where}")
        if cache is not None and copy is None:
            why = local_tier.seal(self, cache, step, uid, tree, arrays, hashes, offsets)
            if why is None:
                self.local_newer = False
            else:  # the drain goes on; this copy just cannot be restored
                log.warning("rank %d: cannot seal its copy in %s: %s", self.rank, cache, why)
        faults.fault_point("stage.written")
        written, error = self._create(
            partial, step, tree, staged, extra_meta, parent, hashes=hashes or None, uid=uid
        )
        error = safety.explain_write_error(error, self.directory, state_bytes)  # ENOSPC
        self._agree_or_discard(error, f"creating the file of checkpoint of step {step}", partial)
        assert written is not None
        if pieces:
            assert buffers is not None and plan is not None
            ring = buffers.ring(plan.staging_bytes)
            writer = stream_pieces(partial, list(written.extents), ring, self._direct_io)
        else:
            writer = BackgroundWrite(partial, list(written.extents), self._direct_io).start()
        foreground = time.perf_counter() - t0
        (blocked,) = self._slowest(foreground)
        total = written.all_bytes
        return PendingSave(
            step,
            partial,
            final,
            written,
            writer,
            foreground,
            blocked,
            total,
            staging=None if plan is None else plan.mode,
            staging_bytes=0 if buffers is None else buffers.nbytes,
        )

    def save_local(self, step: int, state: dict[str, Any], cache: Path) -> SaveResult:
        """A node-local checkpoint only (no drain), with its redundancy; collective
        (:func:`.local_tier.save_local`)."""
        return local_tier.save_local(self, step, state, cache)

    def finish_save(self, pending: PendingSave) -> SaveResult:
        """Wait for every rank's background write, then commit; collective.

        If any rank's write failed, the partial file is deleted and CheckpointError is
        raised on every rank: the checkpoint never becomes good.
        """
        t_wait = time.perf_counter()
        pending.writer.wait()
        waited = time.perf_counter() - t_wait
        error = safety.explain_write_error(
            pending.writer.error, self.directory, pending.bytes_total
        )
        try:
            self._agree_or_discard(
                error,
                f"writing checkpoint of step {pending.step} in the background",
                pending.partial,
            )
        except CheckpointError:
            self.local_newer = True  # a sealed node-local copy is now the newest
            raise
        t_commit = time.perf_counter()
        # Staging to durable bytes, plus the commit: what a synchronous save would have cost.
        seconds, peak, held = self._commit(
            pending.partial,
            pending.final,
            pending.step,
            lambda: (
                pending.foreground + pending.writer.seconds + (time.perf_counter() - t_commit),
                memory.peak_rss_bytes(),
                pending.staging_bytes,
            ),
        )
        self.last = pending.written.state
        # whatever the cache holds is durable in the directory now, unless a newer
        # node-local-only checkpoint was sealed while this one drained
        self.local_newer = self.local_step is not None and self.local_step > pending.step
        log.debug("rank %d waited %.3f s for its background write", self.rank, waited)
        w = pending.written
        return SaveResult(
            pending.step,
            pending.final,
            pending.bytes_total,
            seconds,
            w.kind,
            w.dirty_blocks,
            w.total_blocks,
            blocked_seconds=pending.blocked,
            peak_rss=int(peak),
            staging=pending.staging,
            staging_bytes=int(held),
            full_reason=w.full_reason,
        )

    def _create(
        self,
        partial: Path,
        step: int,
        tree: Any,
        arrays: dict[str, Any],
        extra_meta: dict[str, Any] | None,
        parent: ChainState | None,
        **options: Any,
    ) -> tuple[Written | None, BaseException | None]:
        """Step 3 without the agreement: (what this rank writes, or the error it met)."""
        error: BaseException | None = None
        written: Written | None = None
        try:
            written = write_file(
                partial,
                self.comm,
                step,
                tree,
                arrays,
                extra_meta,
                distributed=self.distributed,
                alignment=self.tuning.alignment if self.tuning else None,
                block_size=self.block_size,
                parent=parent,
                policy=self.chain_policy,
                replicated=self._replicated_paths,
                prepare=self._prepare_directory,
                **options,
            )
            faults.fault_point("save.prepared")
            if self.rank == 0:  # now, so that the ranks' fsyncs make the mode durable too
                safety.set_mode(partial, self.file_mode)  # created with the umask
        except Exception as exc:  # every rank must reach the agreement
            error = exc
        return written, error

    @property
    def _direct_io(self) -> bool:
        """Whether array bytes go past the page cache, written and read back: the tuning
        plan's choice, or before the first save (a restore) the same rule for this
        directory's file system."""
        if self.tuning is not None:
            return self.tuning.direct_io
        return filesystem.direct_io(filesystem.detect(self.directory), self.tuning_options)

    def _write_data(self, partial: Path, written: Written, direct: bool) -> BaseException | None:
        """Step 3b: this rank writes its part into the created ``.partial`` and fsyncs it
        (:mod:`.direct_io`), hashing its arrays meanwhile if they were not hashed yet;
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

    def _agree_or_discard(self, error: BaseException | None, what: str, partial: Path) -> None:
        """Step 4: raise on every rank if any failed, rank 0 deleting the ``.partial``."""
        try:
            self._agree(error, what)
        except CheckpointError:
            if self.rank == 0:
                safety.remove_leftover(partial)  # never a directory someone put there
            raise

    def _commit(
        self, partial: Path, final: Path, step: int, measure: Callable[[], Sequence[float]]
    ) -> list[float]:
        """Step 5: rank 0 renames the file into place durably; agreed in the same reduction
        that gives the largest of each of ``measure()`` over the ranks."""
        error: BaseException | None = None
        if self.rank == 0:
            try:
                durability.publish(partial, final)
                faults.fault_point("commit.renamed")
            except OSError as exc:
                error = exc
        *out, failed = self._slowest(*measure(), float(error is not None))
        if failed:
            self._agree_root(error, f"committing checkpoint of step {step}")
        return out

    def _chain_state(self, reader: CheckpointReader) -> ChainState | None:
        """This rank's memory of a restored checkpoint, from the hashes stored in its file."""
        if reader.format_version < 2 or reader.nranks != self.nranks:
            return None
        specs, hashes = {}, {}
        for name, info in reader.arrays.items():
            specs[name] = (info.dtype.str, tuple(info.rank_shapes[self.rank]), info.distributed)
            hashes[name] = reader.block_hashes(name, self.rank).copy()
        return ChainState(
            reader.step,
            str(reader.uid),
            reader.block_size,
            reader.nranks,
            specs,
            hashes,
            (*reader.chain_refs, (reader.path.name, reader.step, str(reader.uid))),
            int(reader.attrs.get("chain_bytes", 0)),
            int(reader.attrs.get("state_bytes", 0)),
        )

    # -- retention -------------------------------------------------------------------------
    def prune(
        self,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_every_seconds: float | None = None,
        *,
        delete_bad: bool = False,
        dry_run: bool = False,
    ) -> list[Path]:
        """Delete checkpoints the retention rules do not keep (see :mod:`.retention`).

        Collective: rank 0 deletes, every rank gets the list of deleted paths. Never
        deletes the newest good checkpoint; keeps bad ones unless ``delete_bad``.
        """
        retention.check_rules(keep_last, keep_every, keep_every_seconds)
        result: list[Path] | None = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                result = retention.prune_directory(
                    self.directory, keep_last, keep_every, keep_every_seconds, delete_bad, dry_run
                )
            except OSError as exc:
                error = exc
        self._agree(error, f"pruning {self.directory}")
        return self.comm.bcast(result)

    # -- restore ---------------------------------------------------------------------------
    def entries(self) -> list[layout.Entry]:
        """Committed checkpoints as rank 0 sees them, newest first (same list on every rank)."""
        return self.comm.bcast(layout.scan(self.directory) if self.rank == 0 else None)

    def _listing(self, guard_first: bool) -> tuple[list[layout.Entry], bool | None]:
        """:meth:`entries` and, with ``guard_first``, whether an earlier restore died
        reading the first good candidate (:meth:`_died_reading`, which guards it for the
        read that follows): both in one bcast. None: not guarded."""
        out = None
        if self.rank == 0:
            entries = layout.scan(self.directory)
            first = next((e for e in entries if e.good_candidate), None)
            died = self._died_reading(first) if guard_first and first is not None else None
            out = (entries, died)
        return self.comm.bcast(out)

    def _gather(
        self, problem: str | None, fatal: str | None, payload: Any = None, culprit: Any = None
    ) -> list[Any]:
        """Every rank's (problem, fatal, payload); raises _Fatal / CorruptCheckpoint alike.

        The CorruptCheckpoint's ``culprit`` lists the files the ranks found at fault
        (members of an incremental checkpoint's chain); empty when it is the checkpoint.
        One reduction when nothing went wrong and no rank has a payload (the common
        case: no array to reshard); the gather only otherwise.
        """
        flags = np.array([problem is not None or fatal is not None, bool(payload)], np.int32)
        anything = np.empty_like(flags)
        self.comm.Allreduce(flags, anything, op=MPI.MAX)
        if not anything.any():
            return [payload] * self.nranks
        outcome = self.comm.allgather((problem, fatal, payload, culprit and str(culprit)))
        fatals = [f for _, f, _, _ in outcome if f]
        if fatals:
            raise _Fatal(fatals[0])
        problems = [p for p, _, _, _ in outcome if p]
        if problems:
            culprits = list(dict.fromkeys(c for p, _, _, c in outcome if p and c))
            raise CorruptCheckpoint("; ".join(dict.fromkeys(problems[:4])), culprit=culprits)
        return [p for _, _, p, _ in outcome]

    def _request(
        self,
        name: str,
        rows: int,
        saved: tuple[int, int] | None,
        state: Any,
        targets: Targets,
    ) -> tuple[Any, ...]:
        """The rows this rank asks for of distributed array ``name`` of ``rows`` rows (see
        resharding); ``saved``: the rows this rank wrote, when the rank count is the same."""
        split = self.distributed.get(name)
        if split is not None:
            lo, hi = split(rows, self.nranks, self.rank)
            return ("range", int(lo), int(hi))
        held = lookup(state, name, targets)
        if hasattr(held, "shape") and len(held.shape) >= 1:
            return ("count", int(held.shape[0]))
        if saved is not None:  # the split it was saved with
            return ("range", *saved)
        return ("range", *even_split(rows, self.nranks, self.rank))

    def _load(
        self,
        entry: layout.Entry,
        state: dict[str, Any],
        targets: Targets,
        only: tuple[str, ...] | None = None,
    ) -> tuple[Any, dict, int, ChainState | None]:
        """Read and verify this rank's tree and arrays of ``entry`` (with ``only``: of
        those top-level keys); collective. The planned read when every rank takes what
        it saved; the general one (every rank opens the file) to reshard."""
        plan, agree_first = self._plans(entry)
        if plan is not None:
            loaded = self._load_planned(plan, state, targets, only, agree_first)
            if loaded is not None:
                return loaded
        return self._load_general(entry, state, targets, only)

    def _plans(self, entry: layout.Entry) -> tuple[read_plan.RankPlan | None, bool]:
        """Rank 0 validates ``entry`` once and sends each rank its read plan (one scatter),
        and whether the ranks must agree on their rows before reading (distributed arrays).

        Raises CorruptCheckpoint (or _Fatal) on every rank when rank 0 finds it unusable.
        No plan (None everywhere) when the rank count changed or a dataset is not raw.
        """
        out: list[Any] | None = None
        if self.rank == 0:
            n = self.nranks
            try:
                with CheckpointReader(entry.path, direct_io=self._direct_io) as reader:
                    plans: list[Any] = [None] * n
                    if reader.nranks == n:
                        plans = read_plan.plans(reader) or plans
                    agree = bool(self.distributed) or any(
                        info.distributed for info in reader.arrays.values()
                    )
                    out = [(p, None, agree) for p in plans]
            except CorruptCheckpoint as exc:
                culprits = exc.culprit if isinstance(exc.culprit, list) else [exc.culprit]
                found = ("corrupt", str(exc), [str(c) for c in culprits if c])
                out = [(None, found, False)] * n
            except CheckpointError as exc:
                out = [(None, ("fatal", str(exc), []), False)] * n
            except Exception as exc:  # never leave the other ranks waiting in the scatter
                # Not damage the reader recognizes: stop on every rank rather than mark
                # a checkpoint bad for what may be a bug or a passing fault.
                why = f"reading {entry.path.name}: {type(exc).__name__}: {exc}"
                out = [(None, ("fatal", why, []), False)] * n
        plan, found, agree = self.comm.scatter(out)
        if found is not None:
            kind, why, culprits = found
            if kind == "fatal":
                raise _Fatal(why)
            raise CorruptCheckpoint(why, culprit=culprits)
        return plan, agree

    def _load_planned(
        self,
        plan: read_plan.RankPlan,
        state: dict[str, Any],
        targets: Targets,
        only: tuple[str, ...] | None,
        agree_first: bool,
    ) -> tuple[Any, dict, int, ChainState | None] | None:
        """This rank's part of ``plan``, read with POSIX calls and verified; None on every
        rank when some rank asks for other rows than it saved (then reshard)."""
        parts = None if only is None else {escape(k) for k in only}
        wanted = [a for a in plan.arrays if parts is None or a.name.split("/")[0] in parts]
        names = {a.name for a in wanted}
        own = True  # every distributed array asks for the rows this rank saved
        kinds = np.zeros(len(plan.arrays), np.int64)  # 1 count, 2 range requests
        for i, a in enumerate(plan.arrays):
            if a.name not in names or not (a.distributed or a.name in self.distributed):
                continue
            if a.layout != "rows":
                own = False  # the general path says why it cannot be split
                continue
            try:
                req = self._request(a.name, a.rows, a.own, state, targets)
            except Exception:  # a split function raised: the general path reports it
                own = False
                continue
            kinds[i] = 1 if req[0] == "count" else 2
            mine = (a.own[1] - a.own[0],) if req[0] == "count" else a.own
            own = own and tuple(req[1:]) == mine
        if agree_first:  # before anything is read into the application's arrays
            votes = np.concatenate([[int(not own)], kinds, -kinds])
            seen = np.empty_like(votes)
            self.comm.Allreduce(votes, seen, op=MPI.MAX)
            highest, lowest = seen[1 : 1 + kinds.size], -seen[1 + kinds.size :]
            if seen[0] or np.any(highest != lowest):
                return None
        found = _Findings(Path(plan.files[-1]).name)
        tree, arrays, chain_state = None, {}, None
        if own:
            with found, read_plan.PlanReader(plan, direct_io=self._direct_io) as reader:
                tree = select_keys(reader.tree(), only)
                expected = {a.name: (a.shape, np.dtype(a.dtype), a.torch_dtype) for a in wanted}
                into = _read_targets(state, targets, expected)
                for a in wanted:
                    arrays[a.name] = reader.array(a, into.get(a.name))
                found.fatal = check_fits(state, tree, arrays, targets)
                chain_state = ChainState(
                    plan.step,
                    plan.uid,
                    plan.block_size,
                    plan.nranks,
                    {a.name: (a.dtype, a.own_shape, a.distributed) for a in plan.arrays},
                    {a.name: reader.own_hashes(a) for a in plan.arrays},
                    plan.chain,
                    plan.chain_bytes,
                    plan.state_bytes,
                )
        if any(self._gather(found.problem, found.fatal, None if own else True, found.culprit)):
            return None
        return tree, arrays, plan.nranks, chain_state

    def _load_general(
        self,
        entry: layout.Entry,
        state: dict[str, Any],
        targets: Targets,
        only: tuple[str, ...] | None = None,
    ) -> tuple[Any, dict, int, ChainState | None]:
        """The restore where every rank opens the file: any rank count, any rows."""
        reader = None
        problem = fatal = culprit = None
        requests: dict[str, tuple[Any, ...]] = {}
        try:
            reader = CheckpointReader(entry.path, direct_io=self._direct_io)
            parts = None if only is None else {escape(k) for k in only}
            wanted = [n for n in reader.arrays if parts is None or n.split("/")[0] in parts]
            same = reader.nranks == self.nranks
            for name in wanted:
                info = reader.arrays[name]
                if name in self.distributed and info.layout != "rows":
                    fatal = (
                        f"array {name!r} is declared distributed, but {entry.path.name} stores "
                        f"it per rank ({info.layout} layout): restore it with the rank count "
                        f"that wrote it ({reader.nranks})"
                    )
                elif info.distributed or name in self.distributed:
                    offs = info.rank_offsets
                    saved = (offs[self.rank], offs[self.rank + 1]) if same else None
                    requests[name] = self._request(name, info.shape[0], saved, state, targets)
        except CorruptCheckpoint as exc:
            problem, culprit = str(exc), exc.culprit
        except CheckpointError as exc:
            fatal = str(exc)
        except Exception as exc:  # a split function raised: every rank must hear of it
            fatal = f"choosing the rows to restore: {type(exc).__name__}: {exc}"
        try:
            gathered = self._gather(problem, fatal, requests, culprit)
            assert reader is not None
            saved = reader.nranks
            ranges = {}
            for name in requests:
                rows = reader.arrays[name].shape[0]
                try:
                    ranges[name] = resolve_ranges(name, [g[name] for g in gathered], rows)
                except CheckpointError as exc:
                    raise _Fatal(str(exc)) from exc

            found = _Findings(entry.path.name)
            tree, arrays, chain_state = None, {}, None
            with found:
                if saved == self.nranks:
                    tree = select_keys(reader.tree(self.rank), only)
                else:
                    trees = [select_keys(reader.tree(r), only) for r in range(saved)]
                    tree = common_tree(trees, saved, self.nranks)
                    per_rank = [n for n in wanted if n not in ranges and not reader.replicated(n)]
                    if per_rank:
                        raise CheckpointError(
                            f"array {per_rank[0]!r} is per rank (not declared distributed, and "
                            f"not the same on every rank): {entry.path.name} was written by "
                            f"{saved} ranks, this run has {self.nranks}. Declare it distributed "
                            f"(split along axis 0) or restart with {saved} ranks"
                        )
                source = self.rank if saved == self.nranks else 0
                expected = {}
                for name in wanted:
                    info = reader.arrays[name]
                    if name in ranges:
                        lo, hi = ranges[name][self.rank]
                        shape: tuple[int, ...] = (hi - lo, *info.trailing)
                    else:
                        shape = tuple(info.rank_shapes[0 if info.replicated else source])
                    expected[name] = (shape, info.dtype, info.torch_dtype)
                into = _read_targets(state, targets, expected)
                for name in wanted:
                    if name in ranges:
                        lo, hi = ranges[name][self.rank]
                        arrays[name] = reader.rows(name, lo, hi, into.get(name))
                    else:
                        arrays[name] = reader.rank_array(name, source, into.get(name))
                found.fatal = check_fits(state, tree, arrays, targets)
                chain_state = self._chain_state(reader)
            self._gather(found.problem, found.fatal, None, found.culprit)
            return tree, arrays, saved, chain_state
        finally:
            if reader is not None:
                reader.close()

    def _died_reading(self, entry: layout.Entry) -> bool:
        """Rank 0: whether an earlier restore died reading this checkpoint (then mark it bad);
        otherwise leave a marker that only a completed read removes.

        A few damaged HDF5 headers crash the library itself (a segfault, not an error):
        without this, every restart would crash on the same file and never fall back.
        """
        marker = _reading_marker(entry.path)
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

    def restore(
        self,
        state: dict[str, Any],
        cache: Path | None = None,
        only: Iterable[str] | None = None,
    ) -> RestoreResult | None:
        """Fill ``state`` from the newest checkpoint that verifies on every rank.

        With ``cache`` (a node-local fast tier), a copy there newer than every
        checkpoint of the directory is taken when every rank holds its part of it, on
        the host that wrote it, and every part verifies; otherwise the directory's.

        A checkpoint that fails verification is marked bad (never deleted) and the
        next older one is tried. A checkpoint that is sound but does not fit this run
        (other shapes, or a rank count it cannot be split to) raises CheckpointError
        on every rank before anything is overwritten. Arrays are read straight into the
        application's arrays of the same shape and dtype (no second copy), so when no
        checkpoint verifies, they may hold unverified bytes on the error. Returns None
        when the directory holds no checkpoint.

        ``only`` (top-level keys of the state) restores just those values and leaves the
        rest of the checkpoint unread: e.g. the replicated model and optimizer of a run
        whose per-rank values (random states, data positions) cannot be split to this
        rank count; it reads the directory's checkpoints, never the node-local ``cache``.
        Objects with ``load_state_dict`` get it called with what was saved;
        an error there is a CheckpointError on every rank.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, not {type(state).__name__}")
        if only is not None:
            only = (only,) if isinstance(only, str) else tuple(only)
        self.changes.reset()  # the restore writes into the arrays: what was tracked is moot
        targets = Targets()
        skipped: list[tuple[int, str]] = []
        local_skipped: list[tuple[int, str]] = []  # node-local checkpoints that could not be
        entries, died = self._listing(guard_first=cache is None)
        if cache is not None:
            newest = max((e.step for e in entries if e.good_candidate), default=-1)
            if only is not None:
                local = None
            elif self.redundancy is not None:
                local = local_tier.restore_rebuilt(
                    self, state, cache, newest, local_skipped, targets
                )
            else:
                local = local_tier.restore_local(self, state, cache, newest, local_skipped, targets)
            if local is not None:
                return local
        for entry in entries:
            if not entry.good_candidate:
                skipped.append((entry.step, f"marked bad earlier: {entry.bad_reason}"))
                continue
            if died is None:  # not guarded with the listing: one more bcast
                died = self.comm.bcast(self._died_reading(entry) if self.rank == 0 else None)
            if died:
                died = None
                skipped.append((entry.step, READ_CRASH))
                continue
            died = None  # the next candidate (a fallback) is guarded on its own
            try:
                faults.fault_point("restore.reading", entry.step)
                tree, arrays, saved, chain_state = self._load(entry, state, targets, only)
            except _Fatal as exc:
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
                skipped.append((entry.step, reason))
                continue
            finally:
                # Every rank is past the read (its last agreement): it did not kill us.
                if self.rank == 0:
                    _reading_marker(entry.path).unlink(missing_ok=True)
            self._decode(state, tree, arrays, targets)
            self.last = chain_state
            return RestoreResult(
                entry.step, entry.path, skipped, saved, local_skipped=tuple(local_skipped)
            )
        if entries:
            detail = "; ".join(f"step {s}: {r}" for s, r in skipped[:4])
            raise CheckpointError(
                f"none of the {len(entries)} checkpoints in {self.directory} is good ({detail}). "
                "Move them aside to start from scratch, or inspect them with 'hpcckpt verify'"
            )
        return None

    def _decode(
        self, state: dict[str, Any], tree: Any, arrays: dict[str, Any], targets: Targets
    ) -> None:
        """Fill the application's state (``load_state_dict`` of its objects); agreed."""
        error: BaseException | None = None
        try:
            decode_into(state, tree, arrays, targets)
        except (CheckpointError, ValueError, TypeError) as exc:
            error = exc
        self._agree(error, "loading the restored state")


#: Why a checkpoint whose reading killed an earlier restore is skipped.
READ_CRASH = (
    "an earlier restore died while reading it (HDF5 crashed on damaged metadata, or the "
    "job was killed mid-restore); remove its .bad file to try it again"
)


def _read_targets(
    state: Any, targets: Targets, expected: dict[str, tuple[tuple[int, ...], np.dtype, str]]
) -> dict[str, np.ndarray]:
    """The application's arrays a restore can read straight into, by array name.

    ``expected``: the (shape, dtype, torch dtype or "") this rank takes of each array it
    reads. Reading into the application's arrays saves a copy and the first touch of a
    second buffer (the copy alone was 0.045 s of a 0.57 s cold restore of 512 MiB per
    rank). Only when every array the application holds fits the checkpoint: a restore
    refused for a mismatch must leave the application's arrays untouched.
    Arrays sharing memory are read through a buffer, as is any array not C-contiguous.
    A CPU tensor is read into through a numpy view of its memory.
    """
    into: dict[str, np.ndarray] = {}
    for name, (shape, dtype, torch_dtype) in expected.items():
        held = lookup(state, name, targets)
        if tensors.is_tensor(held) != bool(torch_dtype) and held is not None:
            if tensors.is_tensor(held) or isinstance(held, np.ndarray):
                return {}  # a tensor for an array or the reverse: check_fits refuses it
        if tensors.is_tensor(held):
            if tensors.dtype_name(held) != torch_dtype:
                return {}  # check_fits refuses this restore: read nothing into the application
            held = tensors.writable_view(held)
        if not isinstance(held, np.ndarray):
            continue
        if held.shape != shape or held.dtype != dtype:
            return {}  # check_fits refuses this restore: read nothing into the application
        if held.flags.c_contiguous and held.flags.writeable and held.size:
            into[name] = held
    spans = sorted((a.__array_interface__["data"][0], a.nbytes, name) for name, a in into.items())
    groups: list[list[str]] = []  # runs of arrays whose memory overlaps
    end = -1
    for start, nbytes, name in spans:
        if start >= end:
            groups.append([])
        groups[-1].append(name)
        end = max(end, start + nbytes)
    for group in groups:
        if len(group) > 1:
            for name in group:
                del into[name]
    return into


def _reading_marker(path: Path) -> Path:
    return path.with_name(path.name + layout.READING)
