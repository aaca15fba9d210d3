"""Encoding a state for a save and decoding it at a restore (hpcckpt/store/tree/encoding.py),
agreed by every rank: in one process (MPI.COMM_SELF), then on 2 ranks under real mpirun
where replicated values are stored once."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.agreement import Agreement
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.io import blocks
from hpcckpt.store.options import ArrayOptions
from hpcckpt.store.tree.encoding import Encoded, Encoder
from hpcckpt.store.tree.state_tree import TAG, Targets
from tests.mpi_helpers import mpirun, rank_reports

APP = Path(__file__).parents[1] / "apps" / "encoding_app.py"
BLOCK = 4096


def encoder(**arrays) -> Encoder:
    return Encoder(Agreement(MPI.COMM_SELF), ArrayOptions(**arrays), BLOCK)


# -- encode ----------------------------------------------------------------------------------
def test_encode_gives_the_tree_the_arrays_and_their_bytes():
    u, w = np.arange(100.0), np.ones((3, 4), np.int32)
    got = encoder().encode(5, {"u": u, "nested": {"w": w, "t": 1.5}})
    assert isinstance(got, Encoded)
    assert set(got.arrays) == {"u", "nested/w"} and got.arrays["u"] is u
    assert got.state_bytes == u.nbytes + w.nbytes == 848
    assert got.replicated == set() and got.known_hashes == {} and got.answer is False
    assert got.tree["v"]["nested"]["v"]["t"] == 1.5


@pytest.mark.parametrize("answer", [True, False])
def test_the_callers_answer_rides_along(answer):
    assert encoder().encode(1, {"u": np.zeros(4)}, answer).answer is answer


@pytest.mark.parametrize(
    "value, why",
    [
        ({1, 2}, "state['bad']: set cannot be checkpointed"),
        (np.array(["a", "b"]), "state['bad']: numpy dtype <U1 cannot be checkpointed"),
        ({1: "a", "1": "b"}, "state['bad']: keys 1 and '1' would share the name '1'"),
    ],
)
def test_a_value_that_cannot_be_encoded_is_a_type_error_naming_the_rank_and_path(value, why):
    with pytest.raises(TypeError) as got:
        encoder().encode(9, {"u": np.zeros(3), "bad": value})
    message = str(got.value)
    assert message.startswith(f"encoding the state of step 9 failed (rank 0: TypeError: {why}")
    assert isinstance(got.value.__cause__, TypeError)


def test_replicated_arrays_are_checked_and_hashed_once_here():
    model = {"w": np.linspace(0, 1, 2000), "b": np.ones(8, np.float32)}
    got = encoder(replicated=["model"]).encode(2, {"model": model, "u": np.zeros(10)})
    assert got.replicated == {"model/w", "model/b"}
    assert got.state_bytes == 2000 * 8 + 8 * 4 + 10 * 8, "one rank: counted once, as given"
    assert got.arrays["model/w"] is model["w"], "rank 0 keeps the replicated bytes"
    assert set(got.known_hashes) == {"model/w", "model/b"}
    assert np.array_equal(got.known_hashes["model/w"], blocks.block_hashes(model["w"], BLOCK))


def test_a_replicated_name_not_in_the_state_is_named():
    with pytest.raises(
        CheckpointError, match="replicated names 'modle', which is not in the state"
    ):
        encoder(replicated=["modle"]).encode(2, {"model": np.zeros(3)})


# -- decode ----------------------------------------------------------------------------------
def test_decode_fills_the_applications_state_in_place():
    saved = {"u": np.arange(10.0), "meta": {"k": 3}}
    enc = encoder()
    encoded = enc.encode(1, saved)
    state = {"u": np.zeros(10), "meta": {}}
    u = state["u"]
    enc.decode(state, encoded.tree, encoded.arrays, Targets())
    assert state["u"] is u and np.array_equal(u, saved["u"]) and state["meta"] == {"k": 3}


class Refusing:
    def state_dict(self):
        return {"x": 1}

    def load_state_dict(self, value):
        raise KeyError("no such layer")


@pytest.mark.parametrize(
    "saved, into, why",
    [
        ({"u": np.arange(10.0)}, {"u": np.zeros(4)}, "ValueError: could not broadcast"),
        (
            {"m": Refusing()},
            {"m": Refusing()},
            "CheckpointError: state['m']: Refusing.load_state_dict refused the saved state",
        ),
    ],
)
def test_decode_of_a_tree_that_does_not_fit_fails_on_every_rank(saved, into, why):
    enc = encoder()
    encoded = enc.encode(1, saved)
    with pytest.raises(CheckpointError) as got:
        enc.decode(into, encoded.tree, encoded.arrays, Targets())
    assert re.match(
        rf"loading the restored state failed \(rank 0: {re.escape(why)}", str(got.value)
    )


def test_decode_of_an_unknown_node_fails_alike():
    with pytest.raises(
        CheckpointError, match=r"rank 0: ValueError: unknown node in checkpoint tree: 'nonsense'"
    ):
        encoder().decode({}, {TAG: "nonsense"}, {}, Targets())


# -- two ranks -------------------------------------------------------------------------------
@pytest.mark.mpi
def test_two_ranks_store_replicated_bytes_once_and_fail_together():
    r = mpirun(2, [APP], timeout=120)
    assert r.returncode == 0, r.stderr
    zero, one = rank_reports(r.stdout, 2)
    model_bytes = 1000 * 8 + 24 * 4
    for rep in (zero, one):  # every rank knows the bytes the save stores: the model once
        assert rep["state_bytes"] == model_bytes + 8 * (100 + 110), rep
        assert rep["answer"] is True, "rank 0's answer reaches every rank"
        assert rep["replicated"] == ["model/b", "model/w"]
        assert rep["error"] == (
            "encoding the state of step 4 failed (rank 1: TypeError: state['u']: set cannot "
            "be checkpointed; use numpy arrays, torch tensors, int, float, bool, complex, str, "
            "bytes, None, dict, list, tuple, numpy random generators, or objects with "
            "state_dict()/load_state_dict())"
        )
    assert zero["kept"] == {"model/b": [[24], 96], "model/w": [[1000], 8000], "u": [[100], 800]}
    assert one["kept"] == {"model/b": [[0], 0], "model/w": [[0], 0], "u": [[110], 880]}
    assert zero["known_hashes"] == ["model/b", "model/w"] and zero["hashes_right"]
    assert one["known_hashes"] == []


def test_state_bytes_counts_arrays_tensors_and_state_dicts_without_encoding() -> None:
    import torch

    from hpcckpt.store.tree.encoding import state_bytes

    class Holder:
        def state_dict(self) -> dict:
            return {"w": np.zeros(10, np.float32)}

        def load_state_dict(self, d: dict) -> None:
            pass

    state = {"u": np.zeros((4, 5)), "t": torch.zeros(3, dtype=torch.float64), "h": Holder(),
             "l": [np.zeros(2, np.int8), 7, "x"], "k": 3}  # fmt: skip
    assert state_bytes(state) == 160 + 24 + 40 + 2
    assert state_bytes({}) == 0 and state_bytes(5) == 0
