"""Show that two hpcckpt versions write the same checkpoint files, object by object.

A refactoring of the store must not change what it writes. This program saves one
representative state twice (a full checkpoint at step 0, an incremental one at step 1)
with whichever ``hpcckpt`` is first on ``sys.path``, and compares two such directories:

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONPATH=OLD_TREE \\
        mpirun -n 2 --oversubscribe .venv/bin/python scripts/compare_checkpoints.py save A
    (the same with PYTHONPATH=NEW_TREE ... save B)
    .venv/bin/python scripts/compare_checkpoints.py compare A B

(Run it from outside a source tree: Python puts the working directory first on
``sys.path``, before ``PYTHONPATH``. ``save`` prints the ``hpcckpt`` it imported.)

``save`` seeds every generator, so two runs with the same rank count write the same
values: numpy arrays of every numeric kind and byte order, a distributed array, a
replicated one, a non-contiguous view, empty and 0-d arrays, arrays whose shapes differ
across ranks, Python and numpy scalars, nested dicts, lists and tuples, non-str keys,
numpy generators and the global random states; with torch, a small model and its AdamW
after one step, replicated, and a bfloat16 tensor. Step 1 changes a few blocks and
must come out incremental (``/meta`` ``kind``), else ``save`` fails. ``--staging async`` or
``cache`` saves through the staged (asynchronous) paths instead.

``compare`` walks both files of each step: the file (size, mode, superblock bounds),
every link, group and dataset (object header, type, shape, layout, chunks, filters,
fill, address in the file, bytes) and every attribute (type, shape, value; JSON text
compared as parsed JSON). Then it accounts for every byte that differs between the two
files: inside an ignored value, an object header's timestamps, or a metadata checksum
over them (HDF5's lookup3, recomputed). Last, the directory's entries (kind, mode) and
its JSON files (events, status, heartbeats) as parsed JSON. It prints every difference
and exits 1 if any is not ignored. Ignored are only the values that differ between two
runs of the same code (``IGNORED``, ``CHAIN_UIDS``, ``VERSION``, ``HEADER_TIMES``,
``MEASURED``), each with its reason.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: /meta attributes that legitimately differ between two runs of the same code.
IGNORED = {
    "time": "wall-clock seconds when the save began (rank 0's clock)",
    "uid": "a random id (uuid4) of each file, so a chain tells files of one step apart",
    "parent_uid": "the parent file's random uid",
    "base_uid": "the base file's random uid",
}
#: /meta attributes holding JSON with uids inside: [name, step, uid] per file of the chain.
CHAIN_UIDS = {"chain": "the chain's files as [name, step, uid]: the uid is random"}
#: Ignored only when the two differ (two trees can carry different version strings).
VERSION = "hpcckpt_version"
#: Keys of the directory's JSON files (events.jsonl, hpcckpt-status.json, heartbeat/)
#: that legitimately differ between two runs: clocks, process ids and measured costs.
MEASURED = {
    "time": "wall-clock seconds of the event or record",
    "pid": "the process id of rank 0",
    "seconds": "a save's measured duration",
    "blocked_seconds": "a staged save's measured blocking time",
    "cost_estimate": "the schedule's estimate, from the measured durations",
    "peak_rss": "measured peak memory of rank 0",
    "pages_written": "kernel change detection: the pages of a change depend on where the "
    "arrays lie in memory (compared under --detection hashes)",
    "bytes_hashed": "kernel change detection: the blocks of those pages re-hashed",
}
#: The timestamps HDF5 puts in the object headers of the groups it creates.
HEADER_TIMES = "object header times"
#: Why each ignored key may differ, as ``compare`` prints it.
WHY = {
    **{f"/meta@{k}": v for k, v in IGNORED.items()},
    **{f"the uids in /meta@{k}": v for k, v in CHAIN_UIDS.items()},
    f"/meta@{VERSION}": "the version string of each tree (ignored only where they differ)",
    HEADER_TIMES: "HDF5's access/modification/change/birth times of a group: wall clock",
    **{f"JSON files: {k}": v for k, v in MEASURED.items()},
}

BLOCK = 4096  # small blocks: an incremental file of a small state holds several


# ---------------------------------------------------------------------------- save


def build_state(rank: int, nranks: int, torch: Any) -> dict[str, Any]:
    """The state every rank saves at step 0, the same on every run with this rank count."""
    random.seed(1000 + rank)
    np.random.seed(2000 + rank)
    rng = np.random.default_rng(3000 + rank)
    dtypes = [
        "bool", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8",
        "f2", "f4", "f8", "c8", "c16", ">f8", ">i4", ">c16",
    ]  # fmt: skip
    kinds = {}
    for dt in dtypes:
        a = rng.integers(0, 100, size=(700, 3)) + rank
        kinds[np.dtype(dt).str.replace("|", "").replace("<", "le_").replace(">", "be_")] = (
            a.astype(dt) if dt != "bool" else (a % 2).astype(bool)
        )
    rows = 4096 // nranks  # the global field's rows, split over the ranks
    u = rng.standard_normal((rows, 64)) + rank
    base = rng.standard_normal((64, 96)).astype(np.float32)
    shared = np.linspace(0.0, 1.0, 20000)  # the same on every rank
    state: dict[str, Any] = {
        "fields": {"u": u, "v": rng.standard_normal((rows, 8)).astype(np.float32)},
        "shared": {"table": shared, "ids": np.arange(300, dtype=np.int64)},
        "dtypes": kinds,
        "strided": base[:, ::3],  # a non-contiguous view
        "transposed": base.T,
        "empty": np.zeros((0, 5), dtype=np.float64),
        "empty_1d": np.array([], dtype=np.int32),
        "zero_d": np.array(3.25 + rank),
        "ragged": np.arange(2 * (3 + rank), dtype=np.int16).reshape(2, 3 + rank),
        "scalars": {
            "int": 7 + rank,
            "big": 3**5000,
            "float": 0.1 * (rank + 1),
            "bool": True,
            "none": None,
            "str": f"rank {rank} of {nranks}",
            "bytes": b"\x00\x01hpcckpt",
            "complex": complex(1.5, -rank),
            "np_f4": np.float32(2.5),
            "np_i8": np.int64(-9),
            "np_c16": np.complex128(1 - 2j),
            "np_bool": np.bool_(False),
        },
        "nested": {
            "list": [1, [2.0, {"deep": np.arange(5, dtype=np.uint16)}], "x"],
            "tuple": (1, "two", (3.0, None)),
            "int_keys": {0: "zero", 1: np.ones(3, dtype=np.float32), 2.5: [True]},
            "empty_dict": {},
            "empty_list": [],
            "odd/key.name": np.arange(4, dtype=np.int8),
        },
        "rng": {
            "generator": np.random.default_rng(4000 + rank),
            "randomstate": np.random.RandomState(5000 + rank),
        },
        "step_counter": 0,
    }
    if torch is not None:
        torch.manual_seed(6000)  # the same model on every rank: it is replicated
        torch.set_num_threads(1)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(32, 16)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        state["model"] = model
        state["optim"] = opt
        torch.manual_seed(7000 + rank)
        state["tensors"] = {
            "bf16": torch.randn(300, 10).to(torch.bfloat16),
            "f32": torch.randn(50, 7),
            "i64": torch.arange(12).reshape(3, 4) + rank,
        }
    from hpcckpt.training import RNGState

    state["global_rng"] = RNGState()
    return state


def change_a_few_blocks(state: dict[str, Any], rank: int, torch: Any) -> None:
    """What a step between the two saves changes: a few blocks, a few values."""
    state["fields"]["u"][5, :] += 1.0  # one block of the distributed field
    state["fields"]["u"][-1, 3] = -rank
    state["dtypes"]["le_i4"][100:110, :] = 42
    state["shared"]["table"][1000] = 0.5  # the same on every rank, as replicated needs
    state["strided"][0, 0] = 9.0
    state["scalars"]["int"] += 1
    state["step_counter"] = 1
    state["nested"]["list"][1][1]["deep"][0] = 99
    state["rng"]["generator"].random(10)
    random.random()
    np.random.random(3)
    if torch is not None:
        with torch.no_grad():
            state["model"][0].weight[3, :] += 0.5
        state["tensors"]["bf16"][7] = 1.0
        torch.rand(2)


def save(directory: Path, detection: str, use_torch: bool, staging: str) -> None:
    """Write ckpt-0 (full) and ckpt-1 (incremental) of :func:`build_state` into ``directory``.

    ``staging``: ``sync`` saves synchronously; ``async`` stages the arrays in host buffers
    (``async_save=True``); ``cache`` stages them in a node-local directory in /dev/shm
    (``cache=``), as the staged saves' code paths write the file.
    """
    from mpi4py import MPI

    import hpcckpt

    torch = None
    if use_torch:
        try:
            import torch
        except ImportError:
            torch = None
    comm = MPI.COMM_WORLD
    rank, nranks = comm.Get_rank(), comm.Get_size()
    if directory.exists() and any(directory.iterdir()):  # every rank sees it: all stop
        raise SystemExit(f"{directory} is not empty: give a new directory")
    if rank == 0:
        print(f"hpcckpt {hpcckpt.__version__} from {Path(hpcckpt.__file__).parent}")
        print(f"{nranks} ranks, torch {'no' if torch is None else torch.__version__}")
    replicated = ["shared", *(["model", "optim"] if torch is not None else [])]
    staged: dict[str, Any] = {
        "sync": {},
        "async": {"async_save": True},
        "cache": {"cache": f"/dev/shm/{directory.name}-cache"},
    }[staging]
    ck = hpcckpt.Checkpointer(
        directory,
        comm,
        every_steps=1,
        keep_last=None,
        distributed=["fields/u", "fields/v"],
        replicated=replicated,
        block_size=BLOCK,
        min_delta_saving=0,
        change_detection=detection,
        **staged,
    )
    state = build_state(rank, nranks, torch)
    ck.save(0, state)
    ck.wait()  # a staged save is committed here; a synchronous one already was
    change_a_few_blocks(state, rank, torch)
    ck.save(1, state)
    ck.wait()
    ck.finish()
    if rank == 0:
        import h5py

        for step, want in ((0, "full"), (1, "incremental")):
            path = directory / f"ckpt-{step:010d}.h5"
            with h5py.File(path, "r") as f:
                kind = f["meta"].attrs["kind"]
                kind = kind.decode() if isinstance(kind, bytes) else kind
                dirty = f["meta"].attrs["dirty_blocks"]
                total = f["meta"].attrs["total_blocks"]
            print(f"{path.name}: kind={kind}, {dirty} of {total} blocks")
            if kind != want:
                print(f"{path.name} is {kind}, not {want}", file=sys.stderr)
                comm.Abort(1)


# ---------------------------------------------------------------------------- compare


class Report:
    """The differences found, and the ignored ones by key, with where they are."""

    def __init__(self) -> None:
        self.diffs: list[str] = []
        self.ignored: dict[str, list[str]] = {}

    def diff(self, where: str, what: str, a: Any, b: Any) -> None:
        self.diffs.append(f"{where}: {what} differs: {_short(a)} != {_short(b)}")

    def ignore(self, key: str, where: str, a: Any, b: Any) -> None:
        self.ignored.setdefault(key, []).append(f"{where}: {_short(a)} != {_short(b)}")


def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _text(value: Any) -> Any:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def _as_json(value: Any) -> Any:
    """The parsed JSON of a str attribute that holds a JSON list or object, else None."""
    value = _text(value)
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except ValueError:
            return None
    return None


def _json_diffs(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two parsed JSON values differ, as JSON-pointer-like paths."""
    if type(a) is not type(b):
        return [f"{path or '/'}: {_short(a, 80)} != {_short(b, 80)}"]
    if isinstance(a, dict):
        out = [f"{path}/{k}: only in {'A' if k in a else 'B'}" for k in sorted(a.keys() ^ b.keys())]
        for k in a.keys() & b.keys():
            out += _json_diffs(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list):
        out = [] if len(a) == len(b) else [f"{path}: length {len(a)} != {len(b)}"]
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            out += _json_diffs(x, y, f"{path}/{i}")
        return out
    same = a == b or (isinstance(a, float) and a != a and b != b)  # NaN == NaN here
    return [] if same else [f"{path or '/'}: {_short(a, 80)} != {_short(b, 80)}"]


