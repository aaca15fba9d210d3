"""Where a staged save copies the state (hpcckpt/store/save/staging_modes.py), each mode seen
through ``Saver.begin_save``/``finish_save`` in one process (MPI.COMM_SELF): HostCopy and
Pieces in host memory, NodeLocal and Redrain on the node-local tier. Every committed file
restores bit for bit."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.save import staging_budget
from hpcckpt.store.save.staging import HostBuffers
from hpcckpt.store.store import CheckpointStore
from hpcckpt.store.tier import copies as fast_tier


def random_state(seed: int, count: int = 5000) -> dict:
    """Arbitrary bit patterns (NaN payloads included), and values beside the arrays."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, count * 8, dtype=np.uint8)
    return {
        "u": raw.view(np.float64).reshape(-1, 10),
        "g": {"i": rng.integers(-(2**40), 2**40, 777), "f": rng.random(33).astype(np.float32)},
        "t": 0.25 * seed,
    }


def copy_of(state: dict) -> dict:
    return {
        "u": state["u"].copy(),
        "g": {k: v.copy() for k, v in state["g"].items()},
        "t": state["t"],
    }


def zeros_like(state: dict) -> dict:
    return {
        "u": np.zeros_like(state["u"]),
        "g": {k: np.zeros_like(v) for k, v in state["g"].items()},
        "t": None,
    }


def restores_bit_exactly(directory, step: int, expected: dict) -> None:
    """A new store of ``directory`` (no cache) restores ``step``, bytes as ``expected``."""
    back = zeros_like(expected)
    got = CheckpointStore(directory, MPI.COMM_SELF).restore(back)
    assert got is not None and got.step == step and got.source == "directory"
    assert back["u"].tobytes() == expected["u"].tobytes()
    for k, v in expected["g"].items():
        assert back["g"][k].dtype == v.dtype and back["g"][k].tobytes() == v.tobytes()
    assert back["t"] == expected["t"]


# -- in host memory --------------------------------------------------------------------------
def test_host_copy_stages_a_copy_the_application_may_change_at_once(tmp_path):
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    state = random_state(1)
    saved = copy_of(state)
    buffers = HostBuffers()
    pending = store.saver.begin_save(1, state, buffers=buffers)
    assert pending.staging == "copy"
    nbytes = state["u"].nbytes + sum(v.nbytes for v in state["g"].values())
    assert pending.staging_bytes == buffers.nbytes == nbytes
    state["u"][:] = 0.0  # the application goes on while the bytes are written
    assert not pending.final.exists(), "nothing is committed before finish_save"
    result = store.saver.finish_save(pending)
    assert (result.step, result.staging, result.staging_bytes) == (1, "copy", nbytes)
    assert result.path == store.directory / layout.checkpoint_name(1)
    assert result.blocked_seconds is not None and layout.partials(store.directory) == []
    restores_bit_exactly(store.directory, 1, saved)


def test_pieces_stream_a_state_larger_than_the_budget(tmp_path):
    """The smallest budget a ring takes, and a state larger than it: copied piece by
    piece through the ring, which is all the staging holds."""
    budget = staging_budget.MIN_RING_BYTES
    rng = np.random.default_rng(2)
    big = rng.integers(0, 256, budget + (8 << 20), dtype=np.uint8).view(np.float64)
    state = {"u": big, "g": {"i": np.arange(5), "f": np.ones(3, np.float32)}, "t": 2.0}
    saved = copy_of(state)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    buffers = HostBuffers(budget)
    pending = store.saver.begin_save(2, state, buffers=buffers)
    assert pending.staging == "pieces"
    assert 0 < pending.staging_bytes == buffers.nbytes <= budget < big.nbytes
    big[:] = 0.0  # every piece was copied before begin_save returned
    result = store.saver.finish_save(pending)
    assert (result.staging, result.kind) == ("pieces", "full")
    restores_bit_exactly(store.directory, 2, saved)


