"""The store's front (hpcckpt/store/store.py) in one process (MPI.COMM_SELF): how it is
set up, what it refuses, and a save and restore through it end to end.

The rooms behind it have their own modules: test_commit.py (the commit protocol),
test_restore.py (which checkpoint), test_load.py (reading into the application's arrays)."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror.backend import DirectoryBackend
from hpcckpt.store.options import IncrementalOptions, StoreOptions
from hpcckpt.store.save.staging import HostBuffers
from hpcckpt.store.store import MIRRORED, STAGING_REFUSED, CheckpointStore, PendingSave
from tests.mpi_helpers import wait_for


def test_save_commits_atomically_and_restore_takes_newest(store, make_state):
    for step in (10, 20):
        res = store.save(step, make_state(step))
        assert res.path.name == layout.checkpoint_name(step) and res.bytes_written >= 8000
    assert [e.step for e in layout.scan(store.directory)] == [20, 10]
    assert layout.partials(store.directory) == []
    state = make_state(0)
    buf = state["u"]
    got = store.restore(state)
    assert got.step == 20 and state["u"] is buf
    assert np.array_equal(buf, np.arange(1000.0) * 20) and state["meta"]["k"] == 20


def test_file_is_readable_with_plain_h5py(store, make_state):
    store.save(3, make_state(3))
    with h5py.File(store.directory / layout.checkpoint_name(3), "r") as f:
        assert f["meta"].attrs["format"] == "hpcckpt" and f["meta"].attrs["step"] == 3
        assert np.array_equal(f["state/u"][:], np.arange(1000.0) * 3)
        offs = f["meta/rank_tree"].attrs["offsets"]
        tree = json.loads(f["meta/rank_tree"][offs[0] : offs[1]].tobytes())
        assert tree["v"]["meta"]["v"]["k"] == 3


@pytest.mark.parametrize("count", [90, 350])
def test_a_model_sized_state_of_many_arrays_restores(tmp_path, count):
    """90 (or 350) arrays named like a model's layers, one in three of 1024 float32 and
    the rest of 64: their attribute strings fill an HDF5 global heap collection to within
    8 bytes of its end. Restore used to take that sound file for damaged and mark it bad."""
    state = {f"layer{i}": np.full(64 if i % 3 else 1024, i, np.float32) for i in range(count)}
    CheckpointStore(tmp_path, MPI.COMM_SELF).save(1, state)
    out = {k: np.empty_like(v) for k, v in state.items()}
    result = CheckpointStore(tmp_path, MPI.COMM_SELF).restore(out)
    assert result is not None and result.step == 1
    assert all(np.array_equal(out[k], state[k]) for k in state)
    assert not list(tmp_path.glob("*.bad"))


# -- how the store is set up -----------------------------------------------------------------
def test_keywords_set_the_options_and_options_are_taken_whole(tmp_path):
    keyworded = CheckpointStore(tmp_path / "a", MPI.COMM_SELF, block_size=8192, incremental=False)
    assert keyworded.options.incremental == IncrementalOptions(block_size=8192, incremental=False)
    assert keyworded.saver.block_size == 8192 and keyworded.tier is None
    options = StoreOptions(incremental=IncrementalOptions(max_chain=2))
    given = CheckpointStore(tmp_path / "b", MPI.COMM_SELF, options)
    assert given.options is options and given.saver.chain_policy.max_chain == 2
    assert given.directory == (tmp_path / "b").absolute()
    assert given.saver.agreement is given.agreement is given.restorer.agreement


def test_options_and_keywords_together_are_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="options or keywords, not both"):
        CheckpointStore(tmp_path, MPI.COMM_SELF, StoreOptions(), block_size=8192)


def test_a_misspelt_keyword_is_named_with_the_nearest_one(tmp_path):
    with pytest.raises(TypeError) as got:
        CheckpointStore(tmp_path, MPI.COMM_SELF, blok_size=4096)
    message = str(got.value)
    assert "CheckpointStore() got an unexpected keyword argument 'blok_size'" in message
    assert "did you mean 'block_size'?" in message
    with pytest.raises(TypeError, match="'no_such_option'$"):  # nothing near: no guess
        CheckpointStore(tmp_path, MPI.COMM_SELF, no_such_option=1)


def test_save_local_without_a_cache_names_cache(store, make_state):
    with pytest.raises(ValueError, match="cache"):
        store.save_local(1, make_state(1))
    assert not store.directory.exists(), "nothing was written"


def test_a_staged_save_needs_a_staging_area(tmp_path, store, make_state):
    with pytest.raises(ValueError, match="needs a staging area: host buffers"):
        store.begin_save(1, make_state(1))  # neither buffers nor a cache
    assert not store.directory.exists()


def test_a_cache_with_buffers_copies_later_saves_into_memory_then_the_tier(tmp_path, make_state):
    cached = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=tmp_path / "cache")
    buffers = HostBuffers()
    first = cached.begin_save(1, make_state(1), buffers=buffers)
    assert first.staging_bytes == 0 and buffers.nbytes == 0, "the first: straight to the tier"
    cached.finish_save(first)
    for step in (2, 3):
        pending = cached.begin_save(step, make_state(step), buffers=buffers)
        assert pending.deferred and pending.staging_bytes == buffers.nbytes > 0
        assert cached.finish_save(pending).tier == "directory"
    assert cached.tier is not None and cached.tier.newest_step == 3
    shutil.rmtree(cached.directory)  # the node-local copy, sealed, restores alone
    fresh = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=tmp_path / "cache")
    state = make_state(0)
    assert fresh.restore(state).step == 3
    np.testing.assert_array_equal(state["u"], make_state(3)["u"])


@pytest.mark.parametrize("budget", [1024, 12_000])
def test_a_cache_whose_budget_holds_not_both_copies_copies_straight_into_the_tier(
    tmp_path, make_state, budget
):
    """The state's 8000 bytes: its host copy and the tier's would take 16000."""
    cached = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, cache=tmp_path / "cache")
    buffers = HostBuffers(budget=budget)
    for step in (1, 2, 3):
        pending = cached.begin_save(step, make_state(step), buffers=buffers)
        assert pending.staging_bytes == 0 and buffers.nbytes == 0, "no host copy held"
        assert cached.finish_save(pending).tier == "directory"
    assert pending.deferred, "the later saves still block for their copy only"
    assert cached.tier is not None and cached.tier.newest_step == 3


def test_restore_takes_a_dict_and_only_by_key(store, make_state):
    store.save(1, make_state(1))
    with pytest.raises(TypeError, match="state must be a dict, not list"):
        store.restore([np.zeros(1000)])
    state = make_state(0)
    assert store.restore(state, only="meta").step == 1
    assert state["meta"]["k"] == 1 and not state["u"].any(), "only 'meta' was read"


# -- retention after a commit, in the background ---------------------------------------------
def test_a_background_prune_leaves_what_a_synchronous_one_leaves(tmp_path, make_state):
    stores = [CheckpointStore(tmp_path / n, MPI.COMM_SELF, incremental=False) for n in "ab"]
    for step in range(1, 6):
        for store in stores:
            store.save(step, make_state(step))
    layout.mark_bad(stores[0].directory / layout.checkpoint_name(2), "test")
    layout.mark_bad(stores[1].directory / layout.checkpoint_name(2), "test")
    background, synchronous = stores
    assert background.prune(keep_last=2, background=True) == []  # at once, not collective
    deleted = synchronous.prune(keep_last=2)
    assert [p.name for p in deleted] == [layout.checkpoint_name(s) for s in (1, 3)]
    assert [e.step for e in background.entries()] == [5, 4, 2]  # entries() waits for it
    assert [e.step for e in layout.scan(synchronous.directory)] == [5, 4, 2]
    background.prune(keep_last=1, background=True)
    background.close()  # waits for the prune
    assert [e.step for e in layout.scan(background.directory)] == [5, 2], "bad ones stay"


@pytest.mark.parametrize("call", ["save", "checkpoint", "restore", "entries", "prune", "close"])
def test_the_store_waits_for_a_background_prune_before_touching_its_checkpoints(
    store, make_state, call
):
    """A save, a restore, a listing, a prune or close() starts only once rank 0's prune
    under way has ended: none of them sees a prune half done (a file it is deleting)."""
    store.save(1, make_state(1))
    gate, order = threading.Event(), []
    store.pruning.start(lambda: (gate.wait(10), order.append("prune")), "test")
    threading.Timer(0.3, gate.set).start()
    t0 = time.monotonic()
    {
        "save": lambda: store.save(2, make_state(2)),
        "checkpoint": lambda: store.checkpoint(2, make_state(2), "steps"),
        "restore": lambda: store.restore(make_state(0)),
        "entries": store.entries,
        "prune": lambda: store.prune(keep_last=1),
        "close": store.close,
    }[call]()
    assert order == ["prune"] and time.monotonic() - t0 >= 0.25
    assert not store.pruning.running


def test_a_background_prune_keeps_what_is_on_its_way_to_the_mirror(tmp_path):
    """The checkpoints being copied and queued when the prune is asked for stay, as with
    a synchronous prune."""
    root = tmp_path / "m"
    root.mkdir()
    store = CheckpointStore(
        tmp_path / "ck", MPI.COMM_SELF, incremental=False, mirror=str(root), mirror_bandwidth=2e6
    )
    try:
        big = np.random.default_rng(6).random(500_000)  # 4 MB: 2 s to the mirror
        store.save(1, {"u": big + 1})
        wait_for(lambda: any(root.iterdir()), 30, "the copy of step 1 under way")
        for step in (2, 3):
            store.save(step, {"u": big + step})
        assert store.mirroring.protected() == {1, 3}
        store.prune(keep_last=1, background=True)
        assert [e.step for e in store.entries()] == [3, 1]
    finally:
        store.close()


# -- the mirror: the store copies its commits ------------------------------------------------
def test_a_store_with_a_mirror_copies_its_commits_and_keeps_them_until_verified(tmp_path):
    """A bare store with a directory mirror: each commit goes to rank 0's mirror thread;
    pruning keeps the checkpoint being copied and the one queued, and after the wait the
    newest is verified on the mirror and the directory may let the others go."""
    root = tmp_path / "m"
    root.mkdir()
    reports: list[tuple[str, dict]] = []
    store = CheckpointStore(
        tmp_path / "ck", MPI.COMM_SELF, incremental=False, mirror=str(root),
        mirror_bandwidth=2e6, report=lambda kind, fields: reports.append((kind, fields)),
    )  # fmt: skip
    try:
        big = np.random.default_rng(5).random(500_000)  # 4 MB: 2 s to the mirror
        store.save(1, {"u": big + 1})
        wait_for(lambda: any(root.iterdir()), 30, "the copy of step 1 under way")
        for step in (2, 3):
            store.save(step, {"u": big + step})
        assert store.mirroring.protected() == {1, 3}, "1 is being copied, 3 waits, 2 was passed"
        assert [p.name for p in store.prune(keep_last=1)] == [layout.checkpoint_name(2)]
        assert [e.step for e in layout.scan(store.directory)] == [3, 1]
        waited = store.mirror_wait(60)
        assert waited is not None and waited.done and waited.step == 3
        backend = DirectoryBackend(root)
        assert [m.step for m in mirror.list_mirrored(backend) if m.good] == [3, 1]
        assert all(mirror.verify_mirrored(backend, str(s)).good for s in (1, 3))
        assert [f["step"] for kind, f in reports if kind == MIRRORED] == [1, 3]
        store.prune(keep_last=1)  # both are on the mirror now: the directory lets 1 go
        assert [e.step for e in layout.scan(store.directory)] == [3]
    finally:
        store.close()
    assert store.mirroring is None and store.mirror_wait(1) is None


def test_a_store_without_a_mirror_has_nothing_to_wait_for(store, make_state):
    store.save(1, make_state(1))
    assert store.mirroring is None and store.mirror_wait(1) is None
    store.close()  # nothing to stop; the store still works
    assert store.restore(make_state(0)).step == 1


# -- one entry for every kind of save ---------------------------------------------------------
def test_checkpoint_takes_the_path_its_inputs_choose(tmp_path, make_state):
    reports: list[tuple[str, dict]] = []
    store = CheckpointStore(
        tmp_path / "ck", MPI.COMM_SELF, report=lambda kind, fields: reports.append((kind, fields))
    )
    synchronous = store.checkpoint(1, make_state(1), "steps")
    assert not isinstance(synchronous, PendingSave) and synchronous.tier == "directory"
    buffers = HostBuffers()
    staged = store.checkpoint(2, make_state(2), "interval", buffers=buffers)
    assert isinstance(staged, PendingSave) and staged.step == 2
    assert store.finish_save(staged).path.name == layout.checkpoint_name(2)
    on_stop = store.checkpoint(3, make_state(3), "signal", stop=True, buffers=buffers)
    assert not isinstance(on_stop, PendingSave), "a stop's checkpoint is written at once"
    with h5py.File(on_stop.path, "r") as f:
        assert f["meta"].attrs["reason"] == "signal"
    local = store.checkpoint(4, make_state(4), "steps", local=True)  # no tier: the directory
    assert local.tier == "directory" and reports == []
    cached = CheckpointStore(tmp_path / "ck2", MPI.COMM_SELF, cache=tmp_path / "cache")
    on_tier = cached.checkpoint(5, make_state(5), "steps", local=True)
    assert on_tier.tier == "cache" and not cached.directory.exists()
    drained = cached.checkpoint(6, make_state(6), "steps")  # staged into the tier's files
    assert isinstance(drained, PendingSave)
    assert cached.finish_save(drained).tier == "directory"


def test_checkpoint_writes_synchronously_when_staging_is_refused(tmp_path, make_state, caplog):
    reports: list[tuple[str, dict]] = []
    store = CheckpointStore(
        tmp_path / "ck", MPI.COMM_SELF, report=lambda kind, fields: reports.append((kind, fields))
    )
    buffers = HostBuffers(budget=1024)  # under the smallest ring: save synchronously
    logger = logging.getLogger("hpcckpt.store")  # its parent may not propagate (a Checkpointer)
    logger.addHandler(caplog.handler)
    try:
        result = store.checkpoint(1, make_state(1), "interval", buffers=buffers)
    finally:
        logger.removeHandler(caplog.handler)
    assert not isinstance(result, PendingSave) and result.path.exists()
    ((kind, fields),) = reports
    assert kind == STAGING_REFUSED and fields["step"] == 1
    assert fields["reason"].startswith("rank 0: ") and buffers.nbytes == 0
    assert f"checkpoint step 1 written synchronously: {fields['reason']}" in caplog.messages


class GateProbe:
    """A value with ``state_dict()``, which the store calls while it encodes a save: it
    notes whether the mirror's gate is held then, and raises when told to."""

    def __init__(self, store: CheckpointStore, fail: bool = False) -> None:
        self.store, self.fail, self.seen = store, fail, []

    def state_dict(self) -> dict:
        self.seen.append(self.store.mirroring.gate.held)
        if self.fail:
            raise RuntimeError("the application's state_dict() failed")
        return {"w": np.arange(1000.0)}

    def load_state_dict(self, values: dict) -> None:
        pass