def _type_info(tid: Any) -> dict[str, Any]:
    """An HDF5 datatype's description beyond numpy's dtype (string size, padding, charset)."""
    import h5py

    info: dict[str, Any] = {"class": tid.get_class(), "size": tid.get_size()}
    if isinstance(tid, h5py.h5t.TypeStringID):
        info.update(vlen=tid.is_variable_str(), cset=tid.get_cset(), strpad=tid.get_strpad())
    if isinstance(tid, h5py.h5t.TypeAtomicID):
        info["order"] = tid.get_order()
    return info


def _compare_header(where: str, a: Any, b: Any, rep: Report) -> None:
    """The object headers: address, messages, space, attribute count; times are ignored."""
    import h5py

    ia, ib = h5py.h5o.get_info(a.id), h5py.h5o.get_info(b.id)
    for what, fn in (
        ("address", lambda i: i.addr),
        ("object type", lambda i: i.type),
        ("reference count", lambda i: i.rc),
        ("attribute count", lambda i: i.num_attrs),
        ("header version", lambda i: i.hdr.version),
        ("header messages", lambda i: i.hdr.nmesgs),
        ("header chunks", lambda i: i.hdr.nchunks),
        ("header flags", lambda i: i.hdr.flags),
        ("header space", lambda i: (i.hdr.space.total, i.hdr.space.meta, i.hdr.space.free)),
    ):
        if fn(ia) != fn(ib):
            rep.diff(where, f"object header {what}", fn(ia), fn(ib))
    ta = (ia.atime, ia.mtime, ia.ctime, ia.btime)
    tb = (ib.atime, ib.mtime, ib.ctime, ib.btime)
    if ta != tb:
        rep.ignore(HEADER_TIMES, where, ta, tb)


