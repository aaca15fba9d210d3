"""Large slices go to HDF5 in pieces (its mpio driver refuses a single write of >= 2 GiB)."""

from __future__ import annotations

import h5py
import numpy as np
from mpi4py import MPI

from hpcckpt.store import checkpoint_file
from hpcckpt.store.store import CheckpointStore


def test_write_pieces_covers_every_row_once(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_file, "WRITE_PIECE_BYTES", 1000)
    data = np.arange(7 * 33, dtype=np.float64).reshape(33, 7)  # 56 bytes a row: 17 rows a piece
    calls = []
    with h5py.File(tmp_path / "f.h5", "w") as f:
        d = f.create_dataset("x", shape=(40, 7), dtype=np.float64, fillvalue=-1.0)
        real = type(d).__setitem__

        class Spy(type(d)):
            def __setitem__(self, key, value):
                calls.append(key)
                real(self, key, value)

        d.__class__ = Spy
        checkpoint_file.write_pieces(d, 5, data)
        out = f["x"][:]
    assert len(calls) == 2
    assert np.array_equal(out[5:38], data) and (out[:5] == -1).all() and (out[38:] == -1).all()


def test_save_and_restore_through_small_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_file, "WRITE_PIECE_BYTES", 4096)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    state = {"u": np.random.default_rng(3).random((1000, 9)), "v": np.arange(50_000)}
    store.save(1, state)
    target = {"u": np.zeros((1000, 9)), "v": np.zeros(50_000, dtype=state["v"].dtype)}
    assert store.restore(target).step == 1
    assert np.array_equal(target["u"], state["u"]) and np.array_equal(target["v"], state["v"])