def test_every_save_holds_the_mirror_copy_aside_and_releases_it_even_when_it_fails(tmp_path):
    """Rank 0's mirror copy steps aside while a checkpoint is written: the synchronous
    save, the staged save until its background write ends, and its commit hold the
    gate; a save that raises releases it, and a later copy goes through."""
    root = tmp_path / "m"
    root.mkdir()
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, incremental=False, mirror=str(root))
    gate = store.mirroring.gate
    try:
        probe = GateProbe(store)
        store.save(1, {"p": probe})
        store.checkpoint(2, {"p": probe}, "steps")
        assert probe.seen == [True, True] and not gate.held
        buffers = HostBuffers()
        pending = store.begin_save(3, {"p": probe, "u": np.ones(2_000_000)}, buffers=buffers)
        assert probe.seen[-1] is True
        assert gate.held or pending.done(), "held until the background write ends"
        pending.writer.wait()
        wait_for(lambda: not gate.held, 10, "the gate released after the background write")
        store.finish_save(pending)
        assert not gate.held
        for kind in ("save", "checkpoint", "begin_save"):
            failing = GateProbe(store, fail=True)
            with pytest.raises(RuntimeError, match="state_dict"):
                if kind == "save":
                    store.save(4, {"p": failing})
                elif kind == "checkpoint":
                    store.checkpoint(4, {"p": failing}, "steps")
                else:
                    store.begin_save(4, {"p": failing}, buffers=buffers)
            assert failing.seen == [True] and not gate.held, kind
        with pytest.raises(TypeError):
            store.save(4, {"x": object()})
        assert not gate.held
        store.save(5, {"p": probe})
        waited = store.mirror_wait(60)
        assert waited is not None and waited.done and waited.step == 5
    finally:
        store.close()
