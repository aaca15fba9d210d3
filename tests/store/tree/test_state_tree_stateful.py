"""Objects with state_dict()/load_state_dict() and non-str dict keys in a state tree:
torch modules, optimizers (int keys, state made by the first step), schedulers, grad
scalers, user classes. torch is required (installed by ``make setup``)."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from hpcckpt.store.store import CheckpointError, CheckpointStore
from hpcckpt.store.tree.state_tree import decode_into, encode


def training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.8, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    return model, opt, sched, scaler


def steps(model, opt, sched, n: int, seed: int = 1) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        x = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(tmp_path / "ck", MPI.COMM_WORLD)


def test_training_objects_round_trip_and_resume_identically(store):
    model, opt, sched, scaler = training()
    steps(model, opt, sched, 3)
    store.save(3, {"model": model, "optim": opt, "sched": sched, "scaler": scaler})
    expected = steps(model, opt, sched, 4, seed=9)

    m2, o2, s2, sc2 = training(seed=5)  # other weights; optimizer state not yet made
    assert o2.state_dict()["state"] == {}
    weight = m2[0].weight
    store.restore({"model": m2, "optim": o2, "sched": s2, "scaler": sc2})
    assert m2[0].weight is weight  # parameters restored in place
    assert set(o2.state_dict()["state"]) == {0, 1, 2, 3, 4, 5}  # int keys, made by restore
    assert o2.state_dict()["param_groups"][0]["betas"] == (0.8, 0.95)  # a tuple again
    assert sc2.get_scale() == 1024.0
    assert steps(m2, o2, s2, 4, seed=9) == expected  # bit-identical continuation


def test_optimizer_state_dict_round_trips_exactly_through_the_tree():
    model, opt, sched, _ = training()
    steps(model, opt, sched, 2)
    saved = opt.state_dict()
    tree, arrays = encode({"o": opt})
    plain = decode_into({}, tree, arrays)["o"]  # no object to load into: the state dict
    assert plain["param_groups"] == saved["param_groups"]
    assert list(plain["state"]) == list(saved["state"])
    for k, st in saved["state"].items():
        for name, value in st.items():
            assert torch.equal(plain["state"][k][name], value), (k, name)
            assert plain["state"][k][name].dtype == value.dtype


def test_mixed_key_types_round_trip_and_colliding_names_are_refused():
    value = {0: "a", 1.5: "b", None: "c", True: "d", "s": {2: [None, (1, 2.0)]}}
    tree, arrays = encode({"v": value})
    assert decode_into({}, tree, arrays)["v"] == value
    with pytest.raises(TypeError, match="would share the name"):
        encode({"v": {1: 1, "1": 2}})


class Counter:
    """A user class following the convention."""

    def __init__(self) -> None:
        self.n, self.loaded = 0, None

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.loaded = state
        self.n = state["n"]


def test_user_stateful_gets_exactly_what_was_saved(store):
    c = Counter()
    c.n = 7
    store.save(1, {"c": c})
    c2 = Counter()
    store.restore({"c": c2})
    assert c2.loaded == {"n": 7} and c2.n == 7


def test_load_state_dict_refusal_is_a_checkpoint_error_naming_the_key(store):
    model, *_ = training()
    store.save(1, {"model": model})
    other = torch.nn.Sequential(torch.nn.Linear(4, 6))
    with pytest.raises(CheckpointError, match=r"holds keys \['model/1.weight', "):
        store.restore({"model": other})  # hpcckpt's own check, before torch's

    class Picky(Counter):
        def load_state_dict(self, state):
            raise ValueError(f"n={state['n']} is not even")

    c = Counter()
    c.n = 7
    store.save(2, {"c": c})
    with pytest.raises(CheckpointError, match=r"state\['c'\]: Picky.load_state_dict refused"):
        store.restore({"c": Picky()})
