"""Restore from the node-local tier when ranks moved or nodes were lost: move, rebuild, verify.

Used when the node-local copies have redundancy (:mod:`hpcckpt.store.tier.redundancy`).
Every rank lists what its node's cache directory holds for this checkpoint directory
(data copies and redundancy files of *any* rank: after a node failure the ranks run
elsewhere), the lists are gathered, and for each node-local checkpoint newer than the
directory's newest, newest first, every rank computes the same plan:

1. *move*: a rank whose files sit on another node gets them sent over MPI, piece by
   piece, and written into its own node's directory;
2. *rebuild*: a rank whose data is nowhere gets it from its partner's copy, or from the
   XOR parity of its set (one lost member per set at most);
3. *verify*: every rank reads its arrays and checks them against the checksums of its
   manifest; only then is the manifest written beside the moved or rebuilt data.

If the plan is impossible (two members of one XOR set lost, a partner copy lost with
its owner) or any check fails, the ranks agree and try the next older node-local
checkpoint, then the directory; each skipped one comes back with the reason. A file
whose bytes do not match its checksums (a rank's copy, a partner copy, a parity file) is
set aside where it is kept (its manifest renamed ``.bad``), so no later restore tries it
again; a copy that is merely incomplete (a lost member, another rank count) stays.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from hpcckpt.store.comm import Comm
from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.tier import copies as fast_tier
from hpcckpt.store.tier import redundancy
from hpcckpt.store.tier.redundancy import RedundancyCopy

_RED = re.compile(r"^ckpt-(\d{10,})\.rank(\d+)\.red\.json$")
_TAG_DOC, _TAG_FILE = 811, 812


@dataclass
class LocalRestore:
    """What a restore from the node-local tier found (the same on every rank but ``copy``)."""

    copy: fast_tier.LocalCopy | None = None  # this rank's verified copy, sealed in its cache
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    step: int | None = None
    rebuilt: list[int] = field(default_factory=list)  # ranks whose data was rebuilt
    scheme: str | None = None  # how they were rebuilt
    moved: list[int] = field(default_factory=list)  # ranks whose files came from another node
    skipped: list[tuple[int, str]] = field(default_factory=list)
    #: Files found damaged and set aside, never tried again: (step, node, file, reason).
    set_aside: list[tuple[int, str, str, str]] = field(default_factory=list)


def inventory(cache: Path, directory: Path, nranks: int) -> list[tuple[Any, ...]]:
    """What this node's cache directory holds for ``directory``: ("data", step, uid, owner)
    and ("red", step, uid, owner, scheme, members) entries."""
    found: list[tuple[Any, ...]] = []
    for copy in fast_tier.scan_all(cache, directory, nranks):
        found.append(("data", copy.step, copy.uid, copy.rank))
    try:
        names = os.listdir(cache)
    except OSError:
        names = []
    for name in names:
        m = _RED.match(name)
        if not m:
            continue
        red = redundancy.read_redundancy(cache / name, directory, nranks)
        if red is not None and red.step == int(m.group(1)) and red.rank == int(m.group(2)):
            found.append(("red", red.step, red.uid, red.rank, red.scheme, tuple(red.members)))
    return found


@dataclass
class _Plan:
    step: int
    uid: str
    data_moves: list[tuple[int, int]]  # (owner, holder)
    red_moves: list[tuple[int, int]]
    rebuild: list[tuple[int, str, tuple[int, ...]]]  # (lost rank, scheme, set members)


def plan(held: list[list[tuple[Any, ...]]], step: int, uid: str, nranks: int) -> _Plan | str:
    """The moves and rebuilds that restore every rank's copy of (step, uid), or why not."""
    data: dict[int, list[int]] = defaultdict(list)
    red: dict[int, list[int]] = defaultdict(list)
    sets: dict[int, tuple[str, tuple[int, ...]]] = {}
    for proc, entries in enumerate(held):
        for e in entries:
            if e[1] != step or e[2] != uid:
                continue
            if e[0] == "data":
                data[e[3]].append(proc)
            else:
                red[e[3]].append(proc)
                for member in e[5]:
                    sets[member] = (e[4], e[5])

    def holder(procs: list[int], owner: int) -> int:
        return owner if owner in procs else min(procs)

    lost = [r for r in range(nranks) if not data[r]]
    rebuild = []
    for r in lost:
        if r not in sets:
            return f"rank {r}'s node-local copy is gone" + (
                " and no redundancy file of its set survives" if red else ", without redundancy"
            )
        scheme, members = sets[r]
        n, pos = len(members), members.index(r)
        if scheme == "xor":
            others = [m for m in members if m != r]
            also = [m for m in others if not data[m]]
            if also:
                return f"ranks {r} and {also[0]} of one XOR set ({list(members)}) are both lost"
            gone = [m for m in others if not red[m]]
            if gone:
                return f"rank {r} is lost and the parity of rank {gone[0]} of its set is too"
        else:
            q = members[(pos + 1) % n]
            if not red[q]:
                return f"rank {r} is lost and its partner copy (kept by rank {q}) is too"
        rebuild.append((r, scheme, members))
    data_moves = [(r, holder(data[r], r)) for r in range(nranks) if data[r]]
    red_moves = [(r, holder(red[r], r)) for r in range(nranks) if red[r]]
    return _Plan(
        step,
        uid,
        [(r, h) for r, h in data_moves if h != r],
        [(r, h) for r, h in red_moves if h != r],
        rebuild,
    )