def _compare_attrs(where: str, a: Any, b: Any, rep: Report, meta: bool) -> None:
    names_a, names_b = list(a.attrs), list(b.attrs)
    if names_a != names_b:
        rep.diff(where, "attribute names (in order)", names_a, names_b)
    for name in [n for n in names_a if n in set(names_b)]:
        at = f"{where}@{name}"
        ida, idb = a.attrs.get_id(name), b.attrs.get_id(name)
        if _type_info(ida.get_type()) != _type_info(idb.get_type()):
            rep.diff(at, "HDF5 type", _type_info(ida.get_type()), _type_info(idb.get_type()))
        if ida.shape != idb.shape:
            rep.diff(at, "shape", ida.shape, idb.shape)
        va, vb = a.attrs[name], b.attrs[name]
        if isinstance(va, np.ndarray) or isinstance(vb, np.ndarray):
            va, vb = np.asarray(va), np.asarray(vb)
            if va.dtype != vb.dtype or va.shape != vb.shape or va.tobytes() != vb.tobytes():
                rep.diff(at, "value", va, vb)
            continue
        if meta and (name in IGNORED or (name == VERSION and va != vb)):
            if va != vb:
                rep.ignore(f"/meta@{name}", at, va, vb)
            continue
        ja, jb = _as_json(va), _as_json(vb)
        if ja is not None and jb is not None:
            if meta and name in CHAIN_UIDS:
                if ja != jb:
                    rep.ignore(f"the uids in /meta@{name}", at, ja, jb)
                ja, jb = ([[*entry[:2], "<uid>"] for entry in chain] for chain in (ja, jb))
            for d in _json_diffs(ja, jb):
                rep.diffs.append(f"{at}: JSON {d}")
            continue
        if type(va) is not type(vb) or _text(va) != _text(vb):
            rep.diff(at, "value", va, vb)


