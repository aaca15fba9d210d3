"""The checkpoint store: a directory of checkpoints shared by the ranks of a communicator.

A thin front over the rooms that do the work: :mod:`.commit` (the commit protocol of a
save, staged or not), :mod:`.restore` and :mod:`.load` (which checkpoint to take, and
reading it), :mod:`.local_tier` (the node-local tier), :mod:`.retention` (pruning),
all deciding together through one :class:`~.agreement.Agreement`. Its settings are
one :class:`~.options.StoreOptions`; see docs/format.md for the protocol itself.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mpi4py import MPI

from hpcckpt.store import retention
from hpcckpt.store.agreement import Agreement
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.file import layout
from hpcckpt.store.io import safety
from hpcckpt.store.mirror.backend import MirrorBackend, open_backend
from hpcckpt.store.options import StoreOptions
from hpcckpt.store.restore.fallback import Restorer
from hpcckpt.store.restore.load import Loader
from hpcckpt.store.results import RestoreResult, SaveResult
from hpcckpt.store.save.commit import Modes, PendingSave, Saver, StagingRefused
from hpcckpt.store.save.staging import HostBuffers
from hpcckpt.store.tier import copies as fast_tier
from hpcckpt.store.tier.node_local import NodeLocalTier, Place
from hpcckpt.store.tree.encoding import Encoder

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "CorruptCheckpoint",
    "PendingSave",
    "RestoreResult",
    "SaveResult",
    "StagingRefused",
]


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
    ``mirror_*`` keywords (:class:`.MirrorOptions`: the second tier, which restore
    reads when the directory holds nothing newer that is good).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        comm: MPI.Comm,
        options: StoreOptions | None = None,
        **keywords: Any,
    ) -> None:
        if options is not None and keywords:
            raise TypeError("CheckpointStore takes options or keywords, not both")
        self.options = options or StoreOptions.from_keywords("CheckpointStore", **keywords)
        self.directory = Path(directory).absolute()
        self.comm = comm
        self.rank = comm.Get_rank()
        self.nranks = comm.Get_size()
        #: Every collective decision and cross-rank error of this store goes through it.
        self.agreement = Agreement(comm)
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
        )
        loader = Loader(self.agreement, self.options.arrays.splits, lambda: self.saver.direct_io)
        #: Rank 0's connection to the mirror (None on the other ranks, or without one).
        self.mirror: MirrorBackend | None = None
        mirror = self.options.mirror
        if mirror.url is not None:
            error = self.agreement.from_root(self._open_mirror)
            if error is not None:  # on every rank alike
                raise ValueError(error)
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
            self.mirror = open_backend(mirror.url, mirror.mirror_bandwidth)  # type: ignore[arg-type]
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
        return self.saver.save(step, state, extra_meta)

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
        return self.saver.begin_save(step, state, extra_meta, buffers=buffers, redrain=redrain)

    def finish_save(self, pending: PendingSave) -> SaveResult:
        """Wait for every rank's background write, then commit; CheckpointError on every
        rank if any rank's write failed (the checkpoint never becomes good)."""
        return self.saver.finish_save(pending)

    def save_local(self, step: int, state: dict[str, Any]) -> SaveResult:
        """A checkpoint on the node-local tier only (no drain), with its redundancy."""
        if self.tier is None:
            raise ValueError("save_local needs a node-local tier: set cache=PATH")
        return self.tier.save_local(step, state)

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
    ) -> list[Path]:
        """Delete checkpoints the retention rules do not keep (see :mod:`.retention`).

        Rank 0 deletes, every rank gets the list of deleted paths. Never deletes the
        newest good checkpoint, nor the ``protect`` steps (rank 0's: those on their way
        to the mirror) and their chains; keeps bad ones unless ``delete_bad``.
        """
        retention.check_rules(keep_last, keep_every, keep_every_seconds)
        result: list[Path] | None = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                result = retention.prune_directory(
                    self.directory,
                    keep_last,
                    keep_every,
                    keep_every_seconds,
                    delete_bad,
                    dry_run,
                    protect or (),
                )
            except OSError as exc:
                error = exc
        self.agreement.agree(error, f"pruning {self.directory}")
        return self.comm.bcast(result)

    # -- restore ---------------------------------------------------------------------------
    def entries(self) -> list[layout.Entry]:
        """Committed checkpoints as rank 0 sees them, newest first (same list on every rank)."""
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
        into the state (:func:`.state_tree.key_differences` says which keys: those of
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
        self.saver.forget_changes()
        result, chain = self.restorer.restore(state, keys, strict)
        if result is not None:
            self.saver.remember(chain)
        return result
