"""Incremental checkpoints in one process: chains, bounds, fallback, retention, export."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store import catalog
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.export.hdf5 import export_checkpoint
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io.blocks import BlockHasher, block_hashes, hashes_checksum, runs
from hpcckpt.store.retention import candidates
from hpcckpt.store.store import CheckpointStore
from tests.format_helpers import as_version_3

BLOCK = 4096  # 512 float64 per block
N = 512 * 40 + 100  # 41 blocks, the last one short


def make_store(d, **kw):
    """Small blocks, and deltas whatever they save: these states are small (the rule
    that makes small deltas full has its own tests)."""
    kw.setdefault("min_delta_saving", 0)
    return CheckpointStore(d, MPI.COMM_SELF, block_size=BLOCK, **kw)


def evolve(u: np.ndarray, step: int, nblocks: int = 2) -> None:
    """Change a few whole-block positions of ``u`` (deterministic by step)."""
    for j in np.random.default_rng(step).choice(u.size // 512 + 1, nblocks, replace=False):
        u[j * 512 : j * 512 + 3] += step


def save_chain(store, steps, nblocks=2):
    u = np.sin(np.arange(N, dtype=np.float64))
    w = np.arange(7, dtype=np.int16)
    held, kinds = {}, {}
    for step in steps:
        evolve(u, step, nblocks)
        res = store.save(step, {"u": u, "w": w, "s": np.float32(step), "k": step})
        held[step], kinds[step] = u.copy(), res.kind
    return held, kinds


def path(store, step):
    return store.directory / layout.checkpoint_name(step)


def test_blocks_helpers():
    a = np.arange(1000, dtype=np.float64)
    h = block_hashes(a, BLOCK)
    assert h.size == 2 and h.dtype == np.uint64
    assert np.array_equal(
        block_hashes(a.reshape(10, 100)[:, :50], BLOCK),
        block_hashes(np.ascontiguousarray(a.reshape(10, 100)[:, :50]), BLOCK),
    )
    assert block_hashes(np.zeros(0), BLOCK).size == 0 and hashes_checksum(h) > 0
    assert runs(np.array([1, 2, 3, 7, 9, 10])) == [(1, 4), (7, 8), (9, 11)]


@pytest.mark.parametrize("points", [[], [1], [4095, 4096, 4097], [8192 * 3 + 5, 10**9]])
def test_block_hasher_piece_by_piece_equals_block_hashes(points):
    """However the bytes are handed on, the hashes are those of one pass."""
    a = np.sin(np.arange(N, dtype=np.float64))
    want = block_hashes(a, BLOCK)
    out = np.zeros(want.size, dtype=np.uint64)
    hasher = BlockHasher(a, BLOCK, out)
    for n in points:
        hasher.upto(n)
        assert np.array_equal(out[: hasher.done], want[: hasher.done])
    hasher.upto(a.nbytes)
    assert np.array_equal(out, want)
    with pytest.raises(ValueError, match="hash slots"):
        BlockHasher(a, BLOCK, np.zeros(3, dtype=np.uint64))


def test_a_full_save_hashes_while_writing_what_it_wrote(tmp_path):
    """The block hashes of a full save, computed during its direct writes, are the
    hashes of the bytes in the file (a state above the direct-I/O threshold, whose
    last block is short, and a non-contiguous array)."""
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)  # 1 MiB blocks
    big = np.random.default_rng(1).random((36 << 20) // 8 + 77)  # two bounce buffers
    strided = np.arange(3000.0).reshape(60, 50)[:, ::2]
    res = store.save(1, {"big": big, "strided": strided})
    assert res.kind == "full"
    with CheckpointReader(res.path) as reader:
        for name, a in (("big", big), ("strided", np.ascontiguousarray(strided))):
            assert np.array_equal(reader.block_hashes(name, 0), block_hashes(a, 1 << 20))
    assert np.array_equal(store.saver.last.hashes["big"], block_hashes(big, 1 << 20))
    out = {"big": np.zeros_like(big), "strided": np.zeros_like(strided)}
    store.restore(out)  # verifies every block against the stored hashes
    assert np.array_equal(out["big"], big) and np.array_equal(out["strided"], strided)


def test_every_checkpoint_of_a_chain_restores_bitwise(tmp_path):
    store = make_store(tmp_path / "ck")
    held, kinds = save_chain(store, range(1, 6))
    assert [kinds[s] for s in range(1, 6)] == ["full"] + ["incremental"] * 4
    for step in range(1, 6):
        with CheckpointReader(path(store, step)) as r:
            assert [p.step for p in r.chain] == list(range(1, step + 1))
            assert r.rank_array("u", 0).tobytes() == held[step].tobytes()
            assert r.verify() == []
    full, delta = path(store, 1).stat().st_size, path(store, 5).stat().st_size
    assert delta < full / 3
    state = {"u": np.zeros(N), "w": None, "s": None, "k": None}
    got = make_store(store.directory).restore(state)
    assert got.step == 5 and state["u"].tobytes() == held[5].tobytes() and state["k"] == 5
    assert state["s"] == np.float32(5) and state["w"].dtype == np.int16


def test_the_meta_records_parent_base_and_chain(tmp_path):
    store = make_store(tmp_path / "ck")
    save_chain(store, [10, 20, 30])
    with h5py.File(path(store, 30), "r") as f:
        m = f["meta"].attrs
        assert m["format_version"] == 4 and m["kind"] == "incremental"
        assert m["parent"] == layout.checkpoint_name(20) and m["parent_step"] == 20
        assert m["base"] == layout.checkpoint_name(10) and m["base_step"] == 10
        assert [c[:2] for c in json.loads(m["chain"])] == [
            [layout.checkpoint_name(10), 10],
            [layout.checkpoint_name(20), 20],
        ]
        assert 0 < m["dirty_blocks"] < m["total_blocks"] and "state/u" not in f
        assert f["delta/u"].shape[0] == f["delta_index/u"].shape[0] * 512


def test_chain_length_bound(tmp_path):
    store = make_store(tmp_path / "ck", max_chain=2)
    _, kinds = save_chain(store, range(1, 8))
    assert [kinds[s] for s in range(1, 8)] == ["full", "incremental", "incremental"] * 2 + ["full"]


def test_chain_bytes_bound_and_mostly_dirty_saves_are_full(tmp_path):
    store = make_store(tmp_path / "ck", max_chain_fraction=0.5)
    # 12 of 41 blocks per save (~30 %): a second delta would pass half a full one.
    _, kinds = save_chain(store, range(1, 6), nblocks=12)
    assert [kinds[s] for s in range(1, 6)] == ["full", "incremental", "full", "incremental", "full"]
    store2 = make_store(tmp_path / "ck2")
    _, kinds = save_chain(store2, range(1, 4), nblocks=40)  # everything dirty
    assert set(kinds.values()) == {"full"}


def test_incremental_off_and_layout_changes_write_full(tmp_path):
    store = make_store(tmp_path / "ck", incremental=False)
    _, kinds = save_chain(store, range(1, 4))
    assert set(kinds.values()) == {"full"}
    store = make_store(tmp_path / "ck2")
    store.save(1, {"u": np.zeros(5000)})
    assert store.save(2, {"u": np.zeros(5000)}).kind == "incremental"
    assert store.save(3, {"u": np.zeros(5001)}).kind == "full"  # another shape
    assert store.save(4, {"u": np.zeros(5001, np.float32)}).kind == "full"  # another dtype
    assert store.save(5, {"u": np.zeros(5001, np.float32), "v": np.ones(3)}).kind == "full"
    with pytest.raises(ValueError, match="block_size"):
        CheckpointStore(tmp_path / "x", MPI.COMM_SELF, block_size=1000)


def test_odd_arrays_round_trip_through_deltas(tmp_path):
    store = make_store(tmp_path / "ck")
    rng = np.random.default_rng(1)
    state = {
        "c": rng.random(3000) + 1j * rng.random(3000),
        "b": rng.random(9000) > 0.5,
        "e": np.zeros((0, 4)),
        "z": np.array(3.5),
        "big": np.arange(20000, dtype=">i4").reshape(100, 200),
        "t": np.arange(6000.0).reshape(60, 100).T,  # not C-contiguous
    }
    store.save(1, state)
    state["c"][2500] = 7
    state["b"][:10] = ~state["b"][:10]
    state["z"] = np.array(4.5)
    state["big"][99, 199] = -1
    assert store.save(2, state).kind == "incremental"
    restored = {}
    make_store(store.directory).restore(restored)
    for key, value in state.items():
        assert restored[key].dtype == value.dtype and restored[key].shape == value.shape
        assert (
            np.ascontiguousarray(restored[key]).tobytes() == np.ascontiguousarray(value).tobytes()
        )


def test_restart_continues_the_chain_from_hashes_in_the_file(tmp_path):
    store = make_store(tmp_path / "ck")
    held, _ = save_chain(store, range(1, 4))
    again = make_store(store.directory)
    state = {"u": np.zeros(N), "w": None, "s": None, "k": None}
    again.restore(state)
    state["u"][0] += 1
    res = again.save(4, state)
    assert res.kind == "incremental" and res.dirty_blocks == 1
    with CheckpointReader(path(store, 4)) as r:
        assert [p.step for p in r.chain] == [1, 2, 3, 4]
        assert r.rank_array("u", 0).tobytes() == state["u"].tobytes()


def corrupt_delta_block(p, dataset="delta/u"):
    with h5py.File(p, "r") as f:
        off = f[dataset].id.get_offset()
    raw = bytearray(p.read_bytes())
    raw[off + 8] ^= 0x40
    p.write_bytes(bytes(raw))


def test_a_corrupt_delta_mid_chain_falls_back_to_the_newest_whole_good_chain(tmp_path):
    store = make_store(tmp_path / "ck")
    u = np.sin(np.arange(N, dtype=np.float64))
    held = {}
    for step in range(1, 6):  # each delta changes its own block, which later ones need
        u[step * 512] += step
        store.save(step, {"u": u})
        held[step] = u.copy()
    corrupt_delta_block(path(store, 3))
    reports = {s: catalog.verify(path(store, s)) for s in range(1, 6)}
    assert [s for s, r in reports.items() if not r["good"]] == [3, 4, 5]
    assert layout.checkpoint_name(3) in reports[5]["problems"][0]
    state = {"u": np.zeros(N)}
    got = make_store(store.directory).restore(state)
    assert got.step == 2 and state["u"].tobytes() == held[2].tobytes()
    assert [s for s, _ in got.skipped] == [5, 4, 3]
    marked = {e.step for e in layout.scan(store.directory) if not e.good_candidate}
    assert marked == {3}, "only the corrupt file is marked; its dependents are skipped"
    rows = {r["step"]: r for r in catalog.list_directory(store.directory)}
    assert [rows[s]["status"] for s in range(1, 6)] == ["good", "good", "bad", "bad", "bad"]
    # The next save starts from the restored checkpoint (step 2), not from the bad chain.
    state["u"][0] = 9
    store2_res = make_store(store.directory).save(6, state)
    assert store2_res.kind == "full"  # this store restored nothing, so it starts a chain


def test_a_missing_or_replaced_base_breaks_only_its_chain(tmp_path):
    store = make_store(tmp_path / "ck")
    held, _ = save_chain(store, [1, 2, 3])
    path(store, 1).unlink()
    report = catalog.verify(path(store, 3))
    assert not report["good"] and "missing" in report["problems"][0]
    with pytest.raises(CheckpointError, match="none of the 2 checkpoints"):
        make_store(store.directory).restore({"u": np.zeros(N)})
    # The store that wrote them notices the base is gone: its next save is full.
    assert store.save(4, {"u": held[3], "w": None}).kind == "full"
    other = make_store(tmp_path / "ck2")
    save_chain(other, [1, 2])
    make_store(tmp_path / "ck2", incremental=False).save(1, {"u": np.ones(N)})  # replaces 1
    assert "now another checkpoint" in catalog.verify(path(other, 2))["problems"][0]
    assert {c.step: c.bad for c in candidates(other.directory)} == {1: False, 2: True}


def test_pruning_never_breaks_a_retained_chain(tmp_path):
    store = make_store(tmp_path / "ck", max_chain=3)
    rng = np.random.default_rng(7)
    u = np.sin(np.arange(N, dtype=np.float64))
    held = {}
    for step in range(1, 25):
        u[rng.integers(0, N, rng.integers(1, 4))] += 1
        store.save(step, {"u": u})
        held[step] = u.copy()
        rule = [{"keep_last": 1}, {"keep_last": 2}, {"keep_every": 5, "keep_last": 1}][step % 3]
        store.prune(**rule)
        left = [e.step for e in layout.scan(store.directory)]
        assert step in left
        for s in left:
            with CheckpointReader(path(store, s)) as r:
                assert r.rank_array("u", 0).tobytes() == held[s].tobytes()
    kept = [e.step for e in layout.scan(store.directory)]
    assert len(kept) < 24


def test_export_materializes_a_delta_like_a_full_checkpoint(tmp_path):
    store = make_store(tmp_path / "ck")
    held, _ = save_chain(store, [1, 2, 3])
    full = make_store(tmp_path / "full", incremental=False)
    full.save(3, {"u": held[3], "w": np.arange(7, dtype=np.int16), "s": np.float32(3), "k": 3})
    a = export_checkpoint(path(store, 3), tmp_path / "a.h5")
    b = export_checkpoint(path(full, 3), tmp_path / "b.h5")
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        assert fa.attrs["kind"] == "incremental" and fb.attrs["kind"] == "full"
        for name in ("u", "w"):
            assert fa["arrays"][name][()].tobytes() == fb["arrays"][name][()].tobytes()
        assert np.array_equal(fa["arrays/u"][...], held[3])


def test_a_version_1_file_is_still_read(tmp_path):
    """Checkpoints written before format 2 (whole-slice checksums, no blocks) restore."""
    import xxhash

    d = tmp_path / "ck"
    d.mkdir()
    u = np.arange(100.0)
    tree = json.dumps({"$t": "dict", "v": {"u": {"$t": "array", "path": "u"}, "k": 4}}).encode()
    with h5py.File(d / layout.checkpoint_name(4), "w") as f:
        m = f.create_group("meta")
        for k, v in dict(
            format="hpcckpt",
            format_version=1,
            step=4,
            nranks=1,
            time=1.0,
            checksum="xxh3_64",
            arrays=json.dumps(["u"]),
        ).items():
            m.attrs[k] = v
        rt = m.create_dataset("rank_tree", data=np.frombuffer(tree, np.uint8))
        rt.attrs["offsets"] = np.array([0, len(tree)], dtype=np.int64)
        m.create_dataset(
            "checksums",
            data=np.array(
                [[xxhash.xxh3_64_intdigest(u.tobytes()), xxhash.xxh3_64_intdigest(tree)]],
                dtype=np.uint64,
            ),
        )
        ds = f.create_dataset("state/u", data=u)
        ds.attrs.update(
            layout="rows", rank_offsets=np.array([0, 100]), rank_shapes="[[100]]", distributed=False
        )
    store = make_store(d)
    state: dict = {}
    assert store.restore(state).step == 4 and np.array_equal(state["u"], u)
    assert store.save(5, state).kind == "full"  # no block hashes to compare with
    assert store.save(6, state).kind == "incremental"


def test_a_chain_written_by_format_3_restores_and_grows_in_format_4(tmp_path):
    """Files of an older hpcckpt (each array described by its dataset's attributes) are
    read as before, and a newer delta on top of them is read with them."""
    store = make_store(tmp_path / "ck")
    held, kinds = save_chain(store, [1, 2, 3])
    assert [kinds[s] for s in (1, 2, 3)] == ["full", "incremental", "incremental"]
    for step in (1, 2, 3):
        with h5py.File(path(store, step), "r+") as f:
            as_version_3(f)
    state = {"u": np.zeros(N), "w": np.zeros(7, dtype=np.int16), "s": None, "k": None}
    store = make_store(tmp_path / "ck")
    assert store.restore(state).step == 3 and state["u"].tobytes() == held[3].tobytes()
    with CheckpointReader(path(store, 3)) as r:
        assert [p.format_version for p in r.chain] == [3, 3, 3] and not r.verify()
    state["u"][5] += 1.0
    assert store.save(4, state).kind == "incremental"
    with CheckpointReader(path(store, 4)) as r:
        assert [p.format_version for p in r.chain] == [3, 3, 3, 4] and not r.verify()
        assert r.rank_array("u", 0).tobytes() == state["u"].tobytes()
        assert r.arrays["w"].rank_shapes == ((7,),) and r.arrays["u"].layout == "rows"


def test_a_delta_that_leaves_out_too_little_per_array_is_written_full(tmp_path):
    """Many small arrays (a model's biases and norms): a delta would cost a second
    dataset per array and a longer chain to restore for a few KiB left out, so the
    default policy writes them whole; one large array with the same change is a delta."""
    store = CheckpointStore(tmp_path / "small", MPI.COMM_SELF)  # the default policy
    small = {f"layer{i}": np.full(512, float(i)) for i in range(200)}  # 4 KiB each
    assert store.save(1, small).kind == "full"
    small["layer7"][3] = -1.0
    assert store.save(2, small).kind == "full"
    out = {k: np.zeros(512) for k in small}
    assert CheckpointStore(tmp_path / "small", MPI.COMM_SELF).restore(out).step == 2
    assert all(np.array_equal(out[k], small[k]) for k in small)

    store = CheckpointStore(tmp_path / "large", MPI.COMM_SELF)
    large = {"u": np.arange(1 << 20, dtype=np.float64)}  # 8 MiB: 8 blocks
    store.save(1, large)
    large["u"][3] = -1.0
    res = store.save(2, large)
    assert res.kind == "incremental" and res.dirty_blocks == 1
