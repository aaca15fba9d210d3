"""Reading one checkpoint into a state, on every rank: verified, and resharded when the
rank count or the rows changed.

Two paths (docs/format.md, "Restore"): the *planned* read, when every rank takes what it
saved: rank 0 validates the file once (:mod:`.file.reader`) and scatters each rank's read
plan (:mod:`.restore.read_plan`), so the other ranks read with ``pread`` and never parse HDF5
metadata; and the *general* read, where every rank opens the file to take other rows
(:mod:`.restore.resharding`). Either way the ranks agree on what they found
(:meth:`.Agreement.findings`): damage is a CorruptCheckpoint (the caller falls back to
an older checkpoint), a checkpoint that cannot fit this run is :class:`.Refused`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hpcckpt.store.agreement import Agreement, Refused
from hpcckpt.store.comm import MAX
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io.blocks import ChainState
from hpcckpt.store.restore import pieces, read_plan
from hpcckpt.store.restore.resharding import common_tree, even_split, resolve_ranges
from hpcckpt.store.tree import tensors
from hpcckpt.store.tree.matching import check_fits, check_keys, lookup
from hpcckpt.store.tree.options import Split
from hpcckpt.store.tree.queries import select_keys
from hpcckpt.store.tree.state_tree import Targets, escape, key_part, unescape


class ReadPath(Protocol):
    """How this directory's files are read: the store's saver, which decides it."""

    @property
    def direct_io(self) -> bool:
        """Whether array bytes are read past the page cache (the choice made when the
        directory was tuned, the file system's rule before)."""


@dataclass
class Loaded:
    """What one rank read of a checkpoint, verified: its state tree and arrays, the rank
    count that wrote it, and what the next save needs to be a delta of it."""

    tree: Any
    arrays: dict[str, Any]
    saved_ranks: int
    chain: ChainState | None


class Findings:
    """What one rank found while reading its part of a checkpoint, for the agreement
    that follows: damage (``problem``, the file at fault in ``culprit``) or a refusal
    (``fatal``). Used as a context manager around the read, it takes those errors."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.problem: str | None = None
        self.fatal: str | None = None
        self.culprit: Any = None

    def __enter__(self) -> Findings:
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


class Held:
    """The application's values at array paths, as :func:`.matching.lookup` finds them,
    each container opened once per restore: a lookup per array walked every path from
    the top, and searched an optimizer's integer-keyed state key by key for each array
    (quadratic in the parameters)."""

    def __init__(self, state: Any, targets: Targets) -> None:
        self.state, self.targets = state, targets
        self._nodes: dict[str, Any] = {}
        self._keys: dict[int, dict[str, Any]] = {}  # a dict's other-than-str keys by part

    def __call__(self, path: str) -> Any:
        if path in self._nodes:
            return self._nodes[path]
        if not path:
            node = self.targets.open(self.state)
        else:
            head, _, part = path.rpartition("/")
            parent = self(head)
            node = None if parent is None else self.targets.open(self._child(parent, part))
        self._nodes[path] = node
        return node

    def _child(self, value: Any, part: str) -> Any:
        if isinstance(value, dict):
            key = unescape(part)
            if key in value:
                return value[key]
            keys = self._keys.get(id(value))
            if keys is None:
                keys = {}
                for k in value:
                    if not isinstance(k, str):
                        keys.setdefault(key_part(k), k)  # the first, as lookup takes it
                self._keys[id(value)] = keys
            return value[keys[part]] if part in keys else None
        if isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            return value[int(part)]
        return None


class Loader:
    """Reads checkpoints of one directory into this rank's state; methods are collective."""

    def __init__(
        self,
        agreement: Agreement,
        splits: dict[str, Split | None],
        read_path: ReadPath,
    ) -> None:
        self.agreement = agreement
        self.rank, self.nranks = agreement.rank, agreement.nranks
        #: The distributed arrays and their split functions (None: the rows they had).
        self.splits = splits
        #: Whether to read past the page cache (the store's rule for this directory).
        self.read_path = read_path

    def _chain_state(self, reader: CheckpointReader) -> ChainState | None:
        """This rank's memory of a restored checkpoint, from the hashes stored in its file."""
        if reader.format_version < 2 or reader.nranks != self.nranks:
            return None
        specs, hashes = {}, {}
        for name, info in reader.arrays.items():
            specs[name] = (info.dtype.str, tuple(info.rank_shapes[self.rank]), info.distributed)
            hashes[name] = reader.block_hashes(name, self.rank).copy()
        return ChainState(
            step=reader.step,
            uid=str(reader.uid),
            block_size=reader.block_size,
            nranks=reader.nranks,
            specs=specs,
            hashes=hashes,
            chain=(*reader.chain_refs, (reader.path.name, reader.step, str(reader.uid))),
            chain_bytes=int(reader.attrs.get("chain_bytes", 0)),
            state_bytes=int(reader.attrs.get("state_bytes", 0)),
        )

    def _request(
        self,
        name: str,
        rows: int,
        saved: tuple[int, int] | None,
        state: Any,
        targets: Targets,
        held: Held | None = None,
    ) -> tuple[Any, ...]:
        """The rows this rank asks for of distributed array ``name`` of ``rows`` rows (see
        resharding); ``saved``: the rows this rank wrote, when the rank count is the same."""
        split = self.splits.get(name)
        if split is not None:
            lo, hi = split(rows, self.nranks, self.rank)
            return ("range", int(lo), int(hi))
        held = lookup(state, name, targets) if held is None else held(name)
        if hasattr(held, "shape") and len(held.shape) >= 1:
            return ("count", int(held.shape[0]))
        if saved is not None:  # the split it was saved with
            return ("range", *saved)
        return ("range", *even_split(rows, self.nranks, self.rank))

    def load(
        self,
        entry: layout.Entry,
        state: dict[str, Any],
        targets: Targets,
        only: tuple[str, ...] | None = None,
    ) -> Loaded:
        """Read and verify this rank's tree and arrays of ``entry`` (with ``only``: of
        those top-level keys); collective. The planned read when every rank takes what
        it saved; the general one (every rank opens the file) to reshard."""
        plan, agree_first, validated = self._plans(entry)
        try:
            if plan is not None:
                loaded = self._load_planned(plan, state, targets, only, agree_first, validated)
                if loaded is not None:
                    return loaded
            return self._load_general(entry, state, targets, only, validated)
        finally:
            if validated is not None:
                validated.close()

    def _plans(
        self, entry: layout.Entry
    ) -> tuple[read_plan.RankPlan | None, bool, CheckpointReader | None]:
        """Rank 0 validates ``entry`` once and sends each rank its read plan (one scatter),
        and whether the ranks must agree on their rows before reading (distributed arrays).

        Raises CorruptCheckpoint (or Refused) on every rank when rank 0 finds it unusable.
        No plan (None everywhere) when the rank count changed or a dataset is not raw.
        Rank 0 also returns its reader, still open, for a general read to take instead
        of validating the file a second time (the caller closes it); None elsewhere.
        """
        out: list[Any] | None = None
        reader: CheckpointReader | None = None
        if self.rank == 0:
            n = self.nranks
            try:
                reader = CheckpointReader(entry.path, direct_io=self.read_path.direct_io)
                plans: list[Any] = [None] * n
                if reader.nranks == n:
                    plans = read_plan.plans(reader) or plans
                agree = bool(self.splits) or any(
                    info.distributed or info.dtensor_shape is not None
                    for info in reader.arrays.values()
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
            if out[0][1] is not None and reader is not None:
                reader.close()
                reader = None
        try:
            plan, found, agree = self.agreement.comm.scatter(out)
        except BaseException:
            if reader is not None:
                reader.close()
            raise
        if found is not None:
            if reader is not None:
                reader.close()
            kind, why, culprits = found
            if kind == "fatal":
                raise Refused(why)
            raise CorruptCheckpoint(why, culprit=culprits)
        return plan, agree, reader

    def _load_planned(
        self,
        plan: read_plan.RankPlan,
        state: dict[str, Any],
        targets: Targets,
        only: tuple[str, ...] | None,
        agree_first: bool,
        validated: CheckpointReader | None = None,
    ) -> Loaded | None:
        """This rank's part of ``plan``, read with POSIX calls and verified; None on every
        rank when some rank asks for other rows than it saved (then reshard).
        ``validated``: rank 0's reader of the file, still open: read through its
        descriptors."""
        parts = None if only is None else {escape(k) for k in only}
        wanted = [a for a in plan.arrays if parts is None or a.name.split("/")[0] in parts]
        names = {a.name for a in wanted}
        held = Held(state, targets)
        own = True  # every distributed array asks for the rows this rank saved
        kinds = np.zeros(len(plan.arrays), np.int64)  # 1 count, 2 range requests
        for i, a in enumerate(plan.arrays):
            if a.name in names and a.dtensor is not None:  # its piece is its new shard?
                own = own and a.name not in self.splits and self._own_piece(a, held)
                continue
            if a.name not in names or not (a.distributed or a.name in self.splits):
                continue
            if a.layout != "rows":
                own = False  # the general path says why it cannot be split
                continue
            try:
                req = self._request(a.name, a.rows, a.own, state, targets, held)
            except Exception:  # a split function raised: the general path reports it
                own = False
                continue
            kinds[i] = 1 if req[0] == "count" else 2
            mine = (a.own[1] - a.own[0],) if req[0] == "count" else a.own
            own = own and tuple(req[1:]) == mine
        if agree_first:  # before anything is read into the application's arrays
            votes = np.concatenate([[int(not own)], kinds, -kinds])
            seen = self.agreement.comm.allreduce_array(votes, MAX)
            highest, lowest = seen[1 : 1 + kinds.size], -seen[1 + kinds.size :]
            if seen[0] or np.any(highest != lowest):
                return None
        found = Findings(Path(plan.files[-1]).name)
        tree, arrays, chain_state = None, {}, None
        if own:
            direct = self.read_path.direct_io
            with found, read_plan.PlanReader(plan, direct_io=direct, opened=validated) as reader:
                tree = select_keys(reader.tree(), only)
                if (why := check_keys(state, tree, plan.step, targets, only)) is not None:
                    raise CheckpointError(why)  # before anything is read into the state
                expected = {a.name: (a.shape, np.dtype(a.dtype), a.torch_dtype) for a in wanted}
                arrays = reader.read_all(wanted, read_targets(state, targets, expected, held))
                found.fatal = check_fits(state, tree, arrays, targets)
                chain_state = ChainState(
                    step=plan.step,
                    uid=plan.uid,
                    block_size=plan.block_size,
                    nranks=plan.nranks,
                    specs={a.name: (a.dtype, a.own_shape, a.distributed) for a in plan.arrays},
                    hashes={a.name: reader.own_hashes(a) for a in plan.arrays},
                    chain=plan.chain,
                    chain_bytes=plan.chain_bytes,
                    state_bytes=plan.state_bytes,
                )
        reshard = None if own else True
        if any(self.agreement.findings(found.problem, found.fatal, reshard, found.culprit)):
            return None
        return Loaded(tree, arrays, plan.nranks, chain_state)

    def _own_piece(self, a: read_plan.ArrayPlan, held: Held) -> bool:
        """Whether DTensor ``a``'s new shard on this rank is the piece this rank saved
        (the same mesh and placements); anything else, or an error, is the general path's
        to read or to report."""
        assert a.dtensor is not None
        shape, offset = a.dtensor
        try:
            box = pieces.wanted_box(held(a.name), shape)
        except Exception:
            return False
        return box == (tuple(offset), tuple(a.own_shape))

    def _load_general(
        self,
        entry: layout.Entry,
        state: dict[str, Any],
        targets: Targets,
        only: tuple[str, ...] | None = None,
        validated: CheckpointReader | None = None,
    ) -> Loaded:
        """The restore where every rank opens the file: any rank count, any rows.
        ``validated``: this rank's reader of ``entry``, open (rank 0's from the plans;
        the caller closes it)."""
        reader = None
        problem = fatal = culprit = None
        requests: dict[str, tuple[Any, ...]] = {}
        boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # DTensors: this rank's
        held = Held(state, targets)
        try:
            reader = validated or CheckpointReader(entry.path, direct_io=self.read_path.direct_io)
            parts = None if only is None else {escape(k) for k in only}
            wanted = [n for n in reader.arrays if parts is None or n.split("/")[0] in parts]
            same = reader.nranks == self.nranks
            for name in wanted:
                info = reader.arrays[name]
                if info.dtensor_shape is not None:
                    if name in self.splits:
                        fatal = (
                            f"array {name!r} is declared distributed, but {entry.path.name} "
                            "stores it as a DTensor: its placements say how it is split; "
                            "do not declare it"
                        )
                    else:
                        boxes[name] = pieces.wanted_box(held(name), info.dtensor_shape)
                elif name in self.splits and info.layout != "rows":
                    fatal = (
                        f"array {name!r} is declared distributed, but {entry.path.name} stores "
                        f"it per rank ({info.layout} layout): restore it with the rank count "
                        f"that wrote it ({reader.nranks})"
                    )
                elif info.distributed or name in self.splits:
                    offs = info.rank_offsets
                    saved = (offs[self.rank], offs[self.rank + 1]) if same else None
                    requests[name] = self._request(name, info.shape[0], saved, state, targets, held)
        except CorruptCheckpoint as exc:
            problem, culprit = str(exc), exc.culprit
        except CheckpointError as exc:
            fatal = str(exc)
        except Exception as exc:  # a split function raised: every rank must hear of it
            fatal = f"choosing the rows to restore: {type(exc).__name__}: {exc}"
        try:
            gathered = self.agreement.findings(problem, fatal, requests, culprit)
            assert reader is not None
            saved = reader.nranks
            ranges = {}
            for name in requests:
                rows = reader.arrays[name].shape[0]
                try:
                    ranges[name] = resolve_ranges(name, [g[name] for g in gathered], rows)
                except CheckpointError as exc:
                    raise Refused(str(exc)) from exc

            found = Findings(entry.path.name)
            tree, arrays, chain_state = None, {}, None
            with found:
                if saved == self.nranks:
                    tree = select_keys(reader.tree(self.rank), only)
                else:
                    trees = [select_keys(reader.tree(r), only) for r in range(saved)]
                    tree = common_tree(trees, saved, self.nranks)
                    per_rank = [
                        n
                        for n in wanted
                        if n not in ranges and n not in boxes and not reader.replicated(n)
                    ]
                    if per_rank:
                        raise CheckpointError(
                            f"array {per_rank[0]!r} is per rank (not declared distributed, and "
                            f"not the same on every rank): {entry.path.name} was written by "
                            f"{saved} ranks, this run has {self.nranks}. Declare it distributed "
                            f"(split along axis 0) or restart with {saved} ranks"
                        )
                if (why := check_keys(state, tree, entry.step, targets, only)) is not None:
                    raise CheckpointError(why)  # before anything is read into the state
                source = self.rank if saved == self.nranks else 0
                expected = {}
                for name in wanted:
                    info = reader.arrays[name]
                    if name in ranges:
                        lo, hi = ranges[name][self.rank]
                        shape: tuple[int, ...] = (hi - lo, *info.trailing)
                    elif name in boxes:
                        shape = boxes[name][1]
                    else:
                        shape = tuple(info.rank_shapes[0 if info.replicated else source])
                    expected[name] = (shape, info.dtype, info.torch_dtype)
                into = read_targets(state, targets, expected, held)
                boxed = pieces.PieceReader(reader)
                for name in wanted:
                    if name in boxes:
                        arrays[name] = boxed.box(name, *boxes[name], into.get(name))
                    elif name in ranges:
                        lo, hi = ranges[name][self.rank]
                        arrays[name] = reader.rows(name, lo, hi, into.get(name))
                    else:
                        arrays[name] = reader.rank_array(name, source, into.get(name))
                found.fatal = check_fits(state, tree, arrays, targets)
                chain_state = self._chain_state(reader)
            self.agreement.findings(found.problem, found.fatal, None, found.culprit)
            return Loaded(tree, arrays, saved, chain_state)
        finally:
            if reader is not None and reader is not validated:
                reader.close()


def read_targets(
    state: Any,
    targets: Targets,
    expected: dict[str, tuple[tuple[int, ...], np.dtype, str]],
    values: Held | None = None,
) -> dict[str, np.ndarray]:
    """The application's arrays a restore can read straight into, by array name.

    ``expected``: the (shape, dtype, torch dtype or "") this rank takes of each array it
    reads. Reading into the application's arrays saves a copy and the first touch of a
    second buffer (the copy alone was 0.045 s of a 0.57 s cold restore of 512 MiB per
    rank). Only when every array the application holds fits the checkpoint: a restore
    refused for a mismatch must leave the application's arrays untouched.
    Arrays sharing memory are read through a buffer, as is any array not C-contiguous.
    A CPU tensor is read into through a numpy view of its memory. ``values``: the
    restore's :class:`Held` of ``state`` (made here when not given).
    """
    values = Held(state, targets) if values is None else values
    into: dict[str, np.ndarray] = {}
    for name, (shape, dtype, torch_dtype) in expected.items():
        held = values(name)
        if tensors.is_tensor(held) != bool(torch_dtype) and held is not None:
            if tensors.is_tensor(held) or isinstance(held, np.ndarray):
                return {}  # a tensor for an array or the reverse: check_fits refuses it
        if tensors.is_tensor(held):
            if tensors.dtype_name(held) != torch_dtype:
                return {}  # check_fits refuses this restore: read nothing into the application
            if tensors.is_dtensor(held):
                held = tensors.local_part(held)
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