# -- on the node-local tier ------------------------------------------------------------------
def test_node_local_seals_a_copy_in_the_cache_then_drains_it(tmp_path, monkeypatch):
    """A full save: the foreground writes the copy; the background thread hashes it and
    seals it before the drain writes a byte of the file (held back here: the copy is
    sealed while nothing is drained yet)."""
    go, hashed_in = _held_writes(monkeypatch)
    cache = tmp_path / "cache"
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=cache)
    state = random_state(3)
    saved = copy_of(state)
    pending = store.saver.begin_save(3, state)
    assert pending.staging is None and pending.staging_bytes == 0
    assert hashed_in <= {"hpcckpt-write"}, "nothing hashed in the foreground"
    assert (cache / fast_tier.data_name(3, 0)).is_file()
    manifest = cache / fast_tier.manifest_name(3, 0)
    time.sleep(0.3)
    assert not manifest.is_file(), "the thread is held until go()"
    pending.go()  # what save() does once its own last work is done
    for _ in range(600):  # the thread seals, then waits for go before writing
        if manifest.is_file():
            break
        time.sleep(0.01)
    assert manifest.is_file(), "sealed before the drain writes"
    assert pending.writer.sealed and os.path.getsize(pending.partial) > 0
    state["u"][:] = 0.0  # the application goes on: the copy is its own
    (copy,) = fast_tier.scan(cache, store.directory, 0, 1)
    assert copy.step == 3 and copy.directory == str(store.directory)
    assert fast_tier.load(copy)["u"].tobytes() == saved["u"].tobytes()  # verifies
    go.set()
    result = store.saver.finish_save(pending)
    assert store.tier.newest_step == 3
    assert result.step == 3 and result.staging is None
    assert not store.tier.holds_newest, "the directory holds step 3 now"
    with CheckpointReader(result.path) as reader:
        assert str(reader.uid) == copy.uid, "the copy and the file are one checkpoint"
    restores_bit_exactly(store.directory, 3, saved)
    again = CheckpointStore(store.directory, MPI.COMM_SELF, cache=cache)
    back = zeros_like(saved)
    assert again.restore(back).source == "directory", "the copy is no newer"


def test_memory_then_local_leaves_the_tier_to_the_thread(tmp_path):
    """A deferred save to the cache with host buffers: save() copies into memory and no
    more (the tier's old copy is still there, the new one not yet); the thread writes the
    tier's copy, hashes it in that pass and seals it; the copy and the file restore alike."""
    cache = tmp_path / "cache"
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=cache)
    buffers = HostBuffers()
    store.saver.finish_save(store.saver.begin_save(1, random_state(1), buffers=buffers))
    assert buffers.nbytes == 0, "the first save goes straight to the tier"
    state = random_state(2)
    saved = copy_of(state)
    pending = store.saver.begin_save(2, state, buffers=buffers)
    assert pending.deferred and pending.staging_bytes == buffers.nbytes > 0
    time.sleep(0.3)
    assert not (cache / fast_tier.data_name(2, 0)).exists(), "the tier's copy: in the thread"
    assert (cache / fast_tier.manifest_name(1, 0)).is_file(), "the old copy: removed there too"
    state["u"][:] = 0.0  # the application goes on at once: the memory copy is its own
    result = store.saver.finish_save(pending)
    assert result.step == 2 and store.tier.newest_step == 2
    assert not (cache / fast_tier.manifest_name(1, 0)).exists()
    (copy,) = fast_tier.scan(cache, store.directory, 0, 1)
    assert copy.step == 2 and fast_tier.load(copy)["u"].tobytes() == saved["u"].tobytes()
    with CheckpointReader(result.path) as reader:
        assert str(reader.uid) == copy.uid, "the copy and the file are one checkpoint"
    restores_bit_exactly(store.directory, 2, saved)


@pytest.fixture
def restored_from_the_tier(tmp_path):
    """A checkpoint of step 5 saved on the tier only, restored by a new store (a restart):
    (that store, the state it restored, the state as saved)."""
    cache = tmp_path / "cache"
    state = random_state(5)
    CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=cache).save_local(5, state)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=cache)
    back = zeros_like(state)
    got = store.restore(back)
    assert (got.step, got.source) == (5, "cache") and store.tier.holds_newest
    assert not (store.directory / layout.checkpoint_name(5)).exists()
    return store, back, state


@pytest.mark.parametrize("given", ["state", "none"])
def test_redrain_drains_the_restored_copy_as_it_is(restored_from_the_tier, given):
    store, back, saved = restored_from_the_tier
    (copy,) = fast_tier.scan(store.tier.path, store.directory, 0, 1)
    manifest = copy.path.read_bytes()
    state = back if given == "state" else None  # None: the copy's own tree and arrays
    pending = store.saver.begin_save(5, state, redrain=True)
    assert pending.staging is None
    result = store.saver.finish_save(pending)
    assert result.step == 5 and not store.tier.holds_newest
    with CheckpointReader(result.path) as reader:
        assert str(reader.uid) == copy.uid, "drained as it is: the copy's own checkpoint"
    assert copy.path.read_bytes() == manifest, "the copy is not written again"
    restores_bit_exactly(store.directory, 5, saved)


