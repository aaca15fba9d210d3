"""How saves find their changed blocks (hpcckpt/store/save/change_detection.py): with the
kernel's written pages, every checkpoint holds what hashing every block would have
written, through failures, restores and memory the kernel cannot vouch for; the
self-audit catches a tracker that missed a change."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.save.write_tracking import PAGE
from hpcckpt.store.store import CheckpointStore

BLOCK = 64 << 10
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


# Trackers are released between tests (tests/store/conftest.py).
pytestmark = pytest.mark.usefixtures("trackers_released")


def make_state(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    buf = rng.random(3 << 17)  # 3 MiB; two views of it share pages
    return {
        "u": rng.random(4 << 17),  # 4 MiB float64
        "f": rng.random((512, 1000)).astype(np.float32),  # rows not page-aligned
        "left": buf[: 2 << 17],
        "right": buf[(1 << 17) :],
        "small": np.arange(100, dtype=np.int32),  # under one block: hashed
        "t": rng.random((600, 700)).T,  # not contiguous: saved as a copy, hashed
        "k": 0,
    }


def evolve(state: dict, step: int, zap: bool = False, zapped: dict | None = None) -> None:
    """What a simulation does between checkpoints, the same for every copy of the state;
    ``zap``: zero pages by MADV_DONTNEED (their offsets into ``zapped``), else by writes
    at the offsets ``zapped`` holds."""
    zapped = {} if zapped is None else zapped
    rng = np.random.default_rng(step)
    u, f = state["u"], state["f"]
    u[rng.integers(0, u.size, 7)] += step  # scattered element writes
    f[rng.integers(0, f.shape[0]), :] *= 1.5  # a row
    np.copyto(state["right"][100:200], step)  # through one view: the other sees it
    state["small"][step % 100] = step
    state["t"][:, step % 600] = step
    state["k"] = step
    if step % 3 == 0:  # zeroed without a write: MADV_DONTNEED on whole pages of u
        off = step * BLOCK + 100  # the same bytes in every copy, whatever its alignment
        if zap:
            start = -(-(u.ctypes.data + off) // PAGE) * PAGE
            assert libc.madvise(start, 2 * PAGE, 4) == 0
            zapped[step] = start - u.ctypes.data
        else:
            u.view(np.uint8)[zapped[step] : zapped[step] + 2 * PAGE] = 0
    if step == 4:
        state["u"] = u.copy()  # the same values in new memory


def check_file(path, state: dict) -> None:
    with CheckpointReader(path) as r:
        assert r.verify() == []
        for name in ("u", "f", "left", "right", "small", "t"):
            assert r.rank_array(name, 0).tobytes() == np.ascontiguousarray(state[name]).tobytes()


def test_kernel_detection_writes_the_checkpoints_hashing_writes(tmp_path):
    stores = {
        d: CheckpointStore(tmp_path / d, MPI.COMM_SELF, block_size=BLOCK, change_detection=d)
        for d in ("kernel", "hashes")
    }
    states = {d: make_state() for d in stores}
    methods, zapped = [], {}
    for step in range(1, 12):
        results = {}
        for d, store in stores.items():
            evolve(states[d], step, d == "kernel", zapped)
            results[d] = store.save(step, states[d])
            check_file(results[d].path, states[d])
        k, h = results["kernel"], results["hashes"]
        assert (k.kind, k.dirty_blocks) == (h.kind, h.dirty_blocks), step
        assert h.change_detection == "hashes" and h.tracking_audit is None
        assert k.tracking_audit is None
        methods.append(k.change_detection)
        if k.change_detection == "kernel":
            # "t" (a copy at every save) is hashed in full; so is "u" in new memory (step 4).
            limit = h.bytes_hashed if step == 4 else h.bytes_hashed / 2
            assert k.bytes_hashed < limit, (step, k.bytes_hashed)
            assert k.pages_written > 0
    assert methods[0] == "hashes" and methods.count("kernel") >= 8, methods
    for step in range(1, 12):  # every checkpoint of the chain, both ways, bit for bit
        with CheckpointReader(stores["kernel"].directory / layout.checkpoint_name(step)) as a:
            with CheckpointReader(stores["hashes"].directory / layout.checkpoint_name(step)) as b:
                for name in a.arrays:
                    assert a.rank_array(name, 0).tobytes() == b.rank_array(name, 0).tobytes()
                    assert (a.block_hashes(name, 0) == b.block_hashes(name, 0)).all()


def test_a_failed_save_loses_none_of_the_writes_it_saw(tmp_path):
    store = CheckpointStore(tmp_path, MPI.COMM_SELF, block_size=BLOCK, change_detection="kernel")
    state = {"u": np.random.default_rng(0).random(4 << 17)}
    store.save(1, state)
    state["u"][[10, 300_000]] = -1.0  # seen by the failing save's scan
    # A real failure after the data is written: the final name is taken by a directory
    # that is not empty, so the commit's rename fails.
    blocker = tmp_path / layout.checkpoint_name(2)
    blocker.mkdir()
    (blocker / "x").write_text("x")
    with pytest.raises(CheckpointError, match="committing checkpoint of step 2"):
        store.save(2, state)
    (blocker / "x").unlink()
    blocker.rmdir()
    state["u"][200_000] = -2.0
    res = store.save(3, state)
    assert (res.kind, res.change_detection) == ("incremental", "kernel")
    assert res.dirty_blocks == 3
    check = CheckpointReader(res.path)
    with check:
        assert check.rank_array("u", 0).tobytes() == state["u"].tobytes()


def test_after_a_restore_the_next_saves_are_right(tmp_path):
    store = CheckpointStore(tmp_path, MPI.COMM_SELF, block_size=BLOCK, change_detection="kernel")
    state = {"u": np.random.default_rng(0).random(4 << 17)}
    store.save(1, state)
    state["u"][5] = 1.0
    store.save(2, state)
    state["u"][:] = 0.0  # the run goes on, then restarts from step 2 in the same process
    assert store.restore(state).step == 2
    state["u"][400_000] = 3.0
    first = store.save(3, state)  # what was tracked is moot: hashed
    assert first.change_detection == "hashes" and first.kind == "incremental"
    state["u"][7] = 4.0
    second = store.save(4, state)
    assert second.change_detection == "kernel" and second.dirty_blocks == 1
    for res in (first, second):
        with CheckpointReader(res.path) as r:
            assert r.verify() == []
    with CheckpointReader(second.path) as r:
        assert r.rank_array("u", 0).tobytes() == state["u"].tobytes()


def test_the_self_audit_switches_a_wrong_tracker_off(tmp_path, caplog):
    store = CheckpointStore(
        tmp_path, MPI.COMM_SELF, block_size=BLOCK, change_detection="kernel", max_chain=1
    )
    state = {"u": np.random.default_rng(0).random(4 << 17)}
    assert store.save(1, state).kind == "full"
    state["u"][1000] = 5.0
    res = store.save(2, state)
    assert (res.kind, res.change_detection, res.tracking_audit) == ("incremental", "kernel", None)
    # A full save anyway (the chain holds max_chain deltas) with a correct tracker: silent.
    state["u"][2000] = 6.0
    res = store.save(3, state)
    assert res.kind == "full" and res.tracking_audit is None
    state["u"][3000] = 7.0
    assert store.save(4, state).change_detection == "kernel"
    # Corrupt the tracker: the kernel's report of a write is consumed and forgotten.
    state["u"][300_000] = 8.0
    tracker = store.saver.changes.tracker
    assert tracker is not None
    tracker.candidate_blocks("u", state["u"], BLOCK)
    for region in tracker._regions:
        region.pending[:] = False
    res = store.save(5, state)  # full (chain restart): the audit compares
    assert res.kind == "full" and res.tracking_audit is not None
    assert "'u'" in res.tracking_audit and "kernel reported no write" in res.tracking_audit
    assert "write tracking switched off" in caplog.text
    assert store.saver.changes.tracker is None and store.saver.changes.off == res.tracking_audit
    with CheckpointReader(res.path) as r:  # the full file is right whatever the tracker said
        assert r.rank_array("u", 0).tobytes() == state["u"].tobytes()
    state["u"][9] = 9.0
    after = store.save(6, state)
    assert after.change_detection == "hashes" and after.kind == "incremental"


def test_change_detection_is_checked():
    with pytest.raises(ValueError, match="change_detection must be one of auto, kernel, hashes"):
        CheckpointStore("/tmp/never-made", MPI.COMM_SELF, change_detection="pages")


def test_a_staged_save_in_between_hashes_and_the_chain_stays_right(tmp_path):
    from hpcckpt.store.save.staging import HostBuffers

    store = CheckpointStore(tmp_path, MPI.COMM_SELF, block_size=BLOCK, change_detection="kernel")
    state = {"u": np.random.default_rng(0).random(4 << 17)}
    store.save(1, state)
    state["u"][1] = 1.0
    assert store.save(2, state).change_detection == "kernel"
    state["u"][200_000] = 2.0
    staged = store.finish_save(store.begin_save(3, state, buffers=HostBuffers()))
    assert staged.change_detection == "hashes"  # staged saves copy and hash every byte
    state["u"][400_000] = 3.0
    after = store.save(4, state)  # its parent is the staged one: the tracker's is not
    assert after.change_detection == "hashes" and after.kind == "incremental"
    state["u"][7] = 4.0
    last = store.save(5, state)
    assert last.change_detection == "kernel" and last.dirty_blocks == 1
    for res in (staged, after, last):
        with CheckpointReader(res.path) as r:
            assert r.verify() == []
    with CheckpointReader(last.path) as r:
        assert r.rank_array("u", 0).tobytes() == state["u"].tobytes()


def test_an_array_rewritten_between_saves_is_hashed_for_a_while(tmp_path):
    from hpcckpt.store.save.change_detection import REST_SAVES

    store = CheckpointStore(
        tmp_path, MPI.COMM_SELF, block_size=BLOCK, change_detection="kernel", max_chain=100
    )
    # "sparse" written whole first: pages never written map the zero page, and those
    # count as changed at every save (a zapped page reads the same), so an untouched
    # np.zeros would be found "dense" or not depending on what the allocator reused.
    state = {"dense": np.random.default_rng(0).random(4 << 17), "sparse": np.full(4 << 17, 0.5)}
    store.save(1, state)
    methods = []
    for step in range(2, 4 + REST_SAVES):
        state["dense"] += 1.0  # every page, every step (a stencil sweep)
        state["sparse"][step * 1000] = step
        res = store.save(step, state)
        methods.append(res.change_detection)
        with CheckpointReader(res.path) as r:
            assert r.rank_array("dense", 0).tobytes() == state["dense"].tobytes()
            assert r.rank_array("sparse", 0).tobytes() == state["sparse"].tobytes()
        tracked = store.saver.changes.tracker.tracked
        # Step 2 found "dense" all written: from then on it is not tracked (no page
        # faults for the application) until REST_SAVES saves later it is tried again.
        assert ("dense" in tracked) == (step == 2 + REST_SAVES + 1), (step, tracked)
        assert "sparse" in tracked
    assert set(methods) == {"kernel"}  # "sparse" came from the kernel's pages every time


def test_replicated_arrays_are_checked_and_hashed_not_tracked(tmp_path):
    # A replicated array's hashes come from the check that every rank holds the same
    # bytes (a pass over it at every save anyway): the kernel does not track it.
    store = CheckpointStore(
        tmp_path, MPI.COMM_SELF, block_size=BLOCK, change_detection="kernel", replicated=["model"]
    )
    rng = np.random.default_rng(0)
    state = {"model": rng.random(4 << 17), "u": rng.random(4 << 17)}
    store.save(1, state)
    for step in (2, 3):
        state["model"][step * 70_000] = -step
        state["u"][step * 90_000] = step
        res = store.save(step, state)
        assert (res.kind, res.change_detection, res.dirty_blocks) == ("incremental", "kernel", 2)
        assert store.saver.changes.tracker.tracked == {"u"}
        with CheckpointReader(res.path) as r:
            assert r.verify() == []
            for name in ("model", "u"):
                assert r.rank_array(name, 0).tobytes() == state[name].tobytes()


def test_proc_maps_is_read_only_when_an_array_may_be_tracked(tmp_path, monkeypatch):
    # A small state (arrays under one block, a copy of a transposed view) is never
    # tracked: its saves must not pay a /proc/self/maps read (ms in an MPI process) each.
    from hpcckpt import procfs

    reads = []
    real = procfs.memory_maps
    monkeypatch.setattr(procfs, "memory_maps", lambda: reads.append(1) or real())
    store = CheckpointStore(tmp_path, MPI.COMM_SELF, block_size=BLOCK, change_detection="kernel")
    rng = np.random.default_rng(0)
    state = {"small": rng.random(1000), "t": rng.random((600, 700)).T, "u": rng.random(4 << 17)}
    for step in range(1, 6):
        state["small"][step] = step
        state["u"][step * 1000] = step
        store.save(step, state)
    assert len(reads) == 1  # "u", at its first save
