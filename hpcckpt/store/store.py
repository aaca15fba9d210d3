"""The checkpoint store: a directory of checkpoints shared by the ranks of a communicator.

A thin front over the rooms that do the work: :mod:`.save.commit` (the commit protocol
of a save, staged or not), :mod:`.restore.fallback` and :mod:`.restore.load` (which
checkpoint to take, and reading it), :mod:`.tier.node_local` (the node-local tier),
:mod:`.mirror.worker` (rank 0's copy of each commit to the mirror), :mod:`.retention`
(pruning), all deciding together through one :class:`~.agreement.Agreement`. Its
settings are one :class:`~.options.StoreOptions`; see docs/format.md for the protocol
itself. What the store does beside the calls (a copy reaching the mirror, a staged save
refused) goes to the ``report`` callback it is given, as (kind, fields).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hpcckpt.store import retention
from hpcckpt.store.agreement import Agreement
from hpcckpt.store.comm import Comm, as_comm
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.file import layout
from hpcckpt.store.io import safety
from hpcckpt.store.mirror.backend import MirrorBackend, open_backend
from hpcckpt.store.mirror.worker import (
    MIRROR_FAILED,
    MIRROR_PRUNED,
    MIRRORED,
    Aside,
    MirrorWait,
    MirrorWorker,
    Report,
)
from hpcckpt.store.options import StoreOptions
from hpcckpt.store.restore.fallback import Restorer
from hpcckpt.store.restore.load import Loader
from hpcckpt.store.results import RestoreResult, SaveResult
from hpcckpt.store.save.commit import Saver
from hpcckpt.store.save.options import Modes
from hpcckpt.store.save.pending import PendingSave, StagingRefused
from hpcckpt.store.save.staging import HostBuffers
from hpcckpt.store.tier import copies as fast_tier
from hpcckpt.store.tier.node_local import NodeLocalTier, Place
from hpcckpt.store.tree.encoding import Encoder

__all__ = [
    "MIRRORED",
    "MIRROR_FAILED",
    "MIRROR_PRUNED",
    "STAGING_REFUSED",
    "CheckpointError",
    "CheckpointStore",
    "CorruptCheckpoint",
    "MirrorWait",
    "PendingSave",
    "Report",
    "RestoreResult",
    "SaveResult",
    "StagingRefused",
]

log = logging.getLogger("hpcckpt.store")

#: The report of a staged save written synchronously instead (fields: step, reason); the
#: mirror's reports are :data:`MIRRORED`, :data:`MIRROR_FAILED`, :data:`MIRROR_PRUNED`.
STAGING_REFUSED = "staging_refused"


class CheckpointStore:
    """A directory of checkpoints shared by the ranks of ``comm``; every method is collective.

    Set up with a :class:`~hpcckpt.store.options.StoreOptions`, or with its fields as
    keywords: ``distributed`` and ``replicated`` (:class:`.ArrayOptions`: arrays split
    along axis 0 across ranks, restorable on any rank count; values the same on every
    rank, written once), ``incremental``, ``block_size``, ``max_chain``,
    ``max_chain_fraction``, ``min_delta_saving``, ``change_detection``
    (:class:`.IncrementalOptions`), ``fs_tuning`` and ``share_group``
    (:class:`.FileOptions`), ``cache``, ``redundancy``, ``redundancy_set`` and
    ``node_name`` (:class:`.TierOptions`: the node-local tier), ``mirror`` and the
    ``mirror_*`` keywords (:class:`.MirrorOptions`: the second tier; rank 0 copies
    committed checkpoints there in the background, the directory keeps each until it is
    verified there, and restore reads it when the directory holds nothing newer that is
    good). ``report(kind, fields)`` hears what happens beside the calls (the mirror's
    copies, failures and prunes, from rank 0's mirror thread; a staged save refused).
    :meth:`close` stops the mirror's thread.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        comm: Comm | Any,
        options: StoreOptions | None = None,
        *,
        report: Report | None = None,
        **keywords: Any,
    ) -> None:
        if options is not None and keywords:
            raise TypeError("CheckpointStore takes options or keywords, not both")
        self.options = options or StoreOptions.from_keywords("CheckpointStore", **keywords)
        self.report: Report = report or (lambda kind, fields: None)
        self.directory = Path(directory).absolute()
        self.comm = comm = as_comm(comm)  # an mpi4py communicator or a torch group too
        self.rank = comm.rank
        self.nranks = comm.size
        #: Every collective decision and cross-rank error of this store goes through it.
        self.agreement = Agreement(comm)
        #: Rank 0's prune after a commit, off the save's path (``prune(background=True)``).
        self.pruning = retention.BackgroundPrune()
        self.file_mode, self.dir_mode = safety.modes(self.options.files.share_group)
        block_size = int(self.options.incremental.block_size)  # type: ignore[arg-type]
        encoder = Encoder(self.agreement, self.options.arrays, block_size)
        #: The node-local tier (None: no ``cache``); building it is collective.
        self.tier: NodeLocalTier | None = None
        if self.options.tier.path is not None:
            fast_tier.check_cache_dir(self.options.tier.path, self.directory)
            place = Place(self.directory, block_size, self.file_mode, self.dir_mode)
            self.tier = NodeLocalTier(self.options.tier, place, self.agreement, encoder)
        modes = Modes(self.file_mode, self.dir_mode)
        self.saver = Saver(
            self.directory,
            self.agreement,
            encoder,
            self.options.incremental,
            self.options.files,
            self.options.arrays.splits,
            modes,
            self.tier,
            settle=self.pruning.wait,
        )
        loader = Loader(self.agreement, self.options.arrays.splits, self.saver)
        #: Rank 0's connection to the mirror (None on the other ranks, or without one).
        self.mirror: MirrorBackend | None = None
        #: Rank 0's background copy of each commit to the mirror (None elsewhere).
        self.mirroring: MirrorWorker | None = None
        mirror = self.options.mirror
        if mirror.url is not None:
            error = self.agreement.from_root(self._open_mirror)
            if error is not None:  # on every rank alike
                raise ValueError(error)
        if self.mirror is not None:
            self.mirroring = MirrorWorker(self.mirror, mirror, self.report)
        self.restorer = Restorer(
            self.directory,
            self.agreement,
            loader,
            encoder,
            self.file_mode,
            self.tier,
            self.mirror,
            mirrored=mirror.url is not None,
        )

    def _open_mirror(self) -> str | None:
        """Rank 0: connect to the mirror (nothing is read or written yet); why not."""
        mirror = self.options.mirror
        try:
            self.mirror = open_backend(
                mirror.url,  # type: ignore[arg-type]
                mirror.mirror_bandwidth,  # type: ignore[arg-type]
                verify=mirror.mirror_verify,
                compress=mirror.mirror_compress,
            )
        except ValueError as exc:
            return str(exc)
        return None

    # -- save ------------------------------------------------------------------------------
    def save(
        self, step: int, state: dict[str, Any], extra_meta: dict[str, Any] | None = None
    ) -> SaveResult:
        """Write ``state`` as the checkpoint of ``step``; returns after the commit.

        A value that cannot be checkpointed raises TypeError on every rank (naming the
        rank and key path); any other failure raises CheckpointError on every rank.
        """
        self.pruning.wait()  # the deletes a synchronous prune would have made are done
        with self._mirror_steps_aside():
            result = self.saver.save(step, state, extra_meta)
        return self._committed(result)

    def checkpoint(
        self,
        step: int,
        state: dict[str, Any],
        reason: str,
        *,
        stop: bool = False,
        local: bool = False,
        buffers: HostBuffers | None = None,
    ) -> SaveResult | PendingSave:
        """One save on the path its inputs choose, ``reason`` in its metadata: with a
        node-local tier and ``local`` (this save's level is the tier), :meth:`save_local`;
        staged where it can be (``buffers`` in host memory, or the tier), a PendingSave
        of :meth:`begin_save` that :meth:`finish_save` commits; otherwise, on a ``stop``
        (copied to the mirror at once) or when staging is refused (logged and reported
        ``staging_refused``), :meth:`save`. Raises like them.
        """
        if not stop and local and self.tier is not None:
            self.pruning.wait()
            return self.save_local(step, state)
        meta = {"reason": reason}
        if not stop and (buffers is not None or self.tier is not None):
            try:
                return self.begin_save(step, state, meta, buffers=buffers)
            except StagingRefused as exc:  # every rank alike: too little memory to stage
                log.warning("checkpoint step %d written synchronously: %s", step, exc)
                self.report(STAGING_REFUSED, {"step": step, "reason": str(exc)})
        self.pruning.wait()
        with self._mirror_steps_aside():
            result = self.saver.save(step, state, meta)
        return self._committed(result, force=stop)

    def prepare_saves(self, state: dict[str, Any], buffers: HostBuffers | None) -> None:
        """Where every rank is before the first save (a restore): what lets the first
        staged save of ``state`` block for its copy only, as the later ones do (the
        background saves' group). Collective."""
        self.saver.prepare_deferred(state, buffers)

    def begin_save(
        self,
        step: int,
        state: dict[str, Any] | None,
        extra_meta: dict[str, Any] | None = None,
        *,
        buffers: HostBuffers | None = None,
        redrain: bool = False,
    ) -> PendingSave:
        """Stage ``state`` and start writing it in the background; :meth:`finish_save`
        commits. The state is copied into ``buffers`` (host memory reused between saves)
        or, with a node-local tier, into this rank's files there (sealed once every
        rank has its copy). ``redrain``: drain the tier's copy of ``step`` as it is
        (just restored, or held for the drain); with ``state=None`` the copy's own tree
        and arrays stand for the state. Raises like :meth:`save` when staging fails,
        and StagingRefused on every rank when some rank has too little memory to stage.
        """
        if not self.saver.defers(state, buffers, redrain):  # else its thread waits for it
            self.pruning.wait()
        with self._mirror_steps_aside() as aside:
            pending = self.saver.begin_save(
                step, state, extra_meta, buffers=buffers, redrain=redrain
            )
            aside.until(pending.done)  # the background write: durable, or failed
        return pending

    def finish_save(self, pending: PendingSave) -> SaveResult:
        """Wait for every rank's background write, then commit; CheckpointError on every
        rank if any rank's write failed (the checkpoint never becomes good)."""
        pending.writer.wait()  # a deferred save's background steps tell whether:
        if pending.refused is not None:  # some rank wrote uncopied
            log.warning("checkpoint step %d written uncopied: %s", pending.step, pending.refused)
            self.report(STAGING_REFUSED, {"step": pending.step, "reason": pending.refused})
        with self._mirror_steps_aside():
            result = self.saver.finish_save(pending)
        return self._committed(result)

    def save_local(self, step: int, state: dict[str, Any]) -> SaveResult:
        """A checkpoint on the node-local tier only (no drain), with its redundancy."""
        if self.tier is None:
            raise ValueError("save_local needs a node-local tier: set cache=PATH")
        with self._mirror_steps_aside():
            return self.tier.save_local(step, state)

    def free_tier(self) -> None:
        """The run is over: delete this node's copies on the node-local tier, unless the
        last drain failed and they hold a checkpoint the directory lacks (then kept, and
        said). Collective; nothing without a tier."""
        tier = self.tier
        if tier is not None and tier.holds_newest:
            log.warning(
                "rank %d keeps its node-local copy in %s: the last drain failed, so it is "
                "newer than the newest checkpoint in %s",
                self.rank,
                self.options.tier.path,
                self.directory,
            )
        elif tier is not None:
            tier.free()

    def _committed(self, result: SaveResult, force: bool = False) -> SaveResult:
        """Rank 0 hands a checkpoint committed in the directory to the mirror's worker,
        which copies it when it is due (``mirror_every``, ``mirror_interval``) or ``force``."""
        if self.mirroring is not None and result.tier == "directory":
            self.mirroring.committed(result.step, result.path, force=force)
        return result

    # -- the mirror ------------------------------------------------------------------------
    def _mirror_steps_aside(self) -> Aside:
        """Rank 0's mirror copy pauses between its chunks while this save writes (the
        hold ends with the ``with`` block, or with the background write handed to its
        ``until``); on the other ranks, or without a mirror, it holds nothing."""
        if self.mirroring is None:
            return Aside(None)
        return self.mirroring.steps_aside()

    def mirror_wait(self, seconds: float | None = None) -> MirrorWait | None:
        """Rank 0: the directory's newest checkpoint sent to the mirror unless it is there
        or on its way, and waited for up to ``seconds`` (``mirror_wait`` by default), as a
        stop or the end of a run does. How it ended; None without a mirror, on the other
        ranks, or with nothing to copy. Not collective."""
        if self.mirroring is None:
            return None
        if seconds is None:
            seconds = float(self.options.mirror.mirror_wait)  # type: ignore[arg-type]
        return self.mirroring.wait_newest(self.directory, seconds)

    def close(self) -> None:
        """Stop rank 0's mirror thread (a copy under way never counts without its
        manifest): nothing more is copied; restores and saves still work. Not collective.
        A prune under way (rank 0's, ``background=True``) is waited for."""
        self.pruning.wait()
        if self.mirroring is not None:
            self.mirroring.close()
            self.mirroring = None
        if self.saver.deferred is not None:  # the background saves' group
            self.saver.deferred.close()
            self.saver.deferred = None
        changes = self.saver.changes  # the kernel write tracking of the state's memory
        if changes.tracker is not None:
            changes.tracker.close()
            changes.tracker = None

    # -- retention -------------------------------------------------------------------------
    def prune(
        self,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_every_seconds: float | None = None,
        *,
        delete_bad: bool = False,
        dry_run: bool = False,
        protect: set[int] | None = None,
        background: bool = False,
    ) -> list[Path]:
        """Delete checkpoints the retention rules do not keep (see :mod:`.retention`).

        Rank 0 deletes, every rank gets the list of deleted paths. Never deletes the
        newest good checkpoint, nor the ``protect`` steps (rank 0's), nor those on their
        way to the mirror and not yet verified there, nor the files they are built on;
        keeps bad ones unless ``delete_bad``.

        ``background`` (after a commit, as the Checkpointer prunes): not collective; rank 0
        deletes in a thread and every rank returns at once with an empty list; a failure
        is logged. The store's next save, restore, listing or prune, and :meth:`close`,
        wait for it first, so none of them ever sees a prune half done.
        """
        retention.check_rules(keep_last, keep_every, keep_every_seconds)
        if self.rank == 0:
            self.pruning.wait()
            if self.mirroring is not None:  # those on their way now, whenever it runs
                protect = set(protect or ()) | self.mirroring.protected()
        rules = (keep_last, keep_every, keep_every_seconds, delete_bad, dry_run, protect or ())
        if background:
            if self.rank == 0 and any(r is not None for r in rules[:3]):
                self.pruning.start(
                    lambda: retention.prune_directory(self.directory, *rules), str(self.directory)
                )
            return []
        result: list[Path] | None = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                result = retention.prune_directory(self.directory, *rules)
            except OSError as exc:
                error = exc
        self.agreement.agree(error, f"pruning {self.directory}")
        return self.comm.bcast(result)

    # -- restore ---------------------------------------------------------------------------
    def entries(self) -> list[layout.Entry]:
        """Committed checkpoints as rank 0 sees them, newest first (same list on every rank)."""
        self.pruning.wait()
        return self.restorer.entries()

    def restore(
        self,
        state: dict[str, Any],
        only: str | tuple[str, ...] | list[str] | None = None,
        *,
        strict: bool = True,
    ) -> RestoreResult | None:
        """Fill ``state`` from the newest checkpoint that verifies on every rank.

        With a node-local tier, a copy there newer than every checkpoint of the
        directory is taken when every rank holds its part of it (moved and rebuilt
        from the redundancy when one is set) and every part verifies; otherwise the
        directory's.

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
        rank count; it reads the directory's checkpoints, never the node-local tier.
        Objects with ``load_state_dict`` get it called with what was saved;
        an error there is a CheckpointError on every rank.

        ``strict`` (the default): the state's keys must be the checkpoint's, else
        CheckpointError on every rank naming both sets of keys, before anything is read
        into the state (:func:`.matching.key_differences` says which keys: those of
        every dict at any depth, except an empty one, which takes what the checkpoint
        holds; an object's ``state_dict()`` keys; with ``only``, below those keys).
        ``strict=False`` restores what matches: the state's keys the checkpoint lacks
        are left as they are, the checkpoint's the state lacks are added to its dicts,
        an object gets its saved values for the keys its ``state_dict()`` has; the
        result lists them (``skipped_keys``, ``added_keys``, ``ignored_keys``).
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, not {type(state).__name__}")
        keys = None if only is None else ((only,) if isinstance(only, str) else tuple(only))
        self.pruning.wait()  # never read a checkpoint a prune is deleting
        self.saver.forget_changes()
        result, chain = self.restorer.restore(state, keys, strict)
        if result is not None:
            self.saver.remember(chain)
        return result
