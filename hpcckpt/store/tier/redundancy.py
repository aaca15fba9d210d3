"""Redundancy of the node-local tier across nodes: partner copies and XOR parity.

A node-local copy (:mod:`hpcckpt.store.tier.copies`) dies with its node. With
``redundancy="partner"`` or ``"xor"`` the ranks are grouped into *sets* whose members
run on distinct nodes (the failure group is the node name, never the host, so the
slurmd instances of the local cluster count as separate nodes), and each member
stores, beside its own data file, a file that lets the set rebuild any one lost member:

- ``partner``: the members form a ring; member ``i`` keeps a copy of member ``i-1``'s
  data file (``ckpt-<step>.rank<R>.partner``). Storage 2B per rank; survives the loss of
  any members that are not neighbours in the ring.
- ``xor``: each member's data file is cut into ``n-1`` chunks; member ``i`` keeps the
  parity ``P_i`` (``ckpt-<step>.rank<R>.xor``), the XOR of one chunk of every other
  member: chunk ``(i-j-1) mod n`` of member ``j``. Storage B·n/(n-1); survives the loss
  of one member per set. The parity is computed with MPI's reduce-scatter (BXOR), piece
  by piece (bounded memory), which is SCR's ring reduce-scatter; a lost member's chunk
  ``k`` is rebuilt by a reduction onto it of ``P_{L+1+k}`` and the other members' chunks.

Each member's redundancy manifest ``ckpt-<step>.rank<R>.red.json`` (written only after
every rank wrote its data *and* its redundancy) records the scheme, the set, every
member's data size and manifest, and the xxh3-64 checksum of the parity or partner
file. A rebuilt byte counts only once the rebuilt arrays verify against the checksums
of their manifest (the caller loads them with :func:`fast_tier.load`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from hpcckpt.store.comm import BXOR, Comm
from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.io import safety
from hpcckpt.store.io.direct_io import pwrite_all

SCHEMES = ("partner", "xor")
#: SCR's default XOR set size; also the ring size of partner.
DEFAULT_SET_SIZE = 8
#: Bytes per rank moved through MPI at a time (bounded memory: a few pieces per rank).
PIECE = 4 << 20
FORMAT = "hpcckpt-local-redundancy"
FORMAT_VERSION = 1


def check_scheme(scheme: str | None, set_size: int) -> None:
    """ValueError naming the fix for an unknown scheme or a set smaller than 2."""
    if scheme is not None and scheme not in SCHEMES:
        raise ValueError(f"redundancy must be 'partner', 'xor' or None, not {scheme!r}")
    if int(set_size) != set_size or set_size < 2:
        raise ValueError(
            f"redundancy_set must be an integer >= 2 (nodes per set), not {set_size!r}"
        )


def file_name(step: int, rank: int, scheme: str) -> str:
    return f"ckpt-{step:010d}.rank{rank}.{scheme}"


def manifest_name(step: int, rank: int) -> str:
    return f"ckpt-{step:010d}.rank{rank}.red.json"


def form_sets(nodes: Sequence[str], size: int) -> list[list[int]]:
    """Sets of ranks (``nodes[r]`` is rank r's node name), no two members on one node.

    Ranks are numbered within their node (0, 1, ... in rank order); ranks of the same
    number on different nodes are cut into sets of ``size`` (evenly: 10 ranks in sets
    of 8 make two sets of 5). With fewer nodes than ``size`` the sets are smaller: one
    per rank number, over every node. ValueError when a rank has no rank of the same
    number on another node (one node only, or uneven ranks per node).
    """
    order: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        order.setdefault(node, []).append(rank)
    depth = max((len(r) for r in order.values()), default=0)
    sets = []
    for k in range(depth):
        group = [ranks[k] for ranks in order.values() if len(ranks) > k]
        if len(group) < 2:
            node = nodes[group[0]]
            raise ValueError(
                f"redundancy needs every rank's set on distinct nodes, but rank {group[0]} "
                f"(rank {k + 1} on node {node!r}) has no counterpart on another node "
                f"({len(order)} node(s): {', '.join(order)}). Run the same number of ranks "
                "on at least 2 nodes, or pass redundancy=None"
            )
        nsets = -(-len(group) // size)
        while nsets > 1 and len(group) // nsets < 2:
            nsets -= 1
        base, extra = divmod(len(group), nsets)
        start = 0
        for s in range(nsets):
            n = base + (1 if s < extra else 0)
            sets.append(group[start : start + n])
            start += n
    return sets


@dataclass(frozen=True)
class SetLayout:
    """This rank's set: the scheme, the members (ranks, in ring order) and a communicator."""

    scheme: str
    sets: list[list[int]]
    members: list[int]
    comm: Comm

    @property
    def index(self) -> int:
        return self.comm.rank

    @classmethod
    def build(cls, comm: Comm, node: str, scheme: str, size: int) -> SetLayout:
        """Collective: gather the node names, form the sets, split a communicator per set."""
        nodes = comm.allgather(node)
        error = None
        sets: list[list[int]] = []
        try:
            sets = form_sets(nodes, size)
        except ValueError as exc:
            error = exc
        if error is not None:  # the same on every rank: the node list is the same
            raise error
        rank = comm.rank
        color = next(i for i, s in enumerate(sets) if rank in s)
        members = sets[color]
        sub = comm.split(color, members.index(rank))
        assert sub is not None
        return cls(scheme, sets, members, sub)


def _chunk(sizes: Sequence[int], n: int) -> int:
    """Bytes per XOR chunk: the largest data file in ``n-1`` chunks, a multiple of 8."""
    per_chunk = -(-max(sizes, default=0) // (n - 1))
    return -(-per_chunk // 8) * 8


def _read_into(fd: int, buf: np.ndarray, pos: int) -> None:
    """Fill ``buf`` from ``fd`` at ``pos``; bytes past the end of the file are zeros."""
    view = buf.view(np.uint8)
    got = os.preadv(fd, [memoryview(view)], pos) if view.size else 0
    view[got:] = 0


def encode(layout: SetLayout, data: Path, out: Path, mode: int) -> dict[str, Any]:
    """Write this rank's redundancy file for its data file; collective over the set.

    Returns what the redundancy manifest records of it: the members' data sizes, the
    chunk size (XOR), the file's size and its checksum.
    """
    comm = layout.comm
    n, me = comm.size, comm.rank
    size = os.stat(data).st_size
    sizes = comm.allgather(size)
    safety.remove_leftover(out)
    hasher = xxhash.xxh3_64()
    src = os.open(data, os.O_RDONLY)
    dst = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        if layout.scheme == "partner":
            total = sizes[(me - 1) % n]
            _ring_copy(comm, src, size, dst, total, hasher)
            chunk = 0
        else:
            chunk = _chunk(sizes, n)
            total = chunk
            _xor_encode(comm, src, dst, chunk, hasher)
        os.ftruncate(dst, total)
    finally:
        os.close(src)
        os.close(dst)
    return {"sizes": sizes, "chunk": chunk, "size": total, "checksum": hasher.intdigest()}


def _ring_copy(comm: Comm, src: int, size: int, dst: int, total: int, hasher: Any) -> None:
    """Send this rank's data file to the next member, receive the previous one's."""
    n, me = comm.size, comm.rank
    right, left = (me + 1) % n, (me - 1) % n
    sizes = comm.allgather(size)
    rounds = max(-(-s // PIECE) for s in sizes) if any(sizes) else 0
    out = np.empty(PIECE, dtype=np.uint8)
    inp = np.empty(PIECE, dtype=np.uint8)
    for j in range(rounds):
        pos = j * PIECE
        send = min(PIECE, max(0, size - pos))
        recv = min(PIECE, max(0, total - pos))
        if send:
            _read_into(src, out[:send], pos)
        comm.sendrecv_bytes(out[:send], right, inp[:recv], left, 71)
        if recv:
            pwrite_all(dst, memoryview(inp[:recv]), pos)
            hasher.update(memoryview(inp[:recv]))


def _xor_encode(comm: Comm, src: int, dst: int, chunk: int, hasher: Any) -> None:
    """Reduce-scatter (BXOR) of the members' chunks: member d gets the XOR of chunk
    ``(d-j-1) mod n`` of every other member j."""
    n, me = comm.size, comm.rank
    for off in range(0, chunk, PIECE):
        ln = min(PIECE, chunk - off)
        send = np.zeros((n, ln // 8), dtype=np.uint64)
        for d in range(n):
            if d != me:
                _read_into(src, send[d], ((d - me - 1) % n) * chunk + off)
        recv = np.empty(ln // 8, dtype=np.uint64)
        comm.reduce_scatter_block(send, recv, BXOR)
        raw = memoryview(recv.view(np.uint8))
        pwrite_all(dst, raw, off)
        hasher.update(raw)


def rebuild_xor(
    comm: Comm,
    lost: int,
    chunk: int,
    data: Path | None,
    parity: Path | None,
    parity_checksum: int | None,
    out: Path | None,
    out_size: int,
    mode: int,
) -> tuple[str | None, bool]:
    """Rebuild member ``lost``'s data file into ``out`` (on ``lost``); collective over the set.

    Survivors pass their ``data`` and ``parity`` files (and the parity's checksum); the
    lost member passes ``out`` and the size of its data file. Returns this rank's
    problem (a parity file that does not match its checksum, an unreadable file) or
    None, and whether its parity file is damaged (read whole, its checksum differs);
    the caller agrees on the outcome and verifies the rebuilt arrays.
    """
    n, me = comm.size, comm.rank
    problem = None
    damaged = False
    hasher = xxhash.xxh3_64()
    fds: dict[str, int] = {}
    try:
        if me == lost:
            assert out is not None
            safety.remove_leftover(out)
            fds["out"] = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        else:
            assert data is not None and parity is not None
            safety.check_regular_file(data)
            safety.check_regular_file(parity)
            fds["data"] = os.open(data, os.O_RDONLY)
            fds["parity"] = os.open(parity, os.O_RDONLY)
    except (OSError, CorruptCheckpoint) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    # A rank that cannot take part still joins every reduction (with zeros).
    for k in range(n - 1):
        holder = (lost + 1 + k) % n
        for off in range(0, chunk, PIECE):
            ln = min(PIECE, chunk - off)
            mine = np.zeros(ln // 8, dtype=np.uint64)
            try:
                if me == holder and "parity" in fds:
                    _read_into(fds["parity"], mine, off)
                    hasher.update(memoryview(mine.view(np.uint8)))
                elif me != lost and "data" in fds:
                    _read_into(fds["data"], mine, ((holder - me - 1) % n) * chunk + off)
            except OSError as exc:
                problem = problem or f"reading for the rebuild: {exc}"
            result = np.empty_like(mine) if me == lost else None
            comm.reduce_array(mine, result, BXOR, root=lost)
            if result is not None and "out" in fds:
                pos = k * chunk + off
                keep = max(0, min(ln, out_size - pos))
                if keep:
                    try:
                        pwrite_all(fds["out"], memoryview(result.view(np.uint8))[:keep], pos)
                    except OSError as exc:
                        problem = problem or f"writing the rebuilt data: {exc}"
        if me == holder and problem is None and parity_checksum is not None:
            if hasher.intdigest() != parity_checksum:
                name = parity.name if parity else "?"
                problem = f"parity file {name} does not match its checksum"
                damaged = True
    for fd in fds.values():
        os.close(fd)
    return problem, damaged


def send_file(comm: Comm, path: Path, dest: int, tag: int) -> None:
    """Send a file to rank ``dest`` piece by piece (size first; -1 when unreadable)."""
    try:
        safety.check_regular_file(path)
        fd = os.open(path, os.O_RDONLY)
    except (OSError, CorruptCheckpoint):
        comm.send(-1, dest=dest, tag=tag)
        return
    try:
        size = os.fstat(fd).st_size
        comm.send(size, dest=dest, tag=tag)
        buf = np.empty(min(PIECE, size), dtype=np.uint8)
        for pos in range(0, size, PIECE):
            ln = min(PIECE, size - pos)
            _read_into(fd, buf[:ln], pos)
            comm.send_bytes(buf[:ln], dest=dest, tag=tag)
    finally:
        os.close(fd)


def recv_file(
    comm: Comm, path: Path, source: int, tag: int, mode: int, hasher: Any = None
) -> str | None:
    """Receive a file sent by :func:`send_file` into ``path``; this rank's problem or None."""
    size = comm.recv(source=source, tag=tag)
    if size < 0:
        return f"rank {source} could not read its copy for rank {comm.rank}"
    problem = None
    fd = -1
    try:
        safety.remove_leftover(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except OSError as exc:
        problem = f"cannot write {path}: {exc}"
    buf = np.empty(min(PIECE, size), dtype=np.uint8)
    for pos in range(0, size, PIECE):
        ln = min(PIECE, size - pos)
        comm.recv_bytes(buf[:ln], source=source, tag=tag)
        if hasher is not None:
            hasher.update(memoryview(buf[:ln]))
        if fd >= 0 and problem is None:
            try:
                pwrite_all(fd, memoryview(buf[:ln]), pos)
            except OSError as exc:
                problem = f"cannot write {path}: {exc}"
    if fd >= 0:
        os.close(fd)
    return problem


def file_checksum(path: Path) -> int:
    """xxh3-64 of a whole file, read piece by piece."""
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while piece := fh.read(PIECE):
            hasher.update(piece)
    return hasher.intdigest()


@dataclass(frozen=True)
class RedundancyCopy:
    """One rank's sealed redundancy manifest (its parity or partner file sits beside it)."""

    path: Path
    step: int
    uid: str
    rank: int
    nranks: int
    scheme: str
    sets: list[list[int]]
    members: list[int]
    sizes: list[int]
    chunk: int
    size: int
    checksum: int
    manifests: dict[int, Any]  # member rank -> its data manifest document

    @property
    def file_path(self) -> Path:
        return self.path.with_name(file_name(self.step, self.rank, self.scheme))


def read_redundancy(path: Path, directory: Path, nranks: int) -> RedundancyCopy | None:
    """A redundancy manifest of ``directory`` by ``nranks`` ranks, or None if unusable."""
    try:
        safety.check_regular_file(path)
        with open(path, encoding="utf-8") as fh:
            doc = json.loads(fh.read(256 << 20))
        if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
            return None
        if doc["directory"] != str(directory.absolute()) or int(doc["nranks"]) != nranks:
            return None
        if doc["scheme"] not in SCHEMES:
            return None
        members = [int(r) for r in doc["members"]]
        sizes = [int(s) for s in doc["sizes"]]
        if len(sizes) != len(members) or int(doc["rank"]) not in members:
            return None
        return RedundancyCopy(
            path,
            int(doc["step"]),
            str(doc["uid"]),
            int(doc["rank"]),
            nranks,
            str(doc["scheme"]),
            [[int(r) for r in s] for s in doc["sets"]],
            members,
            sizes,
            int(doc["chunk"]),
            int(doc["size"]),
            int(doc["checksum"]),
            {int(r): m for r, m in doc["manifests"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    except CorruptCheckpoint:
        return None


def redundancy_doc(
    *,
    step: int,
    uid: str,
    rank: int,
    nranks: int,
    directory: Path,
    layout: SetLayout,
    encoded: dict[str, Any],
    manifests: Sequence[Any],
) -> dict[str, Any]:
    """The redundancy manifest of this rank (``manifests``: the set members' data manifests)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "uid": uid,
        "rank": rank,
        "nranks": nranks,
        "directory": str(directory.absolute()),
        "scheme": layout.scheme,
        "sets": layout.sets,
        "members": layout.members,
        "sizes": encoded["sizes"],
        "chunk": encoded["chunk"],
        "size": encoded["size"],
        "checksum": encoded["checksum"],
        "manifests": {str(r): m for r, m in zip(layout.members, manifests, strict=True)},
    }
