"""Where a staged save copies the state before its background write, behind one protocol.

A staged save (:meth:`~hpcckpt.store.save.commit.Saver.begin_save`) asks its mode three
things, in this order: :meth:`StagingMode.stage` this rank's arrays (local, may raise:
the ranks agree on it next), :meth:`StagingMode.staged` once every rank staged
(collective: the node-local tier seals its copies there), and :meth:`StagingMode.start`
the background write of the created file's extents. The modes:

- :class:`HostCopy`: into host buffers reused from save to save: one copy; hashed while
  copied only when the save compares hashes with the last checkpoint's (a delta), else
  hashed by the background thread as it writes the copy;
- :class:`Pieces`: a state larger than the staging budget, copied piece by piece through
  a ring of buffers while earlier pieces are written (:mod:`.save.staging_budget`);
- :class:`NodeLocal`: into this rank's files on the node-local tier, which survive a
  crash of the job's processes (a full save: written in the foreground, hashed and
  sealed by the background thread before the commit);
- :class:`MemoryThenLocal`: into host buffers first (one copy, the blocked time), then,
  by the background thread, into this rank's files on the node-local tier, hashed as they
  are written there (a deferred save whose copy each rank seals alone);
- :class:`Redrain`: a copy already on the node-local tier (just restored, or the newest
  one at the end of the allocation), drained as it is without writing it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hpcckpt.store.io import blocks
from hpcckpt.store.io.direct_io import Extent
from hpcckpt.store.save.background import BackgroundWrite, stream_pieces
from hpcckpt.store.save.staging import HostBuffers
from hpcckpt.store.save.staging_budget import StagingPlan
from hpcckpt.store.tier import copies as fast_tier
from hpcckpt.store.tier.node_local import NodeLocalTier


@dataclass
class Staged:
    """What one rank staged: the arrays the file is written from, their block hashes
    (empty: hashed while the file is created) and offsets in a node-local data file."""

    arrays: dict[str, Any]
    hashes: dict[str, Any] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)
    #: The checkpoint's uid when the staged copy already has one (a drained copy).
    uid: str | None = None


class StagingMode(Protocol):
    """One way to stage a save; see the module's docs for the order of the calls."""

    #: For the result: "copy" or "pieces" when staged in memory, None on the tier.
    name: str | None
    #: For messages: where the state is staged (" in memory", " in /dev/shm/...").
    where: str

    def stage(self, step: int, arrays: dict[str, Any]) -> Staged: ...

    def staged(
        self,
        step: int,
        uid: str,
        tree: Any,
        arrays: dict[str, Any],
        staged: Staged,
        replicated: set[str],
    ) -> None: ...

    #: Whether the file's block hashes are left to the background write (``hashing``).
    hash_later: bool

    def start(
        self,
        partial: Path,
        extents: list[Extent],
        direct: bool,
        hashing: Any = None,
        hashes: dict[str, Any] | None = None,
    ) -> BackgroundWrite: ...

    @property
    def held_bytes(self) -> int: ...


class HostCopy:
    """Whole into host buffers reused between saves: one copy. ``hashed``: the hashes
    are computed while copying (a delta needs them to find the changed blocks); else
    the background write hashes the copy (``hash_later``)."""

    name: str | None = "copy"
    where = " in memory"

    def __init__(self, buffers: HostBuffers, block_size: int, hashed: bool = True) -> None:
        self.buffers, self.block_size, self.hashed = buffers, block_size, hashed
        self.hash_later = not hashed

    def stage(self, step: int, arrays: dict[str, Any]) -> Staged:
        copies, hashes = self.buffers.stage(arrays, self.block_size, hashed=self.hashed)
        return Staged(copies, hashes)

    def staged(self, *args: Any) -> None:
        pass

    def start(
        self,
        partial: Path,
        extents: list[Extent],
        direct: bool,
        hashing: Any = None,
        hashes: dict[str, Any] | None = None,
    ) -> BackgroundWrite:
        return BackgroundWrite(partial, extents, direct, hashing=hashing).start()

    @property
    def held_bytes(self) -> int:
        return self.buffers.nbytes


class Pieces(HostCopy):
    """Through a ring of buffers of the budget's size, while earlier pieces are written."""

    name = "pieces"

    def __init__(self, buffers: HostBuffers, plan: StagingPlan) -> None:
        super().__init__(buffers, 0)
        self.plan = plan
        self.hash_later = False

    def stage(self, step: int, arrays: dict[str, Any]) -> Staged:
        return Staged(arrays)  # hashed while the file is created, copied piece by piece

    def start(
        self,
        partial: Path,
        extents: list[Extent],
        direct: bool,
        hashing: Any = None,
        hashes: dict[str, Any] | None = None,
    ) -> BackgroundWrite:
        ring = self.buffers.ring(self.plan.staging_bytes)
        return stream_pieces(partial, extents, ring, direct)


