"""Replicated values on one rank: declaration errors, the file's attributes, verification.
(Several ranks: tests/store/tree/test_replicated_mpi.py.)"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.store import CheckpointError, CheckpointStore
from hpcckpt.store.tree.replicated import covers, normalize


def test_names_are_key_paths():
    assert normalize(["model", "/optim/", "model"]) == ("model", "optim")
    assert normalize("model") == ("model",)
    with pytest.raises(ValueError, match="key paths"):
        normalize([""])
    assert covers(("model",), "model/0.weight") and covers(("model",), "model")
    assert not covers(("model",), "models/x")


def test_a_name_not_in_the_state_is_an_error_naming_it(tmp_path):
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_WORLD, replicated=["modle"])
    with pytest.raises(
        CheckpointError, match="replicated names 'modle', which is not in the state"
    ):
        store.save(1, {"model": np.ones(3)})


def test_distributed_and_replicated_at_once_is_refused(tmp_path):
    with pytest.raises(ValueError, match="both distributed and replicated"):
        CheckpointStore(tmp_path / "ck", MPI.COMM_WORLD, distributed=["u"], replicated=["u"])


def test_a_corrupt_replicated_array_is_detected_and_skipped(tmp_path):
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_WORLD, replicated=["table"])
    store.save(1, {"table": np.arange(1000.0)})
    store.save(2, {"table": np.arange(1000.0) + 1})
    path = tmp_path / "ck" / "ckpt-0000000002.h5"
    with CheckpointReader(path) as r:
        assert r.arrays["table"].replicated and r.replicated("table")
        assert r.verify() == []
    with h5py.File(path, "r+") as f:
        f["state/table"][10] = -1.0
    state = {"table": np.zeros(1000)}
    result = store.restore(state)
    assert result.step == 1 and result.skipped and "checksum" in result.skipped[0][1]
    assert np.array_equal(state["table"], np.arange(1000.0))