def test_redrain_of_a_step_the_tier_does_not_hold_is_refused(restored_from_the_tier, tmp_path):
    store, back, _ = restored_from_the_tier
    with pytest.raises(ValueError, match="nothing to drain again: step 6 is not a node-local copy"):
        store.saver.begin_save(6, back, redrain=True)
    plain = CheckpointStore(tmp_path / "other", MPI.COMM_SELF)  # no tier at all
    with pytest.raises(ValueError, match="nothing to drain again: step 5"):
        plain.saver.begin_save(5, back, buffers=HostBuffers(), redrain=True)
    assert layout.scan(store.directory) == [] and not plain.directory.exists()


# -- one copy in the foreground, the hashes in the background -------------------------------
def _held_writes(monkeypatch):
    """Background writes wait for ``go`` before writing (and record their threads'
    hashing): the test changes the state while nothing is written yet."""
    import threading

    from hpcckpt.store.io import blocks
    from hpcckpt.store.save import background

    go, hashed_in = threading.Event(), set()
    real_write, real_upto = background.write_extents, blocks.BlockHasher.upto
    real_hashes = blocks.block_hashes

    def held(*args, **kwargs):
        assert go.wait(60)
        return real_write(*args, **kwargs)

    def upto(self, nbytes):
        hashed_in.add(threading.current_thread().name)
        return real_upto(self, nbytes)

    def block_hashes(*args, **kwargs):
        hashed_in.add(threading.current_thread().name)
        return real_hashes(*args, **kwargs)

    monkeypatch.setattr(background, "write_extents", held)
    monkeypatch.setattr(blocks.BlockHasher, "upto", upto)
    monkeypatch.setattr(blocks, "block_hashes", block_hashes)
    return go, hashed_in


def test_a_full_staged_save_copies_once_and_hashes_in_the_background(tmp_path, monkeypatch):
    """Without a checkpoint to compare with, begin_save copies the state and nothing
    more; the background thread hashes the copy while writing it, before the commit:
    the committed file verifies and the next save is a delta of it."""
    from hpcckpt.store.io import blocks
    from hpcckpt.store.save import staging

    go, hashed_in = _held_writes(monkeypatch)
    copied = []
    real_copy_and_hash = staging.copy_and_hash
    monkeypatch.setattr(
        staging, "copy_and_hash", lambda *a: copied.append(1) or real_copy_and_hash(*a)
    )
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, block_size=4096, min_delta_saving=0)
    state = random_state(5, count=100000)
    saved = copy_of(state)
    buffers = HostBuffers()
    pending = store.saver.begin_save(1, state, buffers=buffers)
    assert copied == [] and hashed_in == set(), "nothing hashed in the foreground"
    state["u"][:] = -1.0  # the application goes on before a byte is written
    state["g"]["i"][:] = 7
    go.set()
    result = store.saver.finish_save(pending)
    assert hashed_in == {"hpcckpt-write"}
    assert (result.kind, result.staging) == ("full", "copy")
    with CheckpointReader(result.path) as reader:
        assert reader.verify() == []
    restores_bit_exactly(store.directory, 1, saved)
    last = store.saver.last
    assert np.array_equal(last.hashes["u"], blocks.block_hashes(saved["u"], 4096))

    # A delta of it, staged after the first: copied alone; the save's own thread hashes
    # the copy and compares, before it plans the file (store/save/deferred.py).
    state = copy_of(saved)
    state["u"][3, :] = 1.0
    hashed_in.clear()
    pending = store.saver.begin_save(2, state, buffers=buffers)
    assert copied == [], "nothing hashed in the foreground"
    result = store.saver.finish_save(pending)
    assert hashed_in == {"hpcckpt-save"}
    assert result.kind == "incremental" and result.dirty_blocks == 1
    restores_bit_exactly(store.directory, 2, state)


