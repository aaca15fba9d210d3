"""Device-side change detection, run on CPU tensors (the algorithm is the same torch code
on any device; benchmarks/gpu_delta_check.py runs it on a GPU): the checksums against a
numpy reference, the changes they must catch, partial copies, and saves through a chain
restored bit-identically."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io import blocks
from hpcckpt.store.save.device_checksums import (
    DENSE,
    REST_SAVES,
    WHOLE_BELOW,
    DeviceChecksums,
    _weights,
    block_checksums,
)
from hpcckpt.store.save.staging import HostBuffers
from hpcckpt.store.store import CheckpointStore
from hpcckpt.store.tree import devices

BLOCK = 4096  # small blocks: many of them in small tensors
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int64]


def reference(t: torch.Tensor, step: int) -> np.ndarray:
    """The sums of the module's docstring, in numpy's wrapping uint64 arithmetic."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    weights = _weights("cpu", -(-step // 4)).numpy().astype(np.uint64)
    out = []
    for a in range(0, raw.size, step):
        b = raw[a : a + step]
        b = np.concatenate([b, np.zeros(-b.size % 4, np.uint8)])
        w = b.view("<i4").astype(np.int64).astype(np.uint64)
        out.append([(w * weights[k][: w.size]).sum(dtype=np.uint64) for k in range(3)])
    return np.array(out, dtype=np.uint64).reshape(-1, 3)