def _compare_dataset(where: str, a: Any, b: Any, rep: Report) -> None:
    if _type_info(a.id.get_type()) != _type_info(b.id.get_type()):
        rep.diff(where, "HDF5 type", _type_info(a.id.get_type()), _type_info(b.id.get_type()))
    for what, fn in (
        ("dtype", lambda d: d.dtype.str if d.dtype.fields is None else d.dtype.descr),
        ("shape", lambda d: d.shape),
        ("maxshape", lambda d: d.maxshape),
        ("chunks", lambda d: d.chunks),
        ("compression", lambda d: (d.compression, d.compression_opts, d.shuffle)),
        ("fletcher32", lambda d: d.fletcher32),
        ("fill value", lambda d: repr(d.fillvalue)),
        ("storage bytes", lambda d: d.id.get_storage_size()),
        ("file offset", lambda d: d.id.get_offset()),
    ):
        va, vb = fn(a), fn(b)
        if va != vb:
            rep.diff(where, what, va, vb)
    pa, pb = a.id.get_create_plist(), b.id.get_create_plist()
    for what, fn in (
        ("layout", lambda p: p.get_layout()),
        ("alloc time", lambda p: p.get_alloc_time()),
        ("fill time", lambda p: p.get_fill_time()),
        ("track times", lambda p: p.get_obj_track_times()),
        ("attribute creation order", lambda p: p.get_attr_creation_order()),
        ("filters", lambda p: [p.get_filter(i) for i in range(p.get_nfilters())]),
    ):
        va, vb = fn(pa), fn(pb)
        if va != vb:
            rep.diff(where, what, va, vb)
    if a.shape == b.shape and a.dtype == b.dtype:
        ba = np.ascontiguousarray(a[()])
        bb = np.ascontiguousarray(b[()])
        if ba.tobytes() != bb.tobytes():
            xa = np.frombuffer(ba.tobytes(), np.uint8)
            xb = np.frombuffer(bb.tobytes(), np.uint8)
            rep.diffs.append(f"{where}: bytes differ ({np.count_nonzero(xa != xb)} of {xa.size})")
            if where.endswith("/rank_tree"):
                _explain_trees(a, b, rep)


