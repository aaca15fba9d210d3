"""The checkpoint store: save a state collectively and durably, restore the newest good one.

Commit protocol of one save (all ranks take part):

1. rank 0 creates the directory (owner-only) and removes ``*.partial`` leftovers;
2. every rank writes its arrays into ``ckpt-<step>.h5.partial`` through MPI-IO and the
   file is flushed (``MPI_File_sync``) and closed;
3. the ranks agree that every one of them succeeded (an allreduce); if not, rank 0
   deletes the partial file and every rank raises;
4. rank 0 fsyncs the file, renames it to ``ckpt-<step>.h5`` and fsyncs the directory.

Only step 4 makes the checkpoint visible, so a crash at any moment leaves either
the previous set of checkpoints or the previous set plus this complete one.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpi4py import MPI

from hpcckpt.store import layout
from hpcckpt.store.checkpoint_file import (
    CheckpointError,
    CorruptCheckpoint,
    read_file,
    write_file,
)
from hpcckpt.store.durability import durable_rename, fsync_path
from hpcckpt.store.state_tree import check_fits, decode_into, encode

log = logging.getLogger("hpcckpt.store")


@dataclass(frozen=True)
class SaveResult:
    step: int
    path: Path
    bytes_written: int  # summed over ranks
    seconds: float  # wall time of the slowest rank, commit included


@dataclass(frozen=True)
class RestoreResult:
    step: int
    path: Path
    skipped: list[tuple[int, str]]  # newer checkpoints found bad, with the reason


class CheckpointStore:
    """A directory of checkpoints shared by the ranks of ``comm``."""

    def __init__(self, directory: str | os.PathLike[str], comm: MPI.Comm) -> None:
        self.directory = Path(directory).absolute()
        self.comm = comm
        self.rank = comm.Get_rank()

    def _agree(self, error: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank failed; the message names the ranks and reasons."""
        errors = self.comm.allgather(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:4])
            raise CheckpointError(f"{what} failed ({detail})") from error

    def save(self, step: int, state: dict[str, Any], extra_meta: dict[str, Any] | None = None) -> SaveResult:
        """Write ``state`` as the checkpoint of ``step``; collective; returns after commit."""
        t0 = time.perf_counter()
        final = self.directory / layout.checkpoint_name(step)
        partial = final.with_name(final.name + layout.PARTIAL)
        error: BaseException | None = None
        if self.rank == 0:
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                for leftover in layout.partials(self.directory):
                    log.info("removing leftover %s from an interrupted save", leftover.name)
                    leftover.unlink(missing_ok=True)
            except OSError as exc:
                error = exc
        self._agree(error, f"preparing checkpoint directory {self.directory}")

        tree, arrays = encode(state)
        nbytes = 0
        try:
            nbytes = write_file(partial, self.comm, step, tree, arrays, extra_meta)
        except Exception as exc:  # every rank must reach the agreement below
            error = exc
        try:
            self._agree(error, f"writing checkpoint of step {step}")
        except CheckpointError:
            if self.rank == 0:
                partial.unlink(missing_ok=True)
            raise

        if self.rank == 0:
            try:
                fsync_path(partial)
                durable_rename(partial, final)
            except OSError as exc:
                error = exc
        self._agree(error, f"committing checkpoint of step {step}")
        total = self.comm.allreduce(nbytes, op=MPI.SUM)
        seconds = self.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        return SaveResult(step, final, total, seconds)

    def entries(self) -> list[layout.Entry]:
        """Committed checkpoints as rank 0 sees them, newest first (same list on every rank)."""
        return self.comm.bcast(layout.scan(self.directory) if self.rank == 0 else None)

    def restore(self, state: dict[str, Any]) -> RestoreResult | None:
        """Fill ``state`` from the newest checkpoint that verifies on every rank.

        A checkpoint that fails verification is marked bad (never deleted) and the
        next older one is tried. Returns None when the directory holds no checkpoint.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, not {type(state).__name__}")
        skipped: list[tuple[int, str]] = []
        entries = self.entries()
        for entry in entries:
            if not entry.good_candidate:
                skipped.append((entry.step, f"marked bad earlier: {entry.bad_reason}"))
                continue
            loaded = None
            problem: str | None = None
            fatal: str | None = None
            try:
                loaded = read_file(entry.path, self.comm)
                fatal = check_fits(state, loaded[0], loaded[1])
            except CorruptCheckpoint as exc:
                problem = str(exc)
            except CheckpointError as exc:
                fatal = str(exc)
            outcome = self.comm.allgather((problem, fatal))
            fatals = [f for _, f in outcome if f]
            if fatals:
                raise CheckpointError(fatals[0])
            problems = [p for p, _ in outcome if p]
            if problems:
                reason = "; ".join(problems[:4])
                if self.rank == 0:
                    log.warning("checkpoint %s is bad (%s); trying the previous one", entry.path.name, reason)
                    layout.mark_bad(entry.path, reason)
                skipped.append((entry.step, reason))
                continue
            tree, arrays, _meta = loaded
            decode_into(state, tree, arrays)
            return RestoreResult(entry.step, entry.path, skipped)
        if entries:
            detail = "; ".join(f"step {s}: {r}" for s, r in skipped[:4])
            raise CheckpointError(
                f"none of the {len(entries)} checkpoints in {self.directory} is good ({detail}). "
                "Move them aside to start from scratch, or inspect them with 'hpcckpt verify'"
            )
        return None
