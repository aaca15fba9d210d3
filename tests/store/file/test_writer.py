"""Rank 0's half of ``hpcckpt.store.file.writer``: the file it creates for many ranks.

A real 10,000-rank job cannot run here, so these tests hand rank 0's file creation
(``_create``) what the gather of 10,000 ranks would give it, then open the file with
the reader and plan every rank's read, as a restore's rank 0 does.
"""

from __future__ import annotations

import numpy as np

from hpcckpt.store.file import reader
from hpcckpt.store.file import writer as checkpoint_file
from hpcckpt.store.file.plan import ArraySpec
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io import blocks
from hpcckpt.store.restore import read_plan

ROWS, COLS = 4, 8


def create_for(path, nranks: int, narrays: int) -> dict:
    """Rank 0's file for ``nranks`` ranks that each hold ``narrays`` float64[ROWS, COLS]
    (the first one declared distributed) and a 200-byte state tree."""
    bs = blocks.DEFAULT_BLOCK_SIZE
    arrays = {f"a{i}": np.zeros((ROWS, COLS)) for i in range(narrays)}
    specs = [ArraySpec(p, a.dtype.str, a.shape) for p, a in arrays.items()]
    counts = {}
    for p, a in arrays.items():
        nb = blocks.nblocks(a.size, blocks.block_elems(a.itemsize, bs))
        counts[p] = (nb, nb, a.size)
    one_rank = (specs, 200, False, counts, False)
    return checkpoint_file._create(
        path,
        [one_rank] * nranks,
        7,
        nranks,
        {"reason": "interval"},
        {"a0"},
        None,
        bs,
        None,
        blocks.ChainPolicy(),
        None,
        (),
    )


def test_ten_thousand_ranks_of_metadata_are_written_and_read_back(tmp_path):
    """Every per-rank table (tree offsets, rank offsets and shapes, 30,001 block hash
    offsets) outgrows an HDF5 object header's 64 KiB here: the file must still be
    created, validate, and give the last rank a plan that points at its own rows."""
    n = 10_000
    path = tmp_path / "ckpt-0000000007.h5"
    plan = create_for(path, n, 3)
    with CheckpointReader(path) as r:
        assert r.nranks == n and r.step == 7 and sorted(r.arrays) == ["a0", "a1", "a2"]
        assert r.arrays["a0"].distributed and r.arrays["a0"].rank_offsets[-1] == n * ROWS
        assert len(r.hash_offsets) == n * 3 + 1 and len(r.tree_offsets) == n + 1
        plans = read_plan.plans(r)
    assert plans is not None and len(plans) == n
    last = plans[-1].arrays[0]
    assert last.name == "a0" and last.own == ((n - 1) * ROWS, n * ROWS)
    row_bytes = COLS * 8
    ((_, offset, _, nbytes),) = last.extents
    assert nbytes == ROWS * row_bytes
    assert offset == plan["bases"]["a0"]["data"] + (n - 1) * ROWS * row_bytes


def test_thousands_of_array_paths_fit(tmp_path):
    """9,000 array paths: their list alone is more than 64 KiB of JSON."""
    path = tmp_path / "ckpt-0000000007.h5"
    create_for(path, 1, 9000)
    with CheckpointReader(path) as r:
        assert len(r.arrays) == 9000 and r.arrays["a8999"].rank_shapes == ((ROWS, COLS),)


def test_set_attrs_writes_what_h5py_writes(tmp_path):
    """Every kind of attribute value a checkpoint holds: the same HDF5 type, shape and
    value as h5py's ``attrs[k] = v``, so that no reader can tell them apart."""
    import h5py

    values = {
        "text": "rows",
        "unicode": "état/ü",
        "json": "[[4, 8], [0, 8]]",
        "int": 7,
        "big": 1 << 62,
        "float": 0.25,
        "bool": True,
        "np_bool": np.bool_(False),
        "np_int": np.int64(-3),
        "offsets": np.array([0, 4, 8], dtype=np.int64),
        "empty": np.array([], dtype=np.int64),
        "u8": np.array([1, 2], dtype=np.uint8),
    }
    with h5py.File(tmp_path / "a.h5", "w", libver=("v108", "v110")) as f:
        ours, theirs = f.create_group("ours"), f.create_group("theirs")
        checkpoint_file.set_attrs(ours, values)
        for key, value in values.items():
            theirs.attrs[key] = value
    with h5py.File(tmp_path / "a.h5", "r") as f:
        ours, theirs = f["ours"], f["theirs"]
        assert sorted(ours.attrs) == sorted(values)
        for key in values:
            a, b = h5py.h5a.open(ours.id, key.encode()), h5py.h5a.open(theirs.id, key.encode())
            assert a.get_type() == b.get_type(), key
            assert a.shape == b.shape, key
            assert np.array_equal(np.asarray(ours.attrs[key]), np.asarray(theirs.attrs[key])), key


def test_the_metadata_lies_in_one_run_before_the_arrays_bytes(tmp_path):
    """A cold restore reads the metadata in one request (the reader asks for the file's
    start at once): every object header of a 40-array file lies before the first
    array's bytes, not between them (HDF5's 2 KiB default scattered them)."""
    import h5py
    from mpi4py import MPI

    from hpcckpt.store.store import CheckpointStore

    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, incremental=False)
    store.save(1, {f"layer{i}": np.full(8192, float(i)) for i in range(40)})
    path = next((tmp_path / "ck").glob("ckpt-*.h5"))
    headers, starts = [], []

    def visit(name, obj):
        headers.append(h5py.h5o.get_info(obj.id).addr)
        if isinstance(obj, h5py.Dataset) and obj.id.get_offset() is not None:
            starts.append((obj.id.get_offset(), name))

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    assert len(headers) > 40
    first_array = min(at for at, name in starts if name.startswith("state/"))
    assert max(headers) < first_array <= reader.METADATA_PREFETCH
    assert checkpoint_file.meta_block_size(40, False) <= reader.METADATA_PREFETCH
    assert checkpoint_file.meta_block_size(10_000, True) == 1 << 20