def _explain_trees(a: Any, b: Any, rep: Report) -> None:
    """Where the ranks' JSON state trees differ (the bytes alone do not say)."""
    oa, ob = a.attrs["offsets"], b.attrs["offsets"]
    ta, tb = a[()].tobytes(), b[()].tobytes()
    for r in range(min(len(oa), len(ob)) - 1):
        ja = json.loads(ta[oa[r] : oa[r + 1]])
        jb = json.loads(tb[ob[r] : ob[r + 1]])
        for d in _json_diffs(ja, jb):
            rep.diffs.append(f"{a.name} rank {r}: JSON {d}")


def _compare_group(where: str, a: Any, b: Any, rep: Report) -> None:
    import h5py

    pa, pb = a.id.get_create_plist(), b.id.get_create_plist()
    if pa.get_link_creation_order() != pb.get_link_creation_order():
        rep.diff(
            where,
            "link creation order",
            pa.get_link_creation_order(),
            pb.get_link_creation_order(),
        )
    names_a, names_b = list(a), list(b)
    if names_a != names_b:
        rep.diff(where, "members (in order)", names_a, names_b)
    for name in [n for n in names_a if n in set(names_b)]:
        path = f"{where.rstrip('/')}/{name}"
        la, lb = a.get(name, getlink=True), b.get(name, getlink=True)
        if type(la) is not type(lb):
            rep.diff(path, "link kind", type(la).__name__, type(lb).__name__)
            continue
        if not isinstance(la, h5py.HardLink):
            if vars(la) != vars(lb):
                rep.diff(path, "link target", vars(la), vars(lb))
            continue
        oa, ob = a[name], b[name]
        if type(oa) is not type(ob):
            rep.diff(path, "object kind", type(oa).__name__, type(ob).__name__)
            continue
        _compare_header(path, oa, ob, rep)
        _compare_attrs(path, oa, ob, rep, meta=path == "/meta")
        if isinstance(oa, h5py.Group):
            _compare_group(path, oa, ob, rep)
        else:
            _compare_dataset(path, oa, ob, rep)


