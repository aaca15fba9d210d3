"""The checkpoint store: save a state collectively and durably, restore the newest good one.

Commit protocol of one save (all ranks take part; see docs/format.md):

1. every rank encodes its state; the ranks agree that every encoding succeeded;
2. rank 0 creates the directory (owner-only), removes ``*.partial`` leftovers and,
   on the first save, applies the file-system tuning (``lfs setstripe`` on Lustre);
3. every rank writes its arrays into ``ckpt-<step>.h5.partial`` through MPI-IO and the
   file is flushed (``MPI_File_sync``) and closed;
4. the ranks agree that every one of them succeeded (an allgather); if not, rank 0
   deletes the partial file and every rank raises;
5. rank 0 fsyncs the file, renames it to ``ckpt-<step>.h5`` and fsyncs the directory.

Only step 5 makes the checkpoint visible, so a crash at any moment leaves either
the previous set of checkpoints or the previous set plus this complete one.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpi4py import MPI

from hpcckpt.store import durability, filesystem, layout, retention
from hpcckpt.store.checkpoint_file import write_file
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.reader import CheckpointReader
from hpcckpt.store.resharding import Split, common_tree, even_split, resolve_ranges
from hpcckpt.store.state_tree import check_fits, decode_into, encode, lookup

log = logging.getLogger("hpcckpt.store")

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "CorruptCheckpoint",
    "RestoreResult",
    "SaveResult",
]


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
    saved_ranks: int = 0  # how many ranks wrote the restored checkpoint


class _Fatal(Exception):
    """A checkpoint that is fine but cannot be restored into this run: stop, do not fall back."""


class CheckpointStore:
    """A directory of checkpoints shared by the ranks of ``comm``.

    ``distributed`` names the arrays split along axis 0 across ranks (array paths:
    the state's keys joined by '/', e.g. ``"fields/u"``), as a collection or as a
    mapping to a split function ``split(global_rows, nranks, rank) -> (lo, hi)`` (or
    None). A distributed array is stored as the global array and can be restored on
    any number of ranks. ``tuning`` adjusts the file-system tuning
    (:class:`hpcckpt.store.filesystem.TuningOptions`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        comm: MPI.Comm,
        *,
        distributed: Iterable[str] | Mapping[str, Split | None] = (),
        tuning: filesystem.TuningOptions | None = None,
    ) -> None:
        self.directory = Path(directory).absolute()
        self.comm = comm
        self.rank = comm.Get_rank()
        self.nranks = comm.Get_size()
        if isinstance(distributed, str):
            distributed = [distributed]
        splits = dict(distributed) if isinstance(distributed, Mapping) else {}
        self.distributed: dict[str, Split | None] = {name: splits.get(name) for name in distributed}
        self.tuning_options = tuning or filesystem.TuningOptions()
        self.tuning: filesystem.Tuning | None = None  # decided at the first save

    def _agree(
        self, error: BaseException | None, what: str, kind: type[Exception] = CheckpointError
    ) -> None:
        """Raise on every rank if any rank failed; the message names the ranks and reasons."""
        errors = self.comm.allgather(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            detail = "; ".join(f"rank {r}: {e}" for r, e in failed[:4])
            raise kind(f"{what} failed ({detail})") from error

    # -- save ------------------------------------------------------------------------------
    def _tune(self, state_bytes: int) -> filesystem.Tuning:
        """Rank 0 detects the file system and stripes the directory; every rank gets the plan."""
        plan = None
        if self.rank == 0:
            fs = filesystem.detect(self.directory)
            plan = filesystem.plan(
                self.directory, fs, self.nranks, state_bytes, self.tuning_options
            )
            if plan.setstripe_argv:
                why = filesystem.apply_setstripe(plan.setstripe_argv)
                if why:
                    log.warning("could not stripe %s (%s); writing anyway", self.directory, why)
            log.info("file system %s (%s): MPI-IO hints %s", fs.kind, fs.name, plan.hints or "none")
        return self.comm.bcast(plan)

    def save(
        self, step: int, state: dict[str, Any], extra_meta: dict[str, Any] | None = None
    ) -> SaveResult:
        """Write ``state`` as the checkpoint of ``step``; collective; returns after commit.

        A value that cannot be checkpointed raises TypeError on every rank (naming the
        rank and key path); any other failure raises CheckpointError on every rank.
        """
        t0 = time.perf_counter()
        final = self.directory / layout.checkpoint_name(step)
        partial = final.with_name(final.name + layout.PARTIAL)
        error: BaseException | None = None
        tree, arrays = None, {}
        try:
            tree, arrays = encode(state)
        except (TypeError, ValueError) as exc:
            error = exc
        self._agree(error, f"encoding the state of step {step}", TypeError)
        state_bytes = self.comm.allreduce(sum(a.nbytes for a in arrays.values()), op=MPI.SUM)

        if self.rank == 0:
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                for leftover in layout.partials(self.directory):
                    log.info("removing leftover %s from an interrupted save", leftover.name)
                    leftover.unlink(missing_ok=True)
            except OSError as exc:
                error = exc
        self._agree(error, f"preparing checkpoint directory {self.directory}")
        if self.tuning is None:
            self.tuning = self._tune(state_bytes)

        nbytes = 0
        try:
            nbytes = write_file(
                partial,
                self.comm,
                step,
                tree,
                arrays,
                extra_meta,
                distributed=self.distributed,
                hints=self.tuning.hints,
                alignment=self.tuning.alignment,
            )
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
                durability.commit(partial, final)
            except OSError as exc:
                error = exc
        self._agree(error, f"committing checkpoint of step {step}")
        total = self.comm.allreduce(nbytes, op=MPI.SUM)
        seconds = self.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        return SaveResult(step, final, total, seconds)

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

    def _gather(self, problem: str | None, fatal: str | None, payload: Any = None) -> list[Any]:
        """Every rank's (problem, fatal, payload); raises _Fatal / CorruptCheckpoint alike."""
        outcome = self.comm.allgather((problem, fatal, payload))
        fatals = [f for _, f, _ in outcome if f]
        if fatals:
            raise _Fatal(fatals[0])
        problems = [p for p, _, _ in outcome if p]
        if problems:
            raise CorruptCheckpoint("; ".join(dict.fromkeys(problems[:4])))
        return [p for _, _, p in outcome]

    def _request(self, reader: CheckpointReader, name: str, state: Any) -> tuple[Any, ...]:
        """The rows this rank asks for of distributed array ``name`` (see resharding)."""
        rows = reader.arrays[name].shape[0]
        split = self.distributed.get(name)
        if split is not None:
            lo, hi = split(rows, self.nranks, self.rank)
            return ("range", int(lo), int(hi))
        held = lookup(state, name)
        if hasattr(held, "shape") and len(held.shape) >= 1:
            return ("count", int(held.shape[0]))
        if reader.nranks == self.nranks:  # the split it was saved with
            offs = reader.arrays[name].rank_offsets
            return ("range", offs[self.rank], offs[self.rank + 1])
        return ("range", *even_split(rows, self.nranks, self.rank))

    def _load(self, entry: layout.Entry, state: dict[str, Any]) -> tuple[Any, dict, int]:
        """Read and verify this rank's tree and arrays of ``entry``; collective."""
        reader = None
        problem = fatal = None
        requests: dict[str, tuple[Any, ...]] = {}
        try:
            reader = CheckpointReader(entry.path)
            for name, info in reader.arrays.items():
                if name in self.distributed and info.layout != "rows":
                    fatal = (
                        f"array {name!r} is declared distributed, but {entry.path.name} stores "
                        f"it per rank ({info.layout} layout): restore it with the rank count "
                        f"that wrote it ({reader.nranks})"
                    )
                elif info.distributed or name in self.distributed:
                    requests[name] = self._request(reader, name, state)
        except CorruptCheckpoint as exc:
            problem = str(exc)
        except CheckpointError as exc:
            fatal = str(exc)
        except Exception as exc:  # a split function raised: every rank must hear of it
            fatal = f"choosing the rows to restore: {type(exc).__name__}: {exc}"
        try:
            gathered = self._gather(problem, fatal, requests)
            assert reader is not None
            saved = reader.nranks
            ranges = {}
            for name in requests:
                rows = reader.arrays[name].shape[0]
                try:
                    ranges[name] = resolve_ranges(name, [g[name] for g in gathered], rows)
                except CheckpointError as exc:
                    raise _Fatal(str(exc)) from exc

            problem = fatal = None
            tree, arrays = None, {}
            try:
                if saved == self.nranks:
                    tree = reader.tree(self.rank)
                else:
                    tree = common_tree([reader.tree(r) for r in range(saved)], saved, self.nranks)
                    per_rank = [
                        n for n in reader.arrays if n not in ranges and not reader.replicated(n)
                    ]
                    if per_rank:
                        raise CheckpointError(
                            f"array {per_rank[0]!r} is per rank (not declared distributed, and "
                            f"not the same on every rank): {entry.path.name} was written by "
                            f"{saved} ranks, this run has {self.nranks}. Declare it distributed "
                            f"(split along axis 0) or restart with {saved} ranks"
                        )
                for name in reader.arrays:
                    if name in ranges:
                        arrays[name] = reader.rows(name, *ranges[name][self.rank])
                    else:
                        rank = self.rank if saved == self.nranks else 0
                        arrays[name] = reader.rank_array(name, rank)
                fatal = check_fits(state, tree, arrays)
            except CorruptCheckpoint as exc:
                problem = str(exc)
            except CheckpointError as exc:
                fatal = str(exc)
            except (OSError, ValueError) as exc:
                problem = f"{entry.path.name}: unreadable ({type(exc).__name__}: {exc})"
            self._gather(problem, fatal)
            return tree, arrays, saved
        finally:
            if reader is not None:
                reader.close()

    def restore(self, state: dict[str, Any]) -> RestoreResult | None:
        """Fill ``state`` from the newest checkpoint that verifies on every rank.

        A checkpoint that fails verification is marked bad (never deleted) and the
        next older one is tried. A checkpoint that is sound but does not fit this run
        (other shapes, or a rank count it cannot be split to) raises CheckpointError
        on every rank before anything is overwritten. Returns None when the directory
        holds no checkpoint.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, not {type(state).__name__}")
        skipped: list[tuple[int, str]] = []
        entries = self.entries()
        for entry in entries:
            if not entry.good_candidate:
                skipped.append((entry.step, f"marked bad earlier: {entry.bad_reason}"))
                continue
            try:
                tree, arrays, saved = self._load(entry, state)
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
                    layout.mark_bad(entry.path, reason)
                skipped.append((entry.step, reason))
                continue
            decode_into(state, tree, arrays)
            return RestoreResult(entry.step, entry.path, skipped, saved)
        if entries:
            detail = "; ".join(f"step {s}: {r}" for s, r in skipped[:4])
            raise CheckpointError(
                f"none of the {len(entries)} checkpoints in {self.directory} is good ({detail}). "
                "Move them aside to start from scratch, or inspect them with 'hpcckpt verify'"
            )
        return None