class _Node:
    """This rank's view of its node's cache directory for one checkpoint."""

    def __init__(self, cache: Path, directory: Path, comm: Comm, mode: int) -> None:
        self.cache, self.directory, self.comm, self.mode = cache, directory, comm, mode
        self.rank, self.nranks = comm.rank, comm.size

    def data_doc(self, step: int, owner: int) -> dict[str, Any] | None:
        return _read_json(self.cache / fast_tier.manifest_name(step, owner))

    def red(self, step: int, owner: int) -> RedundancyCopy | None:
        path = self.cache / redundancy.manifest_name(step, owner)
        return redundancy.read_redundancy(path, self.directory, self.nranks)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.loads(fh.read(256 << 20))
        return doc if isinstance(doc, dict) else None
    except (OSError, ValueError, RecursionError):
        return None


def restore(
    comm: Comm, cache: Path, directory: Path, newest: int, mode: int, node: str
) -> LocalRestore:
    """Collective: this rank's verified copy of the newest node-local checkpoint newer
    than step ``newest`` that the ranks can restore (moving and rebuilding as needed)."""
    nranks = comm.size
    held = comm.allgather(inventory(cache, directory, nranks))
    found = LocalRestore()
    candidates = sorted({(e[1], e[2]) for entries in held for e in entries if e[1] > newest})
    for step, uid in reversed(candidates):
        p = plan(held, step, uid, nranks)
        if isinstance(p, str):
            found.skipped.append((step, p))
            continue
        why = _execute(_Node(cache, directory, comm, mode), p, found, node)
        if why is None:
            return found
        found.skipped.append((step, why))
        found.rebuilt, found.moved, found.scheme = [], [], None
    return found


def _execute(at: _Node, p: _Plan, found: LocalRestore, node: str) -> str | None:
    """Run plan ``p`` (collective); None on success (``found`` filled), else why not."""
    comm, me, step = at.comm, at.rank, p.step
    problem: str | None = None
    doc: dict[str, Any] | None = None
    seal = False
    # 1. moves, in the same global order on every rank (pairs only: no deadlock)
    for owner, holder in p.data_moves:
        if me == holder:
            comm.send(at.data_doc(step, owner), dest=owner, tag=_TAG_DOC)
            redundancy.send_file(
                comm, at.cache / fast_tier.data_name(step, owner), owner, _TAG_FILE
            )
        elif me == owner:
            doc = comm.recv(source=holder, tag=_TAG_DOC)
            path = at.cache / fast_tier.data_name(step, owner)
            problem = redundancy.recv_file(comm, path, holder, _TAG_FILE, at.mode) or problem
            seal = True
    for owner, holder in p.red_moves:
        if me == holder:
            comm.send(_read_json(at.cache / redundancy.manifest_name(step, owner)), owner, _TAG_DOC)
            red = at.red(step, owner)
            src = red.file_path if red else at.cache / "missing"
            redundancy.send_file(comm, src, owner, _TAG_FILE)
        elif me == owner:
            rdoc = comm.recv(source=holder, tag=_TAG_DOC)
            scheme = str((rdoc or {}).get("scheme", "xor"))
            path = at.cache / redundancy.file_name(step, owner, scheme)
            why = redundancy.recv_file(comm, path, holder, _TAG_FILE, at.mode)
            if why is None and rdoc is not None:
                try:
                    fast_tier.write_manifest(
                        at.cache / redundancy.manifest_name(step, owner), rdoc, at.mode
                    )
                except OSError as exc:
                    why = f"cannot write its redundancy manifest: {exc}"
            problem = problem or why
    if doc is None and not any(r == me for r, _, _ in p.rebuild):
        doc = at.data_doc(step, me)
    # 2. rebuilds
    lost_here = next((x for x in p.rebuild if me in x[2]), None)
    color = p.rebuild.index(lost_here) if lost_here else None
    sub = comm.split(color, lost_here[2].index(me) if lost_here else 0)
    damaged: list[tuple[str, int, str]] = []  # (kind, owner, why): files this rank found bad
    if lost_here is not None:
        lost, scheme, members = lost_here
        why, rebuilt_doc, bad = _rebuild(at, sub, step, lost, scheme, members)
        problem = problem or why
        damaged += bad
        if me == lost:
            doc, seal = rebuilt_doc, True
        sub.free()
    # 3. verify every rank's copy
    copy = None
    try:
        if problem is None:
            if doc is None:
                raise ValueError(f"rank {me}: no manifest for its copy")
            copy = fast_tier.parse_manifest(at.cache / fast_tier.manifest_name(step, me), doc)
            if copy is None or (copy.step, copy.uid, copy.rank) != (step, p.uid, me):
                raise ValueError(f"rank {me}: its manifest does not describe its copy")
            try:
                found.arrays = fast_tier.load(copy)
            except (CorruptCheckpoint, ValueError) as exc:
                # its bytes do not match its checksums: damaged where it was kept (a
                # rebuilt copy is not: the files it was rebuilt from are to blame)
                if not any(r == me for r, _, _ in p.rebuild):
                    damaged.append(("data", me, str(exc)))
                raise
    except (CorruptCheckpoint, OSError, ValueError) as exc:
        problem = f"rank {me}: {exc}"
    outcome = comm.allgather((problem, damaged))
    problems = list(dict.fromkeys(x for x, _ in outcome if x))
    if problems:
        found.arrays = {}
        bad = [d for _, ds in outcome for d in ds]
        if bad:
            found.set_aside += _set_aside(at, p, bad, node)
        return "; ".join(problems[:4])
    assert copy is not None and doc is not None
    if seal:
        fast_tier.write_manifest(
            copy.path, {**doc, "node": node, "host": fast_tier.host()}, at.mode
        )
        copy = fast_tier.read_manifest(copy.path) or copy
    found.copy, found.step = copy, step
    found.moved = sorted({r for r, _ in p.data_moves})
    found.rebuilt = [r for r, _, _ in p.rebuild]
    found.scheme = p.rebuild[0][1] if p.rebuild else None
    return None