# The signatures of HDF5's checksummed metadata (superblock v2+, object headers and their
# continuation chunks, fractal heaps, v2 B-trees, free-space managers, shared messages).
_SIGNATURES = (
    b"\x89HDF\r\n\x1a\n", b"OHDR", b"OCHK", b"FRHP", b"FHIB", b"FHDB", b"BTHD",
    b"BTIN", b"BTLF", b"FSHD", b"FSSE", b"SMTB", b"SMLI",
)  # fmt: skip
_M = 0xFFFFFFFF


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _M


def lookup3(data: bytes) -> int:
    """Bob Jenkins' lookup3 hashlittle (initval 0): HDF5's metadata checksum."""
    v = [(0xDEADBEEF + len(data)) & _M] * 3
    tail = data[len(data) - ((len(data) - 1) % 12 + 1) :] if data else b""
    for i in range(0, len(data) - len(tail), 12):  # every whole 12 bytes but the last
        for j in range(3):
            v[j] = (v[j] + int.from_bytes(data[i + 4 * j : i + 4 * j + 4], "little")) & _M
        for j, k in enumerate((4, 6, 8, 16, 19, 4)):  # mix
            x, y, z = j % 3, (j + 1) % 3, (j + 2) % 3
            v[x] = ((v[x] - v[z]) & _M) ^ _rot(v[z], k)
            v[z] = (v[z] + v[y]) & _M
    if not tail:
        return v[2]
    tail += bytes(12 - len(tail))
    for j in range(3):
        v[j] = (v[j] + int.from_bytes(tail[4 * j : 4 * j + 4], "little")) & _M
    for j, k in enumerate((14, 11, 25, 16, 4, 14, 24)):  # final
        x, s = (2 + j) % 3, (1 + j) % 3
        v[x] = ((v[x] ^ v[s]) - _rot(v[s], k)) & _M
    return v[2]


def _needles(pa: Path, pb: Path) -> list[bytes]:
    """The bytes of the ignored /meta values that differ, as either file stores them."""
    import h5py

    out = []
    with h5py.File(pa, "r") as fa, h5py.File(pb, "r") as fb:
        ma, mb = fa["meta"].attrs, fb["meta"].attrs
        for attrs, other in ((ma, mb), (mb, ma)):
            for name in [*IGNORED, VERSION]:
                v = attrs.get(name)
                if v is None or (name == VERSION and v == other.get(name)):
                    continue
                if isinstance(v, (float, np.floating)):
                    out.append(np.float64(v).tobytes())
                else:
                    out.append(_text(v).encode())
            for entry in _as_json(attrs.get("chain", "[]")) or []:
                out.append(str(entry[2]).encode())
    return [n for n in out if n]


def _cover(data: bytes, needles: list[bytes], mask: np.ndarray) -> None:
    for needle in needles:
        at = data.find(needle)
        while at >= 0:
            mask[at : at + len(needle)] = True
            at = data.find(needle, at + 1)


def _header_times(data: bytes, mask: np.ndarray) -> None:
    """Mark the timestamps of version-2 object headers (flag 0x20: 4 x 4 bytes)."""
    at = data.find(b"OHDR")
    while at >= 0:
        if data[at + 4] == 2 and data[at + 5] & 0x20:
            mask[at + 6 : at + 22] = True
        at = data.find(b"OHDR", at + 1)


