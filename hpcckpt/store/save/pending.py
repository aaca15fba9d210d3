"""A staged save between its staging and its commit (:class:`PendingSave`), and the
refusal to stage one (:class:`StagingRefused`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpcckpt.store.file.writer import Written
from hpcckpt.store.results import STAGED, SaveResult
from hpcckpt.store.save.background import BackgroundWrite, DeferredWrite


@dataclass
class PendingSave:
    """A staged save whose bytes are being written in the background (not committed)."""

    step: int
    partial: Path
    final: Path
    written: Written | None  # None until a deferred save's background steps made the file
    writer: BackgroundWrite | DeferredWrite
    foreground: float  # this rank's seconds in begin_save
    #: The slowest rank's seconds in begin_save (deferred: this rank's, until the commit).
    blocked: float
    bytes_total: int  # over all ranks
    staging: str | None = None  # in memory: "copy" or "pieces" (staging_budget)
    staging_bytes: int = 0  # host bytes this rank's staging holds
    #: Whether the ranks agree on it and create its file in the background (deferred).
    deferred: bool = False
    #: Set in the background when some rank's budget held no copy: "rank R: why".
    refused: str | None = None
    #: Steps 4-5 when the deferred saves' thread ran them after the write: the measures
    #: and the cleared bad mark of :meth:`Saver.commit_staged`, or what it raised (on
    #: every rank alike); None: the commit is the caller's (:meth:`Saver.finish_save`).
    behind: tuple[list[float], str | None] | BaseException | None = None
    #: ``time.perf_counter()`` when its save began: the blocked time of a rank still in
    #: its ``save()`` at a commit in the background (``blocked`` is 0.0 until it returns).
    begun: float = 0.0

    def go(self) -> None:
        """Let the background write run: the caller has done what it does before its
        ``save()`` returns (until then the write is held, or a deferred save's steps not
        handed to their thread; waiting for the write lets it run too)."""
        self.writer.go()

    def done(self) -> bool:
        """Whether this rank's background write has finished (well or not); never blocks."""
        return self.writer.done()

    def staged_result(self) -> SaveResult:
        """What the save says before its commit: the file it becomes, its bytes and kind,
        and the ranks' ``blocked`` seconds as its cost. A deferred save's kind and size
        are decided in the background: ``kind="staged"`` and ``bytes_written=0`` until
        its commit, and ``blocked`` is this rank's."""
        w = self.written
        return SaveResult(
            step=self.step,
            path=self.final,
            bytes_written=0 if w is None else self.bytes_total,
            seconds=self.blocked,
            kind=STAGED if w is None else w.kind,
            dirty_blocks=0 if w is None else w.dirty_blocks,
            total_blocks=0 if w is None else w.total_blocks,
            blocked_seconds=self.blocked,
        )


class StagingRefused(Exception):
    """Raised on every rank by :meth:`Saver.begin_save` when some rank has too little
    memory to stage its state: nothing was written; save synchronously instead."""