def values(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def sums(t: torch.Tensor) -> np.ndarray:
    return block_checksums(t, BLOCK).numpy().view(np.uint64)


@pytest.mark.parametrize("dtype", DTYPES + [torch.bool, torch.uint8])
def test_the_checksums_are_the_documented_sums(dtype):
    t = torch.rand(3 * BLOCK + 7) > 0.5 if dtype == torch.bool else values((3 * BLOCK + 7,), dtype)
    step = blocks.block_elems(t.element_size(), BLOCK) * t.element_size()
    got = block_checksums(t, step).numpy().view(np.uint64)
    assert got.shape == (blocks.nblocks(t.numel() * t.element_size(), step), 3)
    assert np.array_equal(got, reference(t, step))


def test_empty_and_zero_dim_tensors():
    assert tuple(block_checksums(torch.empty(0)).shape) == (0, 3)
    assert tuple(block_checksums(torch.empty(4, 0, dtype=torch.bfloat16)).shape) == (0, 3)
    one = torch.tensor(2.5)
    assert np.array_equal(
        block_checksums(one, BLOCK).numpy().view(np.uint64), reference(one, BLOCK)
    )


def test_a_non_contiguous_tensor_has_the_checksums_of_its_c_order_copy():
    base = values((64, 96), torch.bfloat16, 3)
    for view in (base.T, base[:, 1::3], base[5:, 7:]):
        assert not view.is_contiguous()
        assert np.array_equal(sums(view), sums(view.contiguous()))


def changed_blocks(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    return set(np.flatnonzero((sums(before) != sums(after)).any(axis=1)).tolist())


def block_of(t: torch.Tensor, index: int) -> int:
    return index * t.element_size() // BLOCK


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_single_bit_flip_is_caught(dtype):
    t = values((2 * BLOCK,), dtype, 1)
    bits = t.element_size() * 8
    raw = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    rng = np.random.default_rng(0)
    for index in rng.integers(0, t.numel(), 8).tolist():
        for bit in range(bits):
            flipped = t.clone()
            word = flipped.view(raw)
            word[index] ^= torch.tensor(1, dtype=raw) << bit
            assert changed_blocks(t, flipped) == {block_of(t, index)}, (index, bit)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swaps_sign_flips_and_shifts_are_caught(dtype):
    t = values((3 * BLOCK,), dtype, 2)
    rng = np.random.default_rng(1)
    per_block = BLOCK // t.element_size()
    for _ in range(40):
        i, j = sorted(rng.choice(per_block, 2, replace=False).tolist())
        i, j = i + per_block, j + per_block  # both in block 1
        if torch.equal(t[i], t[j]):
            continue
        swapped = t.clone()
        swapped[i], swapped[j] = t[j], t[i]
        assert changed_blocks(t, swapped) == {1}, (i, j)
    for i, j in [(per_block, per_block + 1), (2 * per_block - 2, 2 * per_block - 1)]:
        swapped = t.clone()  # neighbours: within one word for small elements
        swapped[i], swapped[j] = t[j], t[i]
        assert torch.equal(t[i], t[j]) or changed_blocks(t, swapped) == {1}
    if dtype.is_floating_point:
        negated = t.clone()
        negated[per_block + 5] = -t[per_block + 5]
        assert changed_blocks(t, negated) == {1}
    shifted = t.clone()
    shifted[per_block + 1 : 2 * per_block] = t[per_block : 2 * per_block - 1].clone()
    assert changed_blocks(t, shifted) == {1}


def copy_of(checks: DeviceChecksums, t: torch.Tensor, host: torch.Tensor | None = None):
    host = torch.empty(t.shape, dtype=t.dtype) if host is None else host
    checks.copy(t, host)
    return host


@pytest.mark.parametrize("dtype", DTYPES)
def test_only_the_changed_blocks_are_copied(dtype):
    checks = DeviceChecksums(on_cpu=True, block_bytes=BLOCK, whole_below=0)
    t = values((200 * BLOCK // values((1,), dtype).element_size(),), dtype, 4)
    checks.begin()
    host = copy_of(checks, t)
    assert checks.copied.blocks == checks.copied.total == 200
    assert checks.copied.bytes == t.numel() * t.element_size()
    assert torch.equal(host.view(torch.uint8), t.view(torch.uint8))

    checks.begin()
    copy_of(checks, t, host)
    assert (checks.copied.blocks, checks.copied.bytes, checks.copied.total) == (0, 0, 200)

    per_block = BLOCK // t.element_size()
    changed = [3, 77, 150]  # 1.5 % of the blocks
    for b in changed:
        t[b * per_block + 11] = t[b * per_block + 12] if dtype != torch.int8 else t[0] + 1
    stale = host.clone()
    checks.begin()
    copy_of(checks, t, host)
    assert checks.copied.blocks == len(set(changed) & changed_blocks(stale, t)) == 3
    assert checks.copied.bytes == 3 * BLOCK
    assert torch.equal(host.view(torch.uint8), t.view(torch.uint8))


def test_a_full_save_copies_every_byte_and_refreshes_the_checksums():
    checks = DeviceChecksums(on_cpu=True, block_bytes=BLOCK, whole_below=0)
    t = values((10 * BLOCK,), torch.float32, 5)
    checks.begin()
    host = copy_of(checks, t)
    host[0] = 99.0  # the host copy damaged: a comparing copy cannot see it
    checks.begin()
    copy_of(checks, t, host)
    assert checks.copied.blocks == 0 and host[0] == 99.0
    checks.begin("all")
    copy_of(checks, t, host)
    assert checks.copied.blocks == checks.copied.total and torch.equal(host, t)


def test_exact_hashing_asked_for_copies_every_byte_without_checksums(monkeypatch):
    checks = DeviceChecksums(on_cpu=True, block_bytes=BLOCK, whole_below=0)
    with pytest.raises(ValueError, match="copies must be one of changed, all, off"):
        checks.begin("some")
    t = values((10 * BLOCK,), torch.float32, 11)
    host = torch.empty_like(t)
    computed = []
    monkeypatch.setattr(
        "hpcckpt.store.save.device_checksums.block_checksums",
        lambda flat, step: computed.append(step) or block_checksums(flat, step),
    )
    for _ in range(2):
        checks.begin("off")
        copy_of(checks, t, host)
        assert checks.copied.blocks == checks.copied.total == 40 and torch.equal(host, t)
    assert computed == []  # no kernels run
    counts = []
    for _ in range(2):  # comparing again: the first has no sums to compare with
        checks.begin("changed")
        copy_of(checks, t, host)
        counts.append(checks.copied.blocks)
    assert counts == [40, 0] and len(computed) == 2


def test_non_contiguous_empty_and_resized_tensors():
    checks = DeviceChecksums(on_cpu=True, block_bytes=BLOCK, whole_below=0)
    base = values((256, 64), torch.bfloat16, 6)
    view = base.T  # not contiguous: its C order is not its storage's
    checks.begin()
    host = copy_of(checks, view)
    assert torch.equal(host.view(torch.int16), view.contiguous().view(torch.int16))
    base[100, 3] = 7.0  # view[3, 100]
    checks.begin()
    copy_of(checks, view, host)
    assert checks.copied.blocks == 1
    assert torch.equal(host.view(torch.int16), view.contiguous().view(torch.int16))

    z = torch.randn(3000, dtype=torch.complex64)
    conj = z.conj()  # a conjugate view: its values, not its storage, are copied
    checks.begin()
    zhost = copy_of(checks, conj)
    assert torch.equal(zhost.resolve_conj(), z.conj().resolve_conj()) and not zhost.is_conj()
    z[2999] = 5.0
    checks.begin()
    copy_of(checks, conj, zhost)
    assert checks.copied.blocks == 1 and torch.equal(zhost, z.conj().resolve_conj())

    empty = torch.empty(0, 5)
    checks.begin()
    copy_of(checks, empty)
    assert checks.copied.blocks == checks.copied.total == checks.copied.bytes == 0

    small = values((3 * BLOCK // 4,), torch.float32, 7)  # 3 blocks
    checks.begin()
    host = copy_of(checks, small)
    grown = torch.cat([small, small[:100]])  # a new shape: a new buffer, copied whole
    checks.begin()
    grown_host = copy_of(checks, grown)
    assert checks.copied.blocks == checks.copied.total == 4
    assert torch.equal(grown_host, grown)
    checks.begin()
    copy_of(checks, small[: small.numel()].clone(), host)  # the old buffer: still known
    assert checks.copied.blocks == 0


def test_small_tensors_are_copied_whole_and_stay_exact():
    checks = DeviceChecksums(on_cpu=True, block_bytes=BLOCK)  # default whole_below
    assert checks.whole_below == WHOLE_BELOW == 256 << 10 and checks.block_bytes == BLOCK
    assert DeviceChecksums().block_bytes == 1 << 20  # the documented block
    small = values((WHOLE_BELOW // 4 - 1,), torch.float32, 9)
    host = torch.empty_like(small)
    for _ in range(2):
        checks.begin()
        copy_of(checks, small, host)
        assert (
            checks.copied.blocks == checks.copied.total == blocks.nblocks(small.numel() * 4, BLOCK)
        )
    array = host.numpy()
    small[5] = 1.0
    checks.begin()
    copy_of(checks, small, host)
    assert torch.equal(host, small)
    assert np.array_equal(checks.hashes(array, BLOCK), blocks.block_hashes(array, BLOCK))


def test_a_tensor_rewritten_between_saves_is_copied_whole_for_a_while():
    assert (DENSE, REST_SAVES) == (0.5, 4)  # as docs/torch.md says
    checks = DeviceChecksums(on_cpu=True, block_bytes=BLOCK, whole_below=0)
    t = values((40 * BLOCK // 4,), torch.float32, 10)
    checks.begin()
    host = copy_of(checks, t)
    copied = []
    for _ in range(REST_SAVES + 4):
        t.neg_()  # every block
        checks.begin()
        copy_of(checks, t, host)
        assert torch.equal(host, t)
        copied.append(checks.copied.blocks)
    assert copied == [40] * (REST_SAVES + 4)
    found = []  # one block changed per save: copied whole until the rest is over
    for _ in range(REST_SAVES + 2):
        t[3] += 1.0
        checks.begin()
        copy_of(checks, t, host)
        assert torch.equal(host, t)
        found.append(checks.copied.blocks)
    assert found[-1] == 1 and set(found) == {40, 1}


@pytest.mark.parametrize("block_size", [BLOCK // 2 * 2, 1024 * 16, 4096 * 3])
def test_host_hashes_are_recomputed_only_where_bytes_were_copied(block_size):
    checks = DeviceChecksums(on_cpu=True, block_bytes=8192, whole_below=0)
    t = values((40_000,), torch.float32, 8)
    checks.begin()
    host = copy_of(checks, t)
    array = host.numpy()
    assert np.array_equal(checks.hashes(array, block_size), blocks.block_hashes(array, block_size))
    for index in (0, 2047, 2048, 20_000, 39_999):
        t[index] += 1.0
        checks.begin()
        copy_of(checks, t, host)
        got = checks.hashes(array, block_size)
        assert np.array_equal(got, blocks.block_hashes(t.numpy(), block_size)), index
    assert checks.hashes(np.zeros(4), block_size) is None  # not a buffer it copied into


# -- through the store: staged saves, the chain, the restore -------------------------------
class Model(torch.nn.Module):
    """A frozen backbone and a trained head, small: the fine-tuning the path is for."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
        self.head = torch.nn.Linear(128, 8, dtype=torch.bfloat16)
        self.backbone.requires_grad_(False)


def state_bytes(state) -> dict[str, bytes]:
    return {
        k: v.detach().contiguous().view(torch.uint8).numpy().tobytes() for k, v in state.items()
    }


def test_staged_saves_copy_only_changed_blocks_and_restore_bit_identically(tmp_path):
    torch.manual_seed(0)
    model = Model()
    checks = DeviceChecksums(on_cpu=True, block_bytes=BLOCK, whole_below=0)
    buffers = HostBuffers(checks=checks)
    store = CheckpointStore(tmp_path, MPI.COMM_SELF, block_size=BLOCK, min_delta_saving=0)
    state = model.state_dict()
    total = sum(blocks.nblocks(v.numel() * v.element_size(), BLOCK) for v in state.values())

    first = store.finish_save(store.begin_save(1, state, buffers=buffers))
    assert first.kind == "full" and checks.copied.blocks == total
    second = store.finish_save(store.begin_save(2, state, buffers=buffers))
    assert second.kind == "incremental" and second.dirty_blocks == 0
    assert checks.copied.blocks == 0 and checks.copied.bytes == 0

    with torch.no_grad():
        model.head.weight.add_(1.0)  # the head trains: its block changes, nothing else
        model.backbone[2].weight[7, 7] = -model.backbone[2].weight[7, 7]
    third = store.finish_save(store.begin_save(3, state, buffers=buffers))
    assert third.kind == "incremental" and third.dirty_blocks == 2
    assert checks.copied.blocks == 2 and checks.copied.bytes <= 2 * BLOCK
    with CheckpointReader(third.path) as r:
        assert r.verify() == []
    want = state_bytes(state)

    fresh = Model()
    restored = fresh.state_dict()
    assert CheckpointStore(tmp_path, MPI.COMM_SELF).restore(restored).step == 3
    assert state_bytes(restored) == want


def test_without_device_comparison_every_byte_is_copied(tmp_path):
    torch.manual_seed(1)
    state = Model().state_dict()
    checks = DeviceChecksums(on_cpu=True, block_bytes=BLOCK, whole_below=0)
    buffers = HostBuffers(checks=checks)
    total = sum(blocks.nblocks(v.numel() * v.element_size(), BLOCK) for v in state.values())
    exact = CheckpointStore(
        tmp_path / "exact",
        MPI.COMM_SELF,
        block_size=BLOCK,
        change_detection="hashes",
        min_delta_saving=0,
    )
    exact.finish_save(exact.begin_save(1, state, buffers=buffers))
    again = exact.finish_save(exact.begin_save(2, state, buffers=buffers))
    assert again.kind == "incremental" and checks.copied.blocks == total

    chained = CheckpointStore(
        tmp_path / "chain", MPI.COMM_SELF, block_size=BLOCK, max_chain=1, min_delta_saving=0
    )
    kinds, copied = [], []
    for step in range(1, 5):
        res = chained.finish_save(chained.begin_save(step, state, buffers=buffers))
        kinds.append(res.kind)
        copied.append(checks.copied.blocks)
    # A save full by count copies every byte (and refreshes the checksums); deltas none.
    assert kinds == ["full", "incremental", "full", "incremental"]
    assert copied == [total, 0, total, 0]


def test_device_tensors_alone_take_the_path_numpy_and_cpu_tensors_stay_exact(tmp_path):
    buffers = HostBuffers()  # the default: device tensors only
    assert not buffers.checks.on_cpu and buffers.checks.applies(torch.ones(1, device="meta"))
    assert not buffers.checks.applies(torch.ones(1))
    store = CheckpointStore(tmp_path, MPI.COMM_SELF, block_size=BLOCK, min_delta_saving=0)
    state = {"t": torch.arange(5000.0), "a": np.arange(5000.0)}
    store.finish_save(store.begin_save(1, state, buffers=buffers))
    state["t"][3] = -1.0
    state["a"][4000] = -1.0
    res = store.finish_save(store.begin_save(2, state, buffers=buffers))
    assert res.dirty_blocks == 2 and buffers.checks.copied.tensors == 0


def test_a_store_that_never_saves_deltas_runs_no_checksum_kernels(tmp_path, monkeypatch):
    torch.manual_seed(2)
    state = Model().state_dict()
    checks = DeviceChecksums(on_cpu=True, block_bytes=BLOCK, whole_below=0)
    buffers = HostBuffers(checks=checks)
    computed = []
    monkeypatch.setattr(
        "hpcckpt.store.save.device_checksums.block_checksums",
        lambda flat, step: computed.append(step) or block_checksums(flat, step),
    )
    total = sum(blocks.nblocks(v.numel() * v.element_size(), BLOCK) for v in state.values())
    store = CheckpointStore(tmp_path, MPI.COMM_SELF, block_size=BLOCK, incremental=False)
    for step in (1, 2):
        res = store.finish_save(store.begin_save(step, state, buffers=buffers))
        assert res.kind == "full" and checks.copied.blocks == total
    assert computed == []  # nothing would ever compare them
    fresh = Model().state_dict()
    assert CheckpointStore(tmp_path, MPI.COMM_SELF).restore(fresh).step == 2
    assert state_bytes(fresh) == state_bytes(state)


def test_without_a_comparison_the_copy_is_issued_before_the_checksums(monkeypatch):
    checks = DeviceChecksums(on_cpu=True, block_bytes=BLOCK, whole_below=0)
    t = values((10 * BLOCK,), torch.float32, 13)
    order = []
    real_runs = devices.copy_runs
    monkeypatch.setattr(
        "hpcckpt.store.save.device_checksums.block_checksums",
        lambda flat, step: order.append("sums") or block_checksums(flat, step),
    )
    monkeypatch.setattr(
        "hpcckpt.store.tree.devices.copy_runs",
        lambda flat, host, runs: order.append("copy") or real_runs(flat, host, runs),
    )
    checks.begin("all")
    host = copy_of(checks, t)
    assert order == ["copy", "sums"] and torch.equal(host, t)
    order.clear()
    checks.begin("changed")  # a comparison needs the sums before it copies
    with torch.no_grad():
        t[5] = -t[5]
    copy_of(checks, t, host)
    assert order == ["sums", "copy"] and torch.equal(host, t) and checks.copied.blocks == 1