def _is_checksum(data: bytes, at: int, starts: list[int]) -> bool:
    """Whether data[at:at+4] is the lookup3 checksum of a metadata block holding it: the
    bytes from the block's signature up to it, or (a fractal heap's direct block, FHDB)
    the whole block of a power-of-two size with the checksum's own bytes zeroed."""
    want = int.from_bytes(data[at : at + 4], "little")
    near = [s for s in starts if at - 65536 < s < at][-4:]
    for s in reversed(near):
        if lookup3(data[s:at]) == want:
            return True
        if data[s : s + 4] == b"FHDB":
            for size in (1 << k for k in range(9, 17)):
                if s + size >= at + 4 and s + size <= len(data):
                    block = data[s:at] + bytes(4) + data[at + 4 : s + size]
                    if lookup3(block) == want:
                        return True
    return False


def account_bytes(pa: Path, pb: Path, rep: Report) -> None:
    """Account for every byte that differs between two files of the same size: inside an
    ignored value, an object header's timestamps, or a metadata checksum over those."""
    da, db = pa.read_bytes(), pb.read_bytes()
    xa, xb = np.frombuffer(da, np.uint8), np.frombuffer(db, np.uint8)
    differ = xa != xb
    values = np.zeros(len(da), bool)
    needles = _needles(pa, pb)
    _cover(da, needles, values)
    _cover(db, needles, values)
    times = np.zeros(len(da), bool)
    _header_times(da, times)
    sums = np.zeros(len(da), bool)
    starts = sorted(m for sig in _SIGNATURES for m in _finditer(da, sig))
    left = differ & ~values & ~times
    for at in np.flatnonzero(left):
        if sums[at]:
            continue
        for c in range(max(0, at - 3), at + 1):
            if _is_checksum(da, c, starts) and _is_checksum(db, c, starts):
                sums[c : c + 4] = True
                break
    unexplained = np.flatnonzero(differ & ~values & ~times & ~sums)
    print(
        f"{pa.name}: {len(da)} bytes each; {int(differ.sum())} differ: "
        f"{int((differ & values).sum())} in ignored /meta values, "
        f"{int((differ & times & ~values).sum())} in object header times, "
        f"{int((differ & sums & ~values & ~times).sum())} in metadata checksums, "
        f"{unexplained.size} unexplained"
    )
    if unexplained.size:
        runs = np.split(unexplained, np.flatnonzero(np.diff(unexplained) > 1) + 1)
        for run in runs[:20]:
            lo, hi = int(run[0]), int(run[-1]) + 1
            rep.diffs.append(
                f"{pa.name}: bytes {lo}-{hi - 1} differ unexplained: "
                f"{da[lo - 8 : hi + 8]!r} != {db[lo - 8 : hi + 8]!r}"
            )
        if len(runs) > 20:
            rep.diffs.append(f"{pa.name}: {len(runs) - 20} more unexplained runs of bytes")


def _finditer(data: bytes, needle: bytes) -> list[int]:
    out, at = [], data.find(needle)
    while at >= 0:
        out.append(at)
        at = data.find(needle, at + 1)
    return out


def compare_files(pa: Path, pb: Path, rep: Report) -> None:
    """Compare two checkpoint files object by object, then account for their bytes."""
    import h5py

    name = pa.name
    sa, sb = pa.stat().st_size, pb.stat().st_size
    if sa != sb:
        rep.diff(name, "file size", sa, sb)
    if (pa.stat().st_mode & 0o7777) != (pb.stat().st_mode & 0o7777):
        rep.diff(name, "file mode", oct(pa.stat().st_mode), oct(pb.stat().st_mode))
    sub = Report()
    with h5py.File(pa, "r") as fa, h5py.File(pb, "r") as fb:
        if fa.libver != fb.libver:
            sub.diff("/", "libver bounds", fa.libver, fb.libver)
        if fa.userblock_size != fb.userblock_size:
            sub.diff("/", "userblock", fa.userblock_size, fb.userblock_size)
        _compare_header("/", fa["/"], fb["/"], sub)
        _compare_attrs("/", fa, fb, sub, meta=False)
        _compare_group("/", fa, fb, sub)
    rep.diffs += [f"{name}:{d}" for d in sub.diffs]
    for key, lines in sub.ignored.items():
        rep.ignored.setdefault(key, []).extend(f"{name}:{line}" for line in lines)
    if sa == sb:
        account_bytes(pa, pb, rep)


