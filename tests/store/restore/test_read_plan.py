"""A rank's read plan: what rank 0 sends after validating a checkpoint, read with POSIX
calls only. What it reads is exactly what the full reader reads, and every damaged byte,
hash or tree is still caught, naming the file at fault."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.restore import read_plan
from hpcckpt.store.store import CheckpointStore

BLOCK = 4096


def store_at(tmp_path, **kw) -> CheckpointStore:
    """Small blocks, and deltas however little they save (these states are small)."""
    return CheckpointStore(
        tmp_path / "ck", MPI.COMM_SELF, block_size=BLOCK, min_delta_saving=0, **kw
    )


def plan_of(store: CheckpointStore, step: int) -> read_plan.RankPlan:
    with CheckpointReader(store.directory / layout.checkpoint_name(step)) as reader:
        plan = read_plan.plans(reader)[0]
    assert plan is not None
    return plan


def same_as_reader(store: CheckpointStore, step: int) -> read_plan.RankPlan:
    """The plan reads every array and the tree exactly as the full reader does."""
    plan = plan_of(store, step)
    with CheckpointReader(store.directory / layout.checkpoint_name(step)) as full:
        with read_plan.PlanReader(plan) as posix:
            assert posix.tree() == full.tree(0)
            for a in plan.arrays:
                want = full.rank_array(a.name, 0)
                got = posix.array(a)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert np.array_equal(got, want), a.name
                assert np.array_equal(posix.own_hashes(a), full.block_hashes(a.name, 0))
    return plan


def awkward(k: int) -> dict:
    """Arrays as applications hold them: empty, strided, bool, 0-d, several blocks."""
    big = np.arange(40_000, dtype=np.float64) * k  # 79 blocks of 4 KiB
    return {
        "big": big,
        "strided": np.arange(3000, dtype=np.int32).reshape(30, 100)[:, ::3] * k,
        "empty": np.empty((0, 7), dtype=np.float32),
        "flags": np.arange(999) % (k + 2) == 0,
        "scalar": np.array(k, dtype=np.int16),
        "k": k,
    }


def test_a_full_checkpoint_reads_as_one_extent_per_array(tmp_path):
    store = store_at(tmp_path, incremental=False)
    store.save(1, awkward(1))
    plan = same_as_reader(store, 1)
    assert len(plan.files) == 1 and plan.chain[-1][1] == 1
    extents = {a.name: a.extents for a in plan.arrays}
    assert extents["empty"] == ()
    assert all(len(e) == 1 for name, e in extents.items() if name != "empty")


def test_an_incremental_checkpoint_reads_each_block_from_the_newest_file_of_its_chain(tmp_path):
    store = store_at(tmp_path)
    state = awkward(1)
    store.save(1, state)
    state["big"][5000:5001] = -1.0  # block 9
    state["big"][30000:34000] = -2.0  # blocks 58-66
    assert store.save(2, state).kind == "incremental"
    state["big"][5000:5001] = -3.0  # block 9 again: the newest copy is in step 3
    assert store.save(3, state).kind == "incremental"
    plan = same_as_reader(store, 3)
    assert [layout.step_of(f.rsplit("/", 1)[-1]) for f in plan.files] == [1, 2, 3]
    big = next(a for a in plan.arrays if a.name == "big")
    by_file = {k: [] for k in range(3)}
    for k, _, at, nbytes in big.extents:
        by_file[k].append((at // BLOCK, nbytes))
    assert (9, BLOCK) in by_file[2] and all(b != 9 for b, _ in by_file[1])
    assert sum(n for _, _, _, n in big.extents) == big.shape[0] * 8  # every byte, once
    assert len(big.extents) == 5  # base [0,9), step 3's 9, base [10,58), step 2's, base tail


def test_plans_are_the_same_computed_in_plain_python_or_with_numpy(tmp_path, monkeypatch):
    """A few ranks' extents are computed in plain Python, many ranks' with numpy."""
    store = store_at(tmp_path)
    state = awkward(1)
    store.save(1, state)
    state["big"][5000:5001] = -1.0
    assert store.save(2, state).kind == "incremental"
    for step in (1, 2):
        python = plan_of(store, step)
        monkeypatch.setattr(read_plan, "FEW_RANKS", -1)
        assert plan_of(store, step) == python
        monkeypatch.undo()


def test_rank_0_reads_its_plan_through_the_validating_readers_descriptors(tmp_path):
    """No file of the chain opened again; the reader's descriptors stay open after."""
    import os

    store = store_at(tmp_path)
    state = awkward(1)
    store.save(1, state)
    state["big"][5000:5001] = -1.0
    assert store.save(2, state).kind == "incremental"
    path = store.directory / layout.checkpoint_name(2)
    with CheckpointReader(path) as reader:
        plan = read_plan.plans(reader)[0]
        before = sorted(os.listdir("/proc/self/fd"))
        with read_plan.PlanReader(plan, opened=reader) as posix:
            assert sorted(os.listdir("/proc/self/fd")) == before  # nothing opened
            assert posix.tree() == reader.tree(0)
            for a in plan.arrays:
                assert np.array_equal(posix.array(a), reader.rank_array(a.name, 0)), a.name
        assert [os.fstat(m.fd).st_ino for m in reader.chain] == [
            os.stat(f).st_ino for f in plan.files
        ]
        assert np.array_equal(reader.rank_array("big", 0), state["big"])