def _set_aside(
    at: _Node, p: _Plan, damaged: list[tuple[str, int, str]], node: str
) -> list[tuple[int, str, str, str]]:
    """Set aside the files the ranks found damaged (collective): the rank that kept each
    one renames its manifest, and so does the owner of a redundancy file moved to it.
    Returns (step, node, file, reason) of every file set aside, on every rank."""
    mine = []
    data_holder, red_holder = dict(p.data_moves), dict(p.red_moves)
    for kind, owner, why in dict.fromkeys(damaged):
        if kind == "data":
            keepers = {data_holder.get(owner, owner)}
            name = fast_tier.manifest_name(p.step, owner)
        else:
            keepers = {red_holder.get(owner, owner), owner}
            name = redundancy.manifest_name(p.step, owner)
        if at.rank in keepers and fast_tier.set_aside_file(at.cache / name):
            mine.append((p.step, node, name, why))
    return [x for xs in at.comm.allgather(mine) for x in xs]


def _rebuild(
    at: _Node, sub: Comm, step: int, lost: int, scheme: str, members: tuple[int, ...]
) -> tuple[str | None, dict[str, Any] | None, list[tuple[str, int, str]]]:
    """Rebuild ``lost``'s data file (collective over its set); (problem, its manifest, the
    redundancy files found damaged as (kind, owner, why))."""
    me, n = at.rank, len(members)
    pos = members.index(lost)
    source = members[(pos + 1) % n]  # keeps lost's partner copy; any survivor for XOR
    red = at.red(step, me) if me != lost else None
    info = None
    if me == source and red is not None:
        info = (red.manifests.get(lost), red.sizes[pos], red.chunk, red.checksum)
    info = sub.bcast(info, root=members.index(source))
    if info is None:
        problem = f"rank {source} cannot read its redundancy manifest of step {step}"
        return problem, None, []
    doc, size, chunk, checksum = info
    out = at.cache / fast_tier.data_name(step, lost)
    if scheme == "partner":
        if me == source:
            redundancy.send_file(sub, red.file_path, members.index(lost), _TAG_FILE)
        elif me == lost:
            hasher = xxhash.xxh3_64()
            why = redundancy.recv_file(sub, out, members.index(source), _TAG_FILE, at.mode, hasher)
            if why is None and hasher.intdigest() != checksum:
                why = (
                    f"the partner copy of rank {lost} kept by rank {source} "
                    "does not match its checksum"
                )
                return why, doc, [("red", source, why)]
            return why, doc, []
        return None, None, []
    data = at.cache / fast_tier.data_name(step, me)
    why, parity_bad = redundancy.rebuild_xor(
        sub,
        members.index(lost),
        chunk,
        data if me != lost else None,
        red.file_path if red is not None else None,
        red.checksum if red is not None else None,
        out if me == lost else None,
        size,
        at.mode,
    )
    if me != lost and red is None:
        why = why or f"rank {me} cannot read its redundancy manifest of step {step}"
    bad = [("red", me, f"rank {me}: {why}")] if parity_bad and why else []
    return why, doc if me == lost else None, bad