def test_torch_cpu_tensors_are_copied_once_and_kept_at_their_values(tmp_path, monkeypatch):
    """A CPU tensor is staged by one copy of its memory (no host copy made before
    staging); changed in place right after begin_save, the checkpoint keeps the values
    at begin_save."""
    import torch

    go, _ = _held_writes(monkeypatch)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, incremental=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(300, 200)
    state = {"model": model, "x": torch.randn(1000, dtype=torch.float64)}
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x_before = state["x"].clone()
    buffers = HostBuffers()
    pending = store.saver.begin_save(1, state, buffers=buffers)
    assert buffers.nbytes == sum(t.numel() * t.element_size() for t in before.values()) + 8000
    with torch.no_grad():
        model.weight.mul_(-3.0)
        model.bias.fill_(0.5)
        state["x"].zero_()
    go.set()
    store.saver.finish_save(pending)
    back = {"model": torch.nn.Linear(300, 200), "x": torch.zeros(1000, dtype=torch.float64)}
    assert CheckpointStore(store.directory, MPI.COMM_SELF).restore(back).step == 1
    for k, v in back["model"].state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(back["x"], x_before)


def test_after_a_delta_that_did_not_pay_the_next_saves_go_full_hashed_later(tmp_path, monkeypatch):
    """Every block changed: the save compared with its parent and the chain policy wrote
    it full; the next FULL_AFTER_CHANGED staged saves skip the comparison (full, hashed
    while written); the one after compares again and writes a delta. A save compares
    by hashing before it writes: in the foreground (the first staged save) or in the
    save's thread (the later ones), never in the writing thread."""
    import threading

    from hpcckpt.store.io import blocks
    from hpcckpt.store.save import commit, staging

    copied, hashed = [], []
    real_copy_and_hash, real_hashes = staging.copy_and_hash, blocks.block_hashes
    monkeypatch.setattr(
        staging, "copy_and_hash", lambda *a: copied.append(1) or real_copy_and_hash(*a)
    )

    def block_hashes(*args, **kwargs):
        hashed.append(threading.current_thread().name)
        return real_hashes(*args, **kwargs)

    monkeypatch.setattr(blocks, "block_hashes", block_hashes)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, block_size=4096, min_delta_saving=0)
    buffers = HostBuffers()
    state = random_state(6, count=20000)

    def save(step: int) -> tuple[str, bool, str | None]:
        copied.clear()
        hashed.clear()
        result = store.saver.finish_save(store.saver.begin_save(step, state, buffers=buffers))
        return result.kind, bool(copied) or "hpcckpt-save" in hashed, result.full_reason

    assert save(1)[:2] == ("full", False)  # nothing to compare with
    state["u"][:] = np.random.default_rng(9).random(state["u"].shape)  # every block changes
    state["g"]["i"][:] += 1
    state["g"]["f"][:] += 1
    kind, compared, why = save(2)
    assert (kind, compared) == ("full", True) and "max_chain_fraction" in why
    for step in range(3, 3 + commit.FULL_AFTER_CHANGED):
        state["u"][0, 0] = step
        assert save(step)[:2] == ("full", False)
    state["u"][0, 0] = -1.0
    step = 3 + commit.FULL_AFTER_CHANGED
    assert save(step)[:2] == ("incremental", True)
    restores_bit_exactly(store.directory, step, state)


@pytest.mark.mpi
def test_a_copy_failing_on_one_rank_fails_the_staged_save_on_every_rank(tmp_path):
    """In host memory a failed copy is agreed on with the file's creation (no collective
    of its own): every rank raises the same error naming the rank, no file is left, and
    the next staged save commits and restores exactly."""
    from pathlib import Path

    from tests.mpi_helpers import mpirun, rank_reports

    app = Path(__file__).parents[1] / "apps" / "stage_fail_app.py"
    r = mpirun(3, [app, tmp_path / "ck"], timeout=180)
    assert r.returncode == 0, r.stderr
    reports = rank_reports(r.stdout, 3)
    for rep in reports:
        assert rep["raised"] is not None and "rank 1" in rep["raised"], rep
        assert "staging checkpoint of step 1 in memory" in rep["raised"], rep
        assert "MemoryError" in rep["raised"] or "no memory" in rep["raised"], rep
        assert rep["left"] == [], rep
        assert rep["committed"] == layout.checkpoint_name(2)
        assert rep["restored"] == 2 and rep["exact"]
    assert len({rep["raised"] for rep in reports}) == 1
