"""Node-local copies of a rank's state: the fast tier a save returns after.

With ``Checkpointer(cache=PATH)`` each rank first writes its arrays to
``PATH/ckpt-<step>.rank<R>.data`` (on ``/dev/shm`` or a node-local NVMe) and the
checkpoint is then drained to the parallel file system in the background. Once every
rank has its data file, each rank writes its manifest ``ckpt-<step>.rank<R>.json``
(atomically: temporary name, then rename): the step, the save's uid, the rank, the
rank count, the host, the checkpoint directory it belongs to, the state tree and per
array its dtype, shape, offset in the data file and checksum (xxh3-64 of its block
hashes, as in the HDF5 file). A copy counts only when every rank of the same host
layout holds a manifest of the same uid and its data verifies.

No fsync: a node-local copy is there to survive the *process* (a crash, a kill, a
requeue onto the same nodes), whose written pages stay in the node's page cache; it
does not survive the node, and nothing here assumes it does. Per-rank only: no MPI.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.file import layout
from hpcckpt.store.io import blocks, safety
from hpcckpt.store.io.direct_io import pwrite_all
from hpcckpt.store.io.durability import atomic_write, rename
from hpcckpt.store.tree import checks as tree_check
from hpcckpt.store.tree.state_tree import ARRAY_KINDS

FORMAT = "hpcckpt-local"
#: 2: manifests name the replicated arrays (rank 0's copy only; the others hold stand-ins).
FORMAT_VERSION = 2
_NAME = re.compile(r"^ckpt-(\d{10,})\.rank(\d+)\.json$")
#: Every file of a rank's copy: data, manifest, and the redundancy files (.redundancy).
_FILES = re.compile(r"^ckpt-(\d{10,})\.rank(\d+)\.(json|data|xor|partner|red\.json)(\.tmp|\.bad)?$")
#: Each array starts at a multiple of this in the data file (page-aligned for the drain).
ALIGN = 4096


def data_name(step: int, rank: int) -> str:
    return f"ckpt-{step:010d}.rank{rank}.data"


def manifest_name(step: int, rank: int) -> str:
    return f"ckpt-{step:010d}.rank{rank}.json"


def host() -> str:
    return socket.gethostname()


def node_path(cache: str, node: str) -> str:
    """``cache`` with ``%n`` replaced by the node's name (``%%`` is a literal ``%``), so
    that nodes sharing a file system (or one machine) get directories of their own."""
    return re.sub(r"%[n%]", lambda m: node if m.group(0) == "%n" else "%", cache)


@dataclass(frozen=True)
class LocalCopy:
    """One rank's manifest of a node-local copy (the data file sits beside it)."""

    path: Path  # the manifest
    step: int
    uid: str
    rank: int
    nranks: int
    host: str
    directory: str
    block_size: int
    tree: Any
    arrays: dict[str, dict[str, Any]]  # path -> {dtype, shape, offset, checksum}
    node: str = ""  # the node name (a Slurm node name; the host outside Slurm)
    replicated: tuple[str, ...] = ()  # arrays whose value is rank 0's copy

    @property
    def data_path(self) -> Path:
        return self.path.with_name(data_name(self.step, self.rank))


def check_cache_dir(cache: Path, directory: Path) -> None:
    """ValueError when the cache would hold the checkpoints themselves."""
    if cache.resolve() == directory.resolve():
        raise ValueError(
            f"cache={str(cache)!r} is the checkpoint directory itself: give a node-local "
            "path such as /dev/shm/$SLURM_JOB_ID or a directory on a local NVMe"
        )