class NodeLocal:
    """Into this rank's files on the node-local tier, sealed once every rank has its copy.

    ``hash_later`` (a full save, no redundancy, no tier copy newer than the directory's:
    :meth:`NodeLocalTier.seals_alone`): the foreground writes the copy and nothing more;
    the background thread hashes it as it drains it, then seals it, each rank alone,
    before the commit (a copy counts only once every rank's manifest is there)."""

    name: str | None = None
    held_bytes = 0

    def __init__(self, tier: NodeLocalTier, hash_later: bool = False) -> None:
        self.tier = tier
        self.where = f" in {tier.path}"
        self.hash_later = hash_later
        self._seal: tuple[Any, ...] = ()

    def stage(self, step: int, arrays: dict[str, Any]) -> Staged:
        return Staged(*self.tier.stage(step, arrays, hashed=not self.hash_later))

    def staged(
        self,
        step: int,
        uid: str,
        tree: Any,
        arrays: dict[str, Any],
        staged: Staged,
        replicated: set[str],
    ) -> None:
        if self.hash_later:  # sealed by the background thread (start)
            self._seal = (step, uid, tree, staged.arrays, staged.offsets, replicated)
            return
        self.tier.seal_staged(
            step,
            uid,
            tree,
            arrays,
            hashes=staged.hashes,
            offsets=staged.offsets,
            replicated=replicated,
        )

    def start(
        self,
        partial: Path,
        extents: list[Extent],
        direct: bool,
        hashing: Any = None,
        hashes: dict[str, Any] | None = None,
    ) -> BackgroundWrite:
        seal = None
        if self.hash_later:
            step, uid, tree, arrays, offsets, replicated = self._seal
            done = hashes if hashes is not None else {}

            def seal() -> None:
                self.tier.seal_alone(step, uid, tree, arrays, done, offsets, replicated)

        return BackgroundWrite(partial, extents, direct, hashing=hashing, seal=seal).start()


class MemoryThenLocal(NodeLocal):
    """A node-local save whose blocked time is one copy into host memory: the copy into
    the tier's files (pages of a memory file system, 4 KiB each where ``shmem_enabled`` is
    ``never``, slower to fill than anonymous memory), the hashes and the removal of the
    older copy are the background thread's (:meth:`to_tier`), before it drains and seals."""

    def __init__(self, tier: NodeLocalTier, buffers: HostBuffers) -> None:
        super().__init__(tier, hash_later=True)
        self.buffers = buffers
        self.where = f" in memory, then {tier.path}"

    def stage(self, step: int, arrays: dict[str, Any]) -> Staged:
        copies, _ = self.buffers.stage(arrays, 0, hashed=False)
        return Staged(copies)

    def to_tier(self, step: int, staged: Staged) -> Staged:
        """Write the host copy into this rank's tier files, hashed in the same pass (the
        background thread's; not collective)."""
        return Staged(*self.tier.stage(step, staged.arrays, hashed=True))

    @property
    def held_bytes(self) -> int:  # type: ignore[override]
        return self.buffers.nbytes


class Redrain(NodeLocal):
    """A sealed node-local copy, drained as it is (its own uid, arrays mapped from its file)."""

    def __init__(self, tier: NodeLocalTier, copy: fast_tier.LocalCopy, block_size: int) -> None:
        super().__init__(tier)
        self.copy, self.block_size = copy, block_size

    def stage(self, step: int, arrays: dict[str, Any]) -> Staged:
        mapped = fast_tier.maps(self.copy)
        hashes = {p: blocks.block_hashes(a, self.block_size) for p, a in mapped.items()}
        return Staged(mapped, hashes, uid=self.copy.uid)

    def staged(self, *args: Any) -> None:
        pass  # sealed when it was written


class Unstaged(HostCopy):
    """Not copied: a deferred save's rank whose budget holds no copy writes from its live
    state, and its save returns once that write is durable (the values stay exact: the
    rank's training waits); the other ranks' copies go on."""

    name = "unstaged"

    def __init__(self, buffers: HostBuffers, block_size: int) -> None:
        super().__init__(buffers, block_size, hashed=False)

    def stage(self, step: int, arrays: dict[str, Any]) -> Staged:
        self.buffers.release()  # no copy this time: the memory goes back
        return Staged(arrays)

    @property
    def held_bytes(self) -> int:
        return 0