def _masked(value: Any, rep: Report, where: str, other: Any) -> tuple[Any, Any]:
    """Two parsed JSON values with the MEASURED keys taken out of every object in them."""
    if isinstance(value, dict) and isinstance(other, dict):
        a, b = {}, {}
        for k in value.keys() | other.keys():
            if k in MEASURED:
                if value.get(k) != other.get(k):
                    rep.ignore(f"JSON files: {k}", where, value.get(k), other.get(k))
                continue
            if k in value and k in other:
                a[k], b[k] = _masked(value[k], rep, where, other[k])
            elif k in value:
                a[k] = value[k]
            else:
                b[k] = other[k]
        return a, b
    if isinstance(value, list) and isinstance(other, list):
        n = min(len(value), len(other))
        pairs = [_masked(value[i], rep, f"{where}[{i}]", other[i]) for i in range(n)]
        return [x for x, _ in pairs] + value[n:], [y for _, y in pairs] + other[n:]
    return value, other


def _read_json(path: Path) -> Any:
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def compare_directory(da: Path, db: Path, rep: Report) -> None:
    """The directory's entries (kind, mode) and the content of its JSON files."""

    def entries(d: Path) -> dict[str, tuple[str, str]]:
        return {
            str(p.relative_to(d)): ("dir" if p.is_dir() else "file", oct(p.stat().st_mode & 0o7777))
            for p in sorted(d.rglob("*"))
        }

    ea, eb = entries(da), entries(db)
    for name in sorted(ea.keys() | eb.keys()):
        if ea.get(name) != eb.get(name):
            rep.diff(f"directory/{name}", "kind and mode", ea.get(name), eb.get(name))
    for name in sorted(ea.keys() & eb.keys()):
        if name.endswith((".json", ".jsonl")) and ea[name][0] == "file":
            ja, jb = _masked(_read_json(da / name), rep, name, _read_json(db / name))
            for d in _json_diffs(ja, jb):
                rep.diffs.append(f"{name}: JSON {d}")


def compare(da: Path, db: Path) -> int:
    """Compare every checkpoint file of two directories; 1 if any difference is not ignored."""
    for d in (da, db):
        if not d.is_dir():
            raise SystemExit(f"{d}: not a directory")
    rep = Report()
    files_a = sorted(p.name for p in da.glob("ckpt-*.h5*"))
    files_b = sorted(p.name for p in db.glob("ckpt-*.h5*"))
    if files_a != files_b:
        rep.diff("directory", "checkpoint files", files_a, files_b)
    if not files_a:
        rep.diffs.append(f"{da}: no checkpoint file")
    for name in sorted(set(files_a) & set(files_b)):
        if name.endswith(".h5"):
            compare_files(da / name, db / name, rep)
    compare_directory(da, db, rep)
    for key, lines in rep.ignored.items():
        print(f"IGNORED {key} ({WHY[key]}): differs in {len(lines)} place(s), e.g. {lines[0]}")
    for line in rep.diffs:
        print("DIFF", line)
    print(
        f"{len(files_a)} checkpoint file(s) and the directory compared: "
        f"{len(rep.diffs)} difference(s); "
        f"ignored where they differ: {', '.join(WHY)}"
    )
    return 1 if rep.diffs else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="under mpirun: write ckpt-0 (full) and ckpt-1 (incremental)")
    s.add_argument("directory", type=Path)
    s.add_argument("--detection", default="auto", help="change_detection (auto, kernel, hashes)")
    s.add_argument("--no-torch", action="store_true", help="leave the torch part out")
    s.add_argument("--staging", choices=("sync", "async", "cache"), default="sync")
    c = sub.add_parser("compare", help="compare the checkpoint files of two directories")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args()
    if args.cmd == "save":
        save(args.directory.absolute(), args.detection, not args.no_torch, args.staging)
    else:
        sys.exit(compare(args.a, args.b))


if __name__ == "__main__":
    main()