@pytest.mark.parametrize(
    "what, fragment",
    [
        ("base", "ckpt-0000000001.h5: array 'big' of rank 0, block 1, fails its checksum"),
        ("delta", "ckpt-0000000002.h5: array 'big' of rank 0, block 2, fails its checksum"),
        ("tree", "rank 0's state tree fails its checksum"),
        ("hashes", "the block hashes of array 'big' of rank 0 fail their checksum"),
    ],
)
def test_a_damaged_byte_is_caught_and_the_file_at_fault_named(tmp_path, what, fragment):
    store = store_at(tmp_path)
    state = awkward(1)
    store.save(1, state)
    state["big"][2 * 512] = -1.0  # block 2 changes
    assert store.save(2, state).kind == "incremental"
    plan = plan_of(store, 2)
    big = next(a for a in plan.arrays if a.name == "big")
    if what == "base":
        k, offset = next((k, o + BLOCK) for k, o, at, _ in big.extents if k == 0 and at == 0)
    elif what == "delta":
        k, offset = next((k, o) for k, o, _, _ in big.extents if k == 1)
    elif what == "tree":
        k, offset = 1, plan.tree[0] + 3
    else:
        k, offset = 1, plan.rows[0][0] + 8 * big.hashes[1]
    with open(plan.files[k], "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    with read_plan.PlanReader(plan) as posix, pytest.raises(CorruptCheckpoint) as err:
        posix.tree()
        posix.array(big)
    assert fragment in str(err.value)
    if what == "base":  # the delta is fine: the fault is its base's
        assert str(err.value.culprit).endswith("ckpt-0000000001.h5")


def test_a_file_ending_early_is_unreadable_not_a_hang(tmp_path):
    store = store_at(tmp_path, incremental=False)
    store.save(1, awkward(1))
    plan = plan_of(store, 1)
    big = next(a for a in plan.arrays if a.name == "big")
    with open(plan.files[0], "r+b") as f:
        f.truncate(big.extents[0][1] + 100)
    with read_plan.PlanReader(plan) as posix, pytest.raises(CorruptCheckpoint, match="unreadable"):
        posix.array(big)


def test_reads_go_into_the_applications_array(tmp_path):
    store = store_at(tmp_path, incremental=False)
    store.save(1, awkward(2))
    plan = plan_of(store, 1)
    big = next(a for a in plan.arrays if a.name == "big")
    mine = np.zeros(40_000)
    with read_plan.PlanReader(plan) as posix:
        assert posix.array(big, mine) is mine
        assert posix.array(big, np.zeros(3)).shape == (40_000,)  # not its shape: not used
    assert np.array_equal(mine, awkward(2)["big"])


def test_a_dataset_hdf5_must_convert_gets_no_plan(tmp_path):
    store = store_at(tmp_path, incremental=False)
    store.save(1, {"u": np.arange(10.0)})
    path = store.directory / layout.checkpoint_name(1)
    with h5py.File(path, "r+") as f:
        attrs = dict(f["state/u"].attrs)
        del f["state/u"]
        d = f.create_dataset("state/u", data=np.arange(10.0), chunks=(5,))
        d.attrs.update(attrs)
    with CheckpointReader(path) as reader:
        assert read_plan.plans(reader) is None
        assert np.array_equal(reader.rank_array("u", 0), np.arange(10.0))  # still read, by HDF5
    state: dict = {}
    assert store_at(tmp_path).restore(state).step == 1
    assert np.array_equal(state["u"], np.arange(10.0))


def large(k: int) -> dict:
    """Four arrays of 1.5 MiB (read two at a time) among small ones (read one by one)."""
    return {
        **{f"w{i}": np.arange(196_608, dtype=np.float64) * (k + i) for i in range(4)},
        "small": np.arange(100, dtype=np.int32) * k,
        "k": k,
    }


def test_large_arrays_are_read_two_at_a_time_into_the_applications_arrays(tmp_path, monkeypatch):
    store = store_at(tmp_path, incremental=False)
    store.save(1, large(3))
    plan = plan_of(store, 1)
    mine = {a.name: np.zeros(a.shape, np.dtype(a.dtype)) for a in plan.arrays}
    threads: set[str] = set()
    at_once, running = [0], [0]
    inner = read_plan.PlanReader._start
    lock = threading.Lock()

    def start(self, a, out=None):
        threads.add(threading.current_thread().name)
        if not a.name.startswith("w"):
            return inner(self, a, out)
        with lock:
            running[0] += 1
            at_once[0] = max(at_once[0], running[0])
        try:
            time.sleep(0.2)  # long enough for both readers to be busy at once, even loaded
            return inner(self, a, out)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(read_plan.PlanReader, "_start", start)
    with read_plan.PlanReader(plan) as posix:
        got = posix.read_all(list(plan.arrays), mine)
    assert list(got) == [a.name for a in plan.arrays]
    for name, want in large(3).items():
        if isinstance(want, np.ndarray):
            assert got[name] is mine[name] and np.array_equal(mine[name], want), name
    assert at_once[0] == read_plan.READERS
    assert sum(t.startswith("hpcckpt-read") for t in threads) == read_plan.READERS
    assert threading.main_thread().name in threads  # the small arrays, beside them
    assert not [t for t in threading.enumerate() if t.name.startswith("hpcckpt-read")]
    assert not [t for t in threading.enumerate() if t.name.startswith("hpcckpt-hash")]


def test_a_damaged_large_array_read_beside_others_is_caught_once_every_read_ended(tmp_path):
    store = store_at(tmp_path, incremental=False)
    store.save(1, large(1))
    plan = plan_of(store, 1)
    w2 = next(a for a in plan.arrays if a.name == "w2")
    with open(plan.files[0], "r+b") as f:
        f.seek(w2.extents[0][1] + 5 * BLOCK + 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with read_plan.PlanReader(plan) as posix, pytest.raises(CorruptCheckpoint) as err:
        posix.read_all(list(plan.arrays), {})
    assert "array 'w2' of rank 0, block 5, fails its checksum" in str(err.value)
    assert not [t for t in threading.enumerate() if t.name.startswith("hpcckpt-read")]


def test_the_bytes_read_through_the_page_cache_are_asked_for_at_once(tmp_path, monkeypatch):
    """Small arrays whole, and only the edges of an array read past the cache: asked of
    the kernel before those reads come (the page cache holds them after, not the rest)."""
    import os

    from hpcckpt.store.io import direct_io

    store = store_at(tmp_path, incremental=False)
    state = {**large(1), "big": np.arange(1 << 20, dtype=np.float64)}  # 8 MiB: read direct
    store.save(1, state)
    plan = plan_of(store, 1)
    asked: list[tuple[int, int]] = []
    advise = os.posix_fadvise

    def recorded(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_WILLNEED
        asked.append((offset, length))
        advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", recorded)
    with read_plan.PlanReader(plan, direct_io=True) as posix:
        got = posix.read_all(list(plan.arrays), {})
    for a in plan.arrays:
        want = state[a.name] if a.name != "k" else None
        if want is not None:
            assert np.array_equal(got[a.name], want), a.name
        ((_, offset, _, nbytes),) = a.extents or ((0, 0, 0, 0),)
        if a.name == "big":
            edge = read_plan.EDGE_BYTES
            assert nbytes >= direct_io.MIN_DIRECT_BYTES
            assert (offset, edge) in asked and (offset + nbytes - edge, edge) in asked
            assert not [o for o, n in asked if offset + edge < o + n and o < offset + nbytes - edge]
        elif nbytes:
            assert (offset, nbytes) in asked, a.name


@pytest.mark.parametrize("cached", [True, False])
def test_a_damaged_block_is_caught_read_through_the_page_cache_or_past_it(
    tmp_path, monkeypatch, uncached, read_past, cached
):
    """A file whose pages are in the page cache (a restore right after a save) is read
    through it, one that is not past it: either way every block is checked."""
    from hpcckpt.store.io import direct_io

    monkeypatch.setattr(direct_io, "MIN_DIRECT_BYTES", 64 * 1024)  # the 1.5 MiB arrays
    monkeypatch.setattr(direct_io, "DIRECT_READ_PIECE_BYTES", 256 * 1024)  # many pieces
    store = store_at(tmp_path, incremental=False)
    store.save(1, large(1))
    plan = plan_of(store, 1)
    w2 = next(a for a in plan.arrays if a.name == "w2")
    with open(plan.files[0], "r+b") as f:
        f.seek(w2.extents[0][1] + 5 * BLOCK + 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    if cached:  # the save wrote past the cache: read once through it
        assert len(Path(plan.files[0]).read_bytes()) > 4 * 1536 * 1024
    else:
        uncached(plan.files[0])
    before = set(threading.enumerate())  # other tests' never-closed stores keep theirs
    with (
        read_plan.PlanReader(plan, direct_io=True) as posix,
        pytest.raises(CorruptCheckpoint) as err,
    ):
        posix.read_all(list(plan.arrays), {})
    assert "array 'w2' of rank 0, block 5, fails its checksum" in str(err.value)
    assert read_past == [] if cached else (len(read_past) == 4 and min(read_past) > 0)
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("hpcckpt-")]


def test_a_damaged_block_is_caught_by_a_cold_read_through_the_page_cache(
    tmp_path, monkeypatch, uncached, read_past
):
    """Cold reads taken through the page cache (``COLD_READ = "buffered"``) check every
    block as the direct ones do: the bytes hashed are those placed in the arrays."""
    from hpcckpt.store.io import direct_io

    monkeypatch.setattr(direct_io, "COLD_READ", "buffered")
    monkeypatch.setattr(direct_io, "MIN_DIRECT_BYTES", 64 * 1024)  # the 1.5 MiB arrays
    monkeypatch.setattr(direct_io, "READ_PIECE_BYTES", 256 * 1024)  # many pieces
    store = store_at(tmp_path, incremental=False)
    state = large(2)
    store.save(1, state)
    plan = plan_of(store, 1)
    uncached(plan.files[0])
    with read_plan.PlanReader(plan, direct_io=True) as posix:
        got = posix.read_all(list(plan.arrays), {})
    for name, want in state.items():
        if isinstance(want, np.ndarray):
            assert np.array_equal(got[name], want), name
    w3 = next(a for a in plan.arrays if a.name == "w3")
    with open(plan.files[0], "r+b") as f:
        f.seek(w3.extents[0][1] + 7 * BLOCK + 11)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    uncached(plan.files[0])
    before = set(threading.enumerate())  # other tests' never-closed stores keep theirs
    with (
        read_plan.PlanReader(plan, direct_io=True) as posix,
        pytest.raises(CorruptCheckpoint) as err,
    ):
        posix.read_all(list(plan.arrays), {})
    assert "array 'w3' of rank 0, block 7, fails its checksum" in str(err.value)
    assert read_past == []  # nothing was read past the page cache
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("hpcckpt-")]


def test_a_cold_planned_read_opens_one_direct_descriptor_per_file(
    tmp_path, monkeypatch, uncached, read_past
):
    """Every large array of the file read past the page cache through the one direct
    descriptor, the reads' hashing threads ended and their descriptors closed after."""
    import os

    from hpcckpt.store.io import direct_io

    monkeypatch.setattr(direct_io, "MIN_DIRECT_BYTES", 64 * 1024)
    monkeypatch.setattr(direct_io, "DIRECT_READ_PIECE_BYTES", 256 * 1024)
    store = store_at(tmp_path, incremental=False)
    state = large(5)
    store.save(1, state)
    plan = plan_of(store, 1)
    uncached(plan.files[0])
    opens = []
    real = direct_io._open_direct
    monkeypatch.setattr(direct_io, "_open_direct", lambda p: opens.append(p) or real(p))
    fds = len(os.listdir("/proc/self/fd"))
    before = set(threading.enumerate())  # other tests' never-closed stores keep theirs
    mine = {a.name: np.zeros(a.shape, np.dtype(a.dtype)) for a in plan.arrays}
    with read_plan.PlanReader(plan, direct_io=True) as posix:
        got = posix.read_all(list(plan.arrays), mine)
    for name, want in state.items():
        if isinstance(want, np.ndarray):
            assert got[name] is mine[name] and np.array_equal(mine[name], want), name
    assert len(read_past) == 4 and min(read_past) > 0  # the four large arrays, past the cache
    assert opens == [plan.files[0]]
    assert len(os.listdir("/proc/self/fd")) == fds
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("hpcckpt-")]
