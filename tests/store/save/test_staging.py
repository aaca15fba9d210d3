"""Host buffers of saves that finish in the background: copy+hash, reused buffers, budget."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hpcckpt.store.io import blocks
from hpcckpt.store.save.staging import HostBuffers, copy_and_hash

BLOCK = 4096


def random_array(shape, dtype, seed: int = 0) -> np.ndarray:
    """Arbitrary bit patterns (NaN payloads included for floats); 0/1 for bool."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        return (rng.integers(0, 2, count) == 1).reshape(shape)
    raw = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def c_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


# -- copy_and_hash -------------------------------------------------------------------------
SOURCES = {
    "f8-3-blocks-and-a-bit": lambda: random_array((3 * 512 + 100,), "f8", 1),
    "f4-2d": lambda: random_array((77, 129), "f4", 2),
    "i2-exact-blocks": lambda: random_array((2 * 2048,), "i2", 3),
    "c16-transposed": lambda: random_array((40, 33), "c16", 4).T,
    "u1-strided": lambda: random_array((50, 300), "u1", 5)[::3, 7:-5],
    "i8-reversed": lambda: random_array((5000,), "i8", 6)[::-1],
    "bool-fortran": lambda: np.asfortranarray(random_array((90, 111), "?", 7)),
    "f8-one-element": lambda: random_array((1,), "f8", 8),
    "f8-0d": lambda: np.array(3.25),
    "f8-empty": lambda: np.empty((0,), "f8"),
    "i4-empty-2d": lambda: np.empty((4, 0), "i4"),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_copy_and_hash_copies_bit_exactly_and_hashes_like_block_hashes(name):
    src = SOURCES[name]()
    before = c_bytes(src)
    dst = np.empty(src.shape, dtype=src.dtype)
    hashes = copy_and_hash(src, dst, BLOCK)
    assert dst.flags.c_contiguous
    assert dst.tobytes() == before  # C-order bytes, bit for bit
    assert c_bytes(src) == before  # the source is untouched
    expected = blocks.block_hashes(src, BLOCK)
    assert hashes.dtype == np.uint64
    assert hashes.shape == expected.shape
    assert np.array_equal(hashes, expected)
    nbytes = src.size * src.dtype.itemsize
    step = blocks.block_elems(src.dtype.itemsize, BLOCK) * src.dtype.itemsize
    assert len(hashes) == -(-nbytes // step)


@pytest.mark.parametrize("block_size", [4096, 4096 + 16, 65536])
def test_copy_and_hash_block_sizes(block_size):
    src = random_array((3 * 65536 // 8 + 3,), "f8", 9)
    dst = np.empty_like(src)
    hashes = copy_and_hash(src, dst, block_size)
    assert np.array_equal(hashes, blocks.block_hashes(src, block_size))
    assert dst.tobytes() == src.tobytes()


def test_copy_and_hash_detects_one_changed_element():
    src = random_array((4 * 512,), "f8", 10)
    dst = np.empty_like(src)
    first = copy_and_hash(src, dst, BLOCK)
    src[512 * 2 + 5] += 1.0
    second = copy_and_hash(src, dst, BLOCK)
    assert [j for j in range(4) if first[j] != second[j]] == [2]


# -- HostBuffers ---------------------------------------------------------------------------
def test_host_buffers_reuse_the_same_buffer_while_shape_and_dtype_stay():
    hb = HostBuffers()
    u = random_array((1000,), "f8", 11)
    v = random_array((30, 40), "i4", 12)
    copies, hashes = hb.stage({"u": u, "g/v": v}, BLOCK)
    assert set(copies) == set(hashes) == {"u", "g/v"}
    assert copies["u"] is not u and copies["u"].tobytes() == u.tobytes()
    assert copies["g/v"].tobytes() == v.tobytes()
    assert np.array_equal(hashes["u"], blocks.block_hashes(u, BLOCK))
    assert hb.nbytes == u.nbytes + v.nbytes
    first_u, first_v = copies["u"], copies["g/v"]

    u[:] += 1.0  # the application goes on: the staged copy must not follow
    assert first_u.tobytes() != u.tobytes()

    copies, hashes = hb.stage({"u": u, "g/v": v}, BLOCK)
    assert copies["u"] is first_u and copies["g/v"] is first_v  # reused, not reallocated
    assert copies["u"].tobytes() == u.tobytes()
    assert np.array_equal(hashes["u"], blocks.block_hashes(u, BLOCK))
    assert hb.nbytes == u.nbytes + v.nbytes
    held = hb.copies()  # the buffers kept for the next save, by path
    assert held.keys() == {"u", "g/v"} and held["u"] is first_u and held["g/v"] is first_v


@pytest.mark.parametrize(
    "new",
    [
        lambda: random_array((1001,), "f8", 13),  # other shape
        lambda: random_array((1000,), "f4", 14),  # other dtype, other size
        lambda: random_array((1000,), "c8", 15),  # same bytes, other dtype
        lambda: random_array((10, 100), "f8", 16),  # same size, other shape
    ],
)
def test_host_buffers_replace_a_buffer_whose_shape_or_dtype_changed(new):
    hb = HostBuffers()
    u = random_array((1000,), "f8", 17)
    old = hb.stage({"u": u}, BLOCK)[0]["u"]
    src = new()
    copies, hashes = hb.stage({"u": src}, BLOCK)
    assert copies["u"] is not old
    assert copies["u"].shape == src.shape and copies["u"].dtype == src.dtype
    assert copies["u"].tobytes() == src.tobytes()
    assert np.array_equal(hashes["u"], blocks.block_hashes(src, BLOCK))
    assert hb.nbytes == src.nbytes  # the old buffer is not kept beside the new one


def test_host_buffers_drop_arrays_that_disappear_and_release():
    hb = HostBuffers()
    a, b = random_array((100,), "f8", 18), random_array((200,), "i2", 19)
    hb.stage({"a": a, "b": b}, BLOCK)
    copies, hashes = hb.stage({"a": a}, BLOCK)
    assert set(copies) == set(hashes) == {"a"}
    assert hb.nbytes == a.nbytes
    again = hb.stage({"a": a, "b": b}, BLOCK)[0]
    assert again["b"].tobytes() == b.tobytes()
    assert hb.nbytes == a.nbytes + b.nbytes
    hb.release()
    assert hb.nbytes == 0
    assert hb.stage({}, BLOCK) == ({}, {})


# -- one copy, no hashes; buffers lent to device-to-host copies ---------------------------
def test_host_buffers_without_hashes_copy_once_and_reuse(monkeypatch):
    from hpcckpt.store.save import staging

    monkeypatch.setattr(staging, "copy_and_hash", lambda *a: pytest.fail("hashed while staged"))
    hb = HostBuffers()
    u = random_array((3 << 20) // 8, "f8", 30)  # large: a mapped buffer of its own
    v = random_array((7, 9), "i2", 31)[::2]  # small, strided
    copies, hashes = hb.stage({"u": u, "v": v}, BLOCK, hashed=False)
    assert hashes == {}
    assert copies["u"].tobytes() == u.tobytes() and copies["v"].tobytes() == c_bytes(v)
    assert copies["u"].flags.c_contiguous and copies["u"].flags.writeable
    assert not np.shares_memory(copies["u"], u)
    first = copies["u"]
    u[:] = 0.0  # the application goes on
    assert first.tobytes() != u.tobytes()
    again, _ = hb.stage({"u": u, "v": v}, BLOCK, hashed=False)
    assert again["u"] is first and again["u"].tobytes() == u.tobytes()
    assert hb.nbytes == hb.peak == u.nbytes + v.nbytes


@pytest.mark.parametrize(
    "shape,dtype", [(((3 << 20) // 8,), "f8"), ((0,), "f8"), ((5, 700000), "i2")], ids=str
)
def test_new_buffer_is_a_writable_c_contiguous_array(shape, dtype):
    from hpcckpt.store.save.staging import new_buffer

    buf = new_buffer(shape, np.dtype(dtype))
    assert buf.shape == shape and buf.dtype == np.dtype(dtype)
    assert buf.flags.c_contiguous and buf.flags.writeable
    buf[...] = 3
    assert int(buf.sum(dtype=np.int64)) == 3 * buf.size


def test_lent_host_tensors_are_the_staged_copies_kept_between_saves():
    """A device tensor's copy lands in a buffer lent by HostBuffers (what to_host does
    with a CUDA tensor inside ``lending``): stage takes it as it is, no second copy; the
    same buffers are lent again at the next save, in the order asked; a buffer the next
    save does not ask for is freed."""
    import torch

    from hpcckpt.store.tree import tensors

    hb = HostBuffers()
    like = {"w": torch.ones(64, 32), "b": torch.ones(32, dtype=torch.bfloat16)}

    def one_save(k: float, names):
        with hb.lending():
            lent = {n: hb.lend(like[n]) for n in names}
        for host in lent.values():
            host.fill_(k)
        arrays = {n: tensors.to_array(h) for n, h in lent.items()}
        arrays["cpu"] = np.full(10, k)
        copies, hashes = hb.stage(arrays, BLOCK, hashed=True)
        for n in names:
            assert np.shares_memory(copies[n], arrays[n])  # the copy itself, not another
            assert np.array_equal(hashes[n], blocks.block_hashes(arrays[n], BLOCK))
        assert not np.shares_memory(copies["cpu"], arrays["cpu"])
        return lent, copies

    lent1, _ = one_save(1.0, ["w", "b"])
    assert hb.nbytes == 64 * 32 * 4 + 32 * 2 + 80 == hb.lent_bytes + 80
    lent2, copies = one_save(2.0, ["w", "b"])
    assert all(lent2[n] is lent1[n] for n in lent1)  # reused, not reallocated
    assert float(copies["w"][0, 0]) == 2.0
    one_save(3.0, ["w"])
    assert hb.lent_bytes == 64 * 32 * 4  # b's buffer was not asked for: freed
    hb.release()
    assert hb.nbytes == 0


def test_lending_stops_at_the_budget():
    import torch

    hb = HostBuffers(budget=1000)
    with hb.lending():
        assert hb.lend(torch.ones(100, dtype=torch.float64)) is not None  # 800 bytes
        assert hb.lend(torch.ones(100, dtype=torch.float64)) is None  # 1600: its own
    assert hb.nbytes == hb.peak == 800 <= hb.budget


def test_staging_memory_never_passes_the_state_while_shapes_change():
    """The peak of the buffers: the old buffer of an array whose shape changed is freed
    before the new one is allocated, so the staging holds at most the larger state."""
    hb = HostBuffers()
    a, b = random_array((40000,), "f8", 32), random_array((30000,), "f4", 33)
    hb.stage({"a": a, "b": b}, BLOCK, hashed=False)
    hb.reset_peak()
    a2 = random_array((50000,), "f8", 34)
    hb.stage({"a": a2, "b": b}, BLOCK, hashed=False)
    assert hb.peak == hb.nbytes == a2.nbytes + b.nbytes


# -- memory reserved ahead of the first save ---------------------------------------------
def _self_comm():
    from mpi4py import MPI

    from hpcckpt.store.comm import as_comm

    return as_comm(MPI.COMM_SELF)


def test_reserved_memory_is_populated_in_the_background_and_becomes_the_first_buffers():
    """reserve (a restore) maps the first save's buffers and populates them in a thread;
    that save carves its buffers out of them (no new map), copies exact values, and the
    staging never holds more than the reservation, which is the state's page-rounded size."""
    from hpcckpt.store.save import staging

    u = random_array((3 << 20) // 8, "f8", 40)
    w = random_array((5 << 20) // 4 + 3, "f4", 41)  # not a page multiple
    small = random_array((100,), "i8", 42)
    state = {"model": {"u": u, "w": w}, "step": 3, "small": small}
    assert staging.host_array_sizes(state) == [u.nbytes, w.nbytes]
    hb = HostBuffers()
    reserved = hb.reserve(state, _self_comm())
    assert reserved == u.nbytes + (-(-w.nbytes // 4096) * 4096)
    assert hb.local_ranks == 1 and hb.nbytes == hb.peak == reserved
    hb._arena.thread.join(30)
    assert not hb.reserving
    hb.reset_peak()
    real_new_buffer = staging.new_buffer
    try:
        staging.new_buffer = lambda shape, dtype: pytest.fail("mapped anew despite the reserve")
        copies, _ = hb.stage({"u": u, "w": w}, BLOCK, hashed=False)
    finally:
        staging.new_buffer = real_new_buffer
    assert copies["u"].tobytes() == u.tobytes() and copies["w"].tobytes() == w.tobytes()
    assert not np.shares_memory(copies["u"], u) and not np.shares_memory(copies["u"], copies["w"])
    assert copies["u"].flags.c_contiguous and copies["w"].flags.writeable
    assert hb.peak == hb.nbytes == reserved
    u[:] = -1.0  # the application goes on: the staged copy keeps the values at save()
    assert copies["u"].tobytes() != u.tobytes()
    again, _ = hb.stage({"u": u, "w": w}, BLOCK, hashed=False)
    assert again["u"] is copies["u"] and again["u"].tobytes() == u.tobytes()
    hb.release()
    assert hb.nbytes == 0


def test_a_reservation_goes_once_its_arrays_are_gone_and_is_never_made_twice():
    u = random_array((3 << 20) // 8, "f8", 43)
    hb = HostBuffers()
    assert hb.reserve({"u": u}, _self_comm()) == u.nbytes
    assert hb.reserve({"u": u}, _self_comm()) == 0  # one already there
    hb.stage({"u": u}, BLOCK, hashed=False)
    assert hb.reserve({"u": u}, _self_comm()) == 0  # buffers exist: nothing to reserve
    bigger = random_array((4 << 20) // 8, "f8", 44)
    hb.reset_peak()
    copies, _ = hb.stage({"u": bigger}, BLOCK, hashed=False)  # shape changed
    assert copies["u"].tobytes() == bigger.tobytes()
    assert hb._arena is None and hb.nbytes == hb.peak == bigger.nbytes  # old one freed first


def test_a_reservation_unused_by_the_saved_arrays_is_freed_at_the_first_save():
    hb = HostBuffers()
    assert hb.reserve({"u": random_array((3 << 20) // 8, "f8", 45)}, _self_comm()) > 0
    small = random_array((10,), "f8", 46)
    hb.stage({"s": small}, BLOCK, hashed=False)
    assert hb._arena is None and hb.nbytes == small.nbytes


def test_no_reservation_beyond_the_budget_or_without_large_arrays():
    u = random_array((3 << 20) // 8, "f8", 47)
    hb = HostBuffers(budget=u.nbytes - 1)
    assert hb.reserve({"u": u}, _self_comm()) == 0
    assert hb.nbytes == 0 and hb._arena is None
    assert HostBuffers().reserve({"s": np.zeros(10), "t": 1.5}, _self_comm()) == 0


def test_release_waits_for_the_populating_thread_and_frees_the_reservation():
    hb = HostBuffers()
    hb.reserve({"u": np.zeros((64 << 20) // 8)}, _self_comm())
    thread = hb._arena.thread
    hb.release()
    assert not thread.is_alive() and hb.nbytes == 0 and not hb.reserving


def test_host_array_sizes_counts_cpu_tensors_and_stateful_objects():
    import torch

    from hpcckpt.store.save.staging import host_array_sizes

    model = torch.nn.Linear(1024, 1024)  # a 4 MiB weight, a 4 KiB bias
    t = torch.zeros(3 << 20, dtype=torch.uint8)
    assert sorted(host_array_sizes({"m": model, "t": [t]})) == [3 << 20, 4 << 20]


def test_a_reservation_being_populated_is_taken_for_others_and_held_for_itself(monkeypatch):
    """While its arena is populated, the process's available memory drops by it (another
    reservation must not count it as free), but the buffers' own plans do not count it
    twice: it is already in what they hold."""
    from mpi4py import MPI

    from hpcckpt.store.comm import as_comm
    from hpcckpt.store.io import memory
    from hpcckpt.store.save import staging

    monkeypatch.setattr(memory, "_meminfo", lambda field: 4 << 30)
    monkeypatch.setattr(memory, "cgroup_room", lambda: None)
    go = threading.Event()
    monkeypatch.setattr(staging, "_populate", lambda area: go.wait(10))
    buffers = HostBuffers()
    assert buffers.reserve({"u": np.zeros(1 << 20)}, as_comm(MPI.COMM_SELF)) == 8 << 20
    assert memory.available_bytes() == (4 << 30) - (8 << 20)
    assert buffers.available() == 4 << 30
    go.set()
    buffers.release()  # joins nothing it need not; the promise is settled by the thread
    for _ in range(500):
        if memory.available_bytes() == 4 << 30:
            break
        time.sleep(0.01)
    assert memory.available_bytes() == 4 << 30


def test_buffers_for_device_tensors_are_made_ahead_and_lent_to_the_first_save():
    """reserve makes the host buffers lent to device tensors' copies in a thread (pinned
    for CUDA; here CPU tensors on the device path), counted in the staging's bytes; the
    first save lends exactly those (no allocation in it) and copies exact values."""
    import torch

    from hpcckpt.store.save import staging
    from hpcckpt.store.save.device_checksums import DeviceChecksums
    from hpcckpt.store.tree.encoding import encode_local

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 32))
    state = {"model": model, "extra": [torch.arange(7.0)], "n": 4}
    like = staging.device_tensors(state, cpu=True)
    assert [tuple(t.shape) for t in like] == [(32, 64), (32,), (32, 32), (32,), (7,)]
    assert staging.device_tensors(state) == []  # nothing on a device
    hb = HostBuffers(checks=DeviceChecksums(on_cpu=True, whole_below=0))
    want = sum(t.numel() * t.element_size() for t in like)
    assert hb.reserve(state, _self_comm()) == want
    assert hb.nbytes == want
    made = {id(t) for t in hb._pinning.take().values() for t in t}
    assert len(made) == 5 and not hb.reserving
    real_empty_host = staging.devices.empty_host
    try:
        staging.devices.empty_host = lambda t: pytest.fail("allocated in the save")
        with hb.lending("all"):
            local = encode_local(state)
    finally:
        staging.devices.empty_host = real_empty_host
    assert {id(t) for t in hb.lent_buffers} == made and hb.nbytes == want
    for name, value in model.state_dict().items():
        assert local.arrays[f"model/{name}"].tobytes() == value.detach().numpy().tobytes()
    assert hb.reserve(state, _self_comm()) == 0  # lent buffers exist: nothing made twice
    hb.release()
    assert hb.nbytes == 0 and hb.lent_buffers == []


def test_no_buffers_are_made_ahead_past_the_budget():
    import torch

    from hpcckpt.store.save.device_checksums import DeviceChecksums

    state = {"w": torch.ones(1 << 16)}  # 256 KiB
    hb = HostBuffers(budget=100 << 10, checks=DeviceChecksums(on_cpu=True))
    assert hb.reserve(state, _self_comm()) == 0 and hb.nbytes == 0


class _Memory:
    """The memory as a fake ``/proc/meminfo`` (no cgroup) reports it, and its readings."""

    def __init__(self, monkeypatch) -> None:
        from hpcckpt.store.io import memory

        self.free = 8 << 30
        self.reads: list[str] = []
        monkeypatch.setattr(memory, "_meminfo", self._read)
        monkeypatch.setattr(memory, "cgroup_room", lambda: None)

    def _read(self, field: str) -> int:
        self.reads.append(field)
        return self.free


def test_the_default_budget_is_fixed_by_the_first_plan_and_held_buffers_stay_within_it(
    monkeypatch,
):
    """Buffers reserved within the default budget stay within it when other memory is
    taken later (another tier's files): the budget is the one of the first plan, and a
    later plan still copies whole while the memory is there, or goes through pieces
    when it is not."""
    from mpi4py import MPI

    from hpcckpt.store.comm import as_comm
    from hpcckpt.store.save import staging_budget

    mem = _Memory(monkeypatch)
    buffers = HostBuffers()
    assert buffers.planned_budget is None
    state = {"u": np.zeros(256 << 17)}  # 256 MiB
    assert buffers.reserve(state, as_comm(MPI.COMM_SELF)) == 256 << 20
    assert buffers.planned_budget == 4 << 30  # half the 8 GiB available
    buffers.stage(state, 1 << 20, hashed=False)
    mem.free = 200 << 20  # others took the memory: 200 MiB left besides ours
    later = buffers.plan(256 << 20, 1)
    assert (later.mode, later.budget) == (staging_budget.COPY, 4 << 30)
    assert buffers.nbytes <= later.budget
    mem.free = 0  # nothing left but what the buffers hold: a ring within them
    short = buffers.plan(256 << 20, 1)
    assert short.mode == staging_budget.PIECES
    assert short.staging_bytes <= buffers.nbytes
    buffers.release()
    given = HostBuffers(budget=1 << 30)
    assert given.plan(256 << 20, 1).budget == given.planned_budget == 1 << 30


def test_a_look_in_the_background_spares_the_next_plan_its_memory_reading(monkeypatch):
    """look() (run by a save's background thread) reads the memory; the next plan that
    needs no more than the buffers hold then copies whole without reading it; when the
    memory ran short the next plan reads it again and plans anew (here: synchronous)."""
    from mpi4py import MPI

    from hpcckpt.store.comm import as_comm
    from hpcckpt.store.save import staging_budget

    mem = _Memory(monkeypatch)
    reads = mem.reads
    buffers = HostBuffers()
    state = {"u": np.zeros(32 << 17)}  # 32 MiB
    buffers.reserve(state, as_comm(MPI.COMM_SELF))
    buffers.stage(state, 1 << 20, hashed=False)
    mem.free = 100 << 20
    buffers.look()
    reads.clear()
    assert buffers.plan(32 << 20, 1).mode == staging_budget.COPY
    assert reads == []  # taken from the look
    assert buffers.plan(32 << 20, 1).mode == staging_budget.COPY
    assert reads  # one look, one plan: this one read the memory
    reads.clear()
    buffers.look()
    assert buffers.plan(64 << 20, 1).mode == staging_budget.COPY
    assert reads  # more than the buffers hold: read again
    mem.free = 0
    buffers.look()  # what they hold is no longer planned whole (the writer's reserve)
    reads.clear()
    assert buffers.plan(32 << 20, 1).mode == staging_budget.SYNC
    assert reads
    buffers.release()


def test_a_look_for_a_cache_plans_both_copies(monkeypatch):
    """A cache's save plans twice its arrays (its host copy and the tier's): look(copies=2)
    spares that plan its memory reading when both fit, and not when only one does."""
    from mpi4py import MPI

    from hpcckpt.store.comm import as_comm
    from hpcckpt.store.save import staging_budget

    mem = _Memory(monkeypatch)
    reads = mem.reads
    buffers = HostBuffers()
    state = {"u": np.zeros(32 << 17)}  # 32 MiB
    buffers.reserve(state, as_comm(MPI.COMM_SELF), copies=2)
    buffers.stage(state, 1 << 20, hashed=False)
    buffers.look()  # one copy's worth only
    reads.clear()
    assert buffers.plan(64 << 20, 1).mode == staging_budget.COPY
    assert reads  # both copies: read again
    buffers.look(copies=2)
    reads.clear()
    assert buffers.plan(64 << 20, 1).mode == staging_budget.COPY
    assert reads == []  # taken from the look
    mem.free = 40 << 20  # room for the held copy and a little more, not a second
    buffers.look(copies=2)
    reads.clear()
    assert buffers.plan(64 << 20, 1).mode != staging_budget.COPY
    assert reads
    buffers.release()