def write_data(
    cache: Path,
    step: int,
    rank: int,
    arrays: dict[str, np.ndarray],
    block_size: int,
    mode: int,
    *,
    hashed: bool = True,
    reuse: bool = False,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, int]]:
    """Write this rank's arrays to its data file; (read-only maps of them, block hashes, offsets).

    Each block is hashed just before it is written, while in cache; without ``hashed``
    the arrays are written whole and nothing is hashed (empty hashes: the caller hashes
    the maps later, before it seals). With ``reuse`` the data file of ``step`` is
    already there (:func:`recycle`): it is written over in place, its pages reused.
    The maps are what the background drain writes from.
    """
    path = cache / data_name(step, rank)
    flags = os.O_WRONLY | os.O_NOFOLLOW
    if reuse and _regular(path):
        fd = os.open(path, flags)
        os.fchmod(fd, mode)
    else:
        safety.remove_leftover(path)
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
    offsets, hashes = {}, {}
    try:
        pos = 0
        digest = xxhash.xxh3_64_intdigest
        for name, src in arrays.items():
            offsets[name] = pos
            flat = np.ascontiguousarray(src).reshape(-1)
            if not hashed:
                if flat.size:
                    pwrite_all(fd, memoryview(flat).cast("B"), pos)
                pos += -(-src.nbytes // ALIGN) * ALIGN
                continue
            step_elems = blocks.block_elems(src.dtype.itemsize, block_size)
            n = blocks.nblocks(flat.size, step_elems)
            out = np.empty(n, dtype=np.uint64)
            for j in range(n):
                raw = memoryview(flat[j * step_elems : (j + 1) * step_elems]).cast("B")
                out[j] = digest(raw)
                pwrite_all(fd, raw, pos + j * step_elems * src.dtype.itemsize)
            hashes[name] = out
            pos += -(-src.nbytes // ALIGN) * ALIGN
        os.ftruncate(fd, pos)
    finally:
        os.close(fd)
    specs = {n: (a.dtype, tuple(a.shape)) for n, a in arrays.items()}
    return _map(path, specs, offsets), hashes, offsets


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def recycle(cache: Path, rank: int, step: int) -> bool:
    """Make this rank's newest data file of another step the data file of ``step``, so
    that writing ``step`` reuses its pages instead of allocating new ones (on tmpfs,
    about as long as the copy itself). Its manifests go first: the copy it held never
    counts again. Whether a file was recycled (False: none, or a link, left alone).

    Only for a copy the directory holds durably: the copy it was is gone once this returns.
    """
    try:
        names = os.listdir(cache)
    except OSError:
        return False
    found = []
    for name in names:
        m = _FILES.match(name)
        if m and int(m.group(2)) == rank and m.group(3) == "data" and m.group(4) is None:
            found.append((int(m.group(1)), name))
    found = [(s, n) for s, n in found if s != step and _regular(cache / n)]
    if not found:
        return False
    old, name = max(found)
    for gone in (manifest_name(old, rank), manifest_name(step, rank)):
        safety.remove_leftover(cache / gone)
    rename(cache / name, cache / data_name(step, rank), durable=False)  # the tier never fsyncs
    return True


def maps(copy: LocalCopy) -> dict[str, np.ndarray]:
    """Read-only maps of a (verified) copy's arrays: what a drain of it writes from."""
    specs = {n: (i["dtype"], i["shape"]) for n, i in copy.arrays.items()}
    return _map(copy.data_path, specs, {n: i["offset"] for n, i in copy.arrays.items()})


def _map(
    path: Path, specs: dict[str, tuple[np.dtype, tuple[int, ...]]], offsets: dict[str, int]
) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, (dtype, shape) in specs.items():
        if int(np.prod(shape, dtype=np.int64)) == 0:
            out[name] = np.empty(shape, dtype=dtype)
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=offsets[name], shape=shape)
    return out


def seal(cache: Path, *, mode: int, **fields: Any) -> Path:
    """Write this rank's manifest atomically: from now on the copy can be restored.

    ``fields`` are those of :func:`manifest_doc` (step, uid, rank, nranks, directory,
    block_size, tree, arrays, hashes, offsets, node, replicated).
    """
    doc = manifest_doc(**fields)
    return write_manifest(cache / manifest_name(doc["step"], doc["rank"]), doc, mode)


def manifest_doc(
    *,
    step: int,
    uid: str,
    rank: int,
    nranks: int,
    directory: Path,
    block_size: int,
    tree: Any,
    arrays: dict[str, np.ndarray],
    hashes: dict[str, np.ndarray],
    offsets: dict[str, int],
    node: str | None = None,
    replicated: Any = (),
) -> dict[str, Any]:
    """The manifest of one rank's copy as a JSON-ready dict (see :func:`seal`)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "uid": uid,
        "rank": rank,
        "nranks": nranks,
        "host": host(),
        "node": node or host(),
        "directory": str(directory.absolute()),
        "block_size": block_size,
        "tree": tree,
        "replicated": sorted(replicated),
        "arrays": {
            name: {
                "dtype": a.dtype.str,
                "shape": list(a.shape),
                "offset": offsets[name],
                "checksum": blocks.hashes_checksum(hashes[name]),
            }
            for name, a in arrays.items()
        },
    }


def write_manifest(path: Path, doc: dict[str, Any], mode: int) -> Path:
    """Write a manifest document atomically (temporary name, then rename; no fsync: see
    the module's docs)."""
    atomic_write(
        path, json.dumps(doc, allow_nan=True), mode=mode, durable=False, temp=path.name + ".tmp"
    )
    return path


def scan(cache: Path, directory: Path, rank: int, nranks: int) -> list[LocalCopy]:
    """This rank's sealed copies for ``directory`` made by ``nranks`` ranks on this host,
    newest first. Unreadable or foreign manifests are ignored."""
    found = []
    try:
        names = os.listdir(cache)
    except OSError:
        return []
    me = host()
    for name in names:
        m = _NAME.match(name)
        if not m or int(m.group(2)) != rank:
            continue
        copy = read_manifest(cache / name)
        if (
            copy is not None
            and copy.rank == rank
            and copy.nranks == nranks
            and copy.host == me
            and copy.directory == str(directory.absolute())
            and copy.step == int(m.group(1))
        ):
            found.append(copy)
    return sorted(found, key=lambda c: c.step, reverse=True)


def read_manifest(path: Path) -> LocalCopy | None:
    try:
        safety.check_regular_file(path)
        with open(path, encoding="utf-8") as fh:
            doc = json.loads(fh.read(64 << 20))
    except (OSError, ValueError, RecursionError):
        return None
    except CorruptCheckpoint:  # a link or a FIFO where the manifest should be
        return None
    return parse_manifest(path, doc)


def parse_manifest(path: Path, doc: Any) -> LocalCopy | None:
    """A manifest document (as read from ``path``) checked field by field; None if unusable."""
    try:
        if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
            return None
        tree_check.check_tree(doc["tree"])
        arrays = {}
        for name, info in doc["arrays"].items():
            dtype = np.dtype(str(info["dtype"]))
            if dtype.kind not in ARRAY_KINDS or dtype.hasobject:
                return None
            shape = tuple(int(x) for x in info["shape"])
            if any(x < 0 for x in shape) or int(info["offset"]) < 0:
                return None
            arrays[str(name)] = {
                "dtype": dtype,
                "shape": shape,
                "offset": int(info["offset"]),
                "checksum": int(info["checksum"]),
            }
        return LocalCopy(
            path,
            int(doc["step"]),
            str(doc["uid"]),
            int(doc["rank"]),
            int(doc["nranks"]),
            str(doc["host"]),
            str(doc["directory"]),
            blocks.check_block_size(int(doc["block_size"])),
            doc["tree"],
            arrays,
            node=str(doc.get("node") or doc["host"]),
            replicated=tuple(str(n) for n in doc.get("replicated", []) if str(n) in arrays),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    except CorruptCheckpoint:
        return None


def scan_all(cache: Path, directory: Path, nranks: int) -> list[LocalCopy]:
    """Every sealed copy in ``cache`` for ``directory`` made by ``nranks`` ranks, whatever
    rank or host wrote it (ranks move between nodes after a failure)."""
    try:
        names = os.listdir(cache)
    except OSError:
        return []
    found = []
    for name in names:
        m = _NAME.match(name)
        if not m:
            continue
        copy = read_manifest(cache / name)
        if (
            copy is not None
            and copy.rank == int(m.group(2))
            and copy.nranks == nranks
            and copy.directory == str(directory.absolute())
            and copy.step == int(m.group(1))
        ):
            found.append(copy)
    return found


def load(copy: LocalCopy) -> dict[str, np.ndarray]:
    """Read and verify this rank's arrays of ``copy``; ValueError naming what is wrong."""
    path = copy.data_path
    safety.check_regular_file(path)
    size = os.stat(path).st_size
    out = {}
    with open(path, "rb") as fh:
        for name, info in copy.arrays.items():
            dtype, shape = info["dtype"], info["shape"]
            count = int(np.prod(shape, dtype=np.int64))
            end = info["offset"] + count * dtype.itemsize
            if end > size:
                raise ValueError(f"{path.name}: array {name!r} runs past the end of the file")
            fh.seek(info["offset"])
            arr = np.fromfile(fh, dtype=dtype, count=count).reshape(shape)
            got = blocks.hashes_checksum(blocks.block_hashes(arr, copy.block_size))
            if got != info["checksum"]:
                raise ValueError(f"{path.name}: array {name!r} does not match its checksum")
            out[name] = arr
    return out


def remove(
    cache: Path,
    rank: int,
    keep: int | None = None,
    nranks: int | None = None,
    every_rank: bool = False,
) -> None:
    """Delete this rank's copies (manifest first, so a half-deleted one never counts),
    except step ``keep``; with ``nranks``, also those of ranks this run does not have
    (left by a run with more ranks); with ``every_rank``, those of every rank (ranks
    that ran on this node before a relaunch moved them)."""
    try:
        names = os.listdir(cache)
    except OSError:
        return
    pattern = _FILES
    for name in sorted(names, key=lambda n: not n.endswith(".json")):
        m = pattern.match(name)
        owner = int(m.group(2)) if m else -1
        gone = (nranks is not None and owner >= nranks) or (every_rank and owner >= 0)
        if m and (owner == rank or gone) and int(m.group(1)) != keep:
            safety.remove_leftover(cache / name)


def set_aside_file(manifest: Path) -> bool:
    """Rename a node-local manifest found damaged (:func:`.file.layout.set_aside_name`); whether
    this call did (False: it was gone already)."""
    try:
        rename(manifest, manifest.with_name(layout.set_aside_name(manifest.name)), durable=False)
    except OSError:
        return False
    return True
