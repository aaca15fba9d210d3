"""Reading a checkpoint into the application's state (hpcckpt/store/restore/load.py), in one
process (MPI.COMM_SELF): straight into its arrays (views and aliases included), past the
page cache on a cold restore, and nothing overwritten when the state does not fit."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.store import CheckpointStore


def test_shape_or_dtype_mismatch_with_the_application_is_named(store, make_state):
    store.save(1, make_state(1))
    wrong = {"u": np.zeros(1000, dtype=np.int32), "meta": {}}
    with pytest.raises(CheckpointError, match=r"'u'.*float64\[1000\].*int32\[1000\]"):
        store.restore(wrong)
    assert not wrong["u"].any() and wrong["meta"] == {}, "nothing is overwritten on a mismatch"
    with pytest.raises(CheckpointError, match=r"float64\[1000\].*float64\[999\]"):
        store.restore({"u": np.zeros(999), "meta": {}})


def test_restore_reads_into_the_applications_arrays(store, make_state):
    """No second buffer: the reader fills the application's array and returns it."""
    from hpcckpt.store.file.reader import CheckpointReader

    res = store.save(1, make_state(1))
    out = np.zeros(1000)
    with CheckpointReader(res.path) as reader:
        assert reader.rank_array("u", 0, out) is out
        assert np.array_equal(out, np.arange(1000.0))
        other = np.zeros(999)
        got = reader.rank_array("u", 0, other)  # does not fit: read into a new array
        assert got is not other and not other.any() and np.array_equal(got, out)


@pytest.mark.parametrize("direct", [None, False])
def test_a_cold_restore_reads_past_the_page_cache_where_saves_write_so(
    tmp_path, read_past, uncached, direct
):
    """By file system, as saves (ext4 here, where tmp_path is); never with
    ``TuningOptions(direct_io=False)``."""
    from hpcckpt.store.io import direct_io, filesystem

    tuning = filesystem.TuningOptions(direct_io=direct)
    big = np.random.default_rng(1).random(1 << 20)  # 8 MiB: more than MIN_DIRECT_BYTES
    res = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, fs_tuning=tuning).save(1, {"x": big})
    uncached(res.path)
    state = {"x": np.zeros_like(big)}
    restarted = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, fs_tuning=tuning)
    assert restarted.restore(state).step == 1
    assert np.array_equal(state["x"], big)
    takes = filesystem.detect(tmp_path).name in filesystem.DIRECT_IO_NAMES
    if direct is None and takes:
        assert len(read_past) == 1 and read_past[0] > big.nbytes - 3 * direct_io.ALIGN
    else:
        assert read_past == []


def test_mismatch_on_one_array_leaves_every_array_untouched(store):
    store.save(1, {"a": np.ones(100), "b": np.ones(100)})
    state = {"a": np.zeros(100), "b": np.zeros(50)}
    with pytest.raises(CheckpointError, match=r"'b'"):
        store.restore(state)
    assert not state["a"].any(), "'a' fits, but nothing is read before the whole state fits"


def test_restore_into_views_and_aliased_arrays(store):
    base = np.zeros(2000)
    shared = np.arange(10.0)
    store.save(1, {"strided": np.arange(1000.0), "x": shared, "y": shared * 2})
    state = {"strided": base[::2], "x": np.zeros(10), "y": None}
    state["y"] = state["x"]  # one array at two paths: read through a buffer, in order
    store.restore(state)
    assert np.array_equal(base[::2], np.arange(1000.0)) and not base[1::2].any()
    assert state["x"] is state["y"]
    assert np.array_equal(state["x"], shared * 2), "the later path wins, as before"


# -- the state's keys and the checkpoint's: strict by default ----------------------------------
RENAMED = (
    "the checkpoint of step 7 holds keys ['u'] that the state lacks, and the state holds "
    "['v'] that the checkpoint lacks: rename them back, or restore(state, strict=False) to "
    "take what matches"
)


def test_a_renamed_key_is_an_error_and_nothing_is_touched(store):
    """Saved {"u": ...}, restored into {"v": zeros}: an error naming both keys and the
    way out; the state is as it was (no "u" added)."""
    store.save(7, {"u": np.arange(10.0)})
    state = {"v": np.zeros(10)}
    with pytest.raises(CheckpointError) as err:
        store.restore(state)
    assert str(err.value) == RENAMED
    assert list(state) == ["v"] and not state["v"].any()
    assert store.entries()[0].good_candidate, "a state that does not fit is not damage"


def test_a_key_missing_on_one_side_says_which_side(store):
    store.save(7, {"u": np.arange(10.0), "w": np.ones(3), "k": 1})
    keep = np.zeros(10)
    with pytest.raises(CheckpointError) as err:
        store.restore({"u": keep, "k": 0})
    assert str(err.value) == (
        "the checkpoint of step 7 holds keys ['w'] that the state lacks: add them to the "
        "state, or restore(state, strict=False) to take what matches"
    )
    assert not keep.any(), "the matching array is not read before the keys agree"
    with pytest.raises(CheckpointError) as err:
        store.restore({"u": keep, "w": np.zeros(3), "k": 0, "lr": 0.1})
    assert str(err.value) == (
        "the state holds keys ['lr'] that the checkpoint of step 7 lacks: remove them from "
        "the state, or restore(state, strict=False) to take what matches and leave them as "
        "they are"
    )


def test_a_renamed_nested_key_is_named_by_its_path(store):
    store.save(7, {"fields": {"u": np.arange(10.0), "p": np.ones(4)}, "t": 1.5})
    state = {"fields": {"v": np.zeros(10), "p": np.zeros(4)}, "t": 0.0}
    with pytest.raises(CheckpointError, match=r"keys \['fields/u'\] .* \['fields/v'\]"):
        store.restore(state)
    assert not state["fields"]["p"].any() and state["t"] == 0.0


def test_empty_dicts_lists_and_only_take_what_the_checkpoint_holds(store):
    """An empty dict is a place to fill, not a schema; a list's length is data; ``only``
    restores the keys it names whatever else the checkpoint holds."""
    store.save(7, {"fields": {"u": np.arange(3.0)}, "hist": [1, 2, 3], "t": 1.5})
    state: dict = {}
    assert store.restore(state).step == 7 and state["t"] == 1.5
    state = {"fields": {}, "hist": [], "t": 0.0}
    store.restore(state)
    assert state["hist"] == [1, 2, 3] and np.array_equal(state["fields"]["u"], np.arange(3.0))
    state = {"t": 0.0, "other": "mine"}
    store.restore(state, only=["t"])
    assert state == {"t": 1.5, "other": "mine"}


def test_strict_false_takes_what_matches_and_says_what_it_skipped_and_added(store):
    store.save(7, {"u": np.arange(10.0), "w": np.ones(3), "fields": {"a": 1, "b": 2}})
    state = {"v": np.zeros(10), "w": np.zeros(3), "fields": {"a": 0, "c": 0}}
    got = store.restore(state, strict=False)
    assert got.step == 7
    assert got.skipped_keys == ("v", "fields/c") and got.added_keys == ("u", "fields/b")
    assert got.ignored_keys == ()
    assert not state["v"].any() and np.array_equal(state["w"], np.ones(3))
    assert np.array_equal(state["u"], np.arange(10.0))
    assert state["fields"] == {"a": 1, "c": 0, "b": 2}
    assert store.restore({"u": np.zeros(10), "w": None, "fields": {}}).skipped_keys == ()


def test_a_torch_module_whose_parameter_was_renamed(store):
    """hpcckpt compares a module's state_dict keys with the saved ones before anything is
    read into its tensors; with strict=False it loads what matches and leaves the rest."""
    torch = pytest.importorskip("torch")

    class Old(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 3)
            self.head = torch.nn.Linear(3, 2)

    class New(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 3)
            self.out = torch.nn.Linear(3, 2)  # "head" renamed

    torch.manual_seed(0)
    old = Old()
    store.save(7, {"model": old})
    new = New()
    before = {k: v.clone() for k, v in new.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        store.restore({"model": new})
    assert str(err.value) == (
        "the checkpoint of step 7 holds keys ['model/head.weight', 'model/head.bias'] that "
        "the state lacks, and the state holds ['model/out.weight', 'model/out.bias'] that "
        "the checkpoint lacks: rename them back, or restore(state, strict=False) to take "
        "what matches"
    )
    assert all(torch.equal(before[k], v) for k, v in new.state_dict().items())
    got = store.restore({"model": new}, strict=False)
    assert got.skipped_keys == ("model/out.weight", "model/out.bias")
    assert got.ignored_keys == ("model/head.weight", "model/head.bias")
    assert got.added_keys == ()
    assert torch.equal(new.body.weight, old.body.weight)
    assert torch.equal(new.out.weight, before["out.weight"])


class Stateful:
    """An object restored through its state dict, keyed as an optimizer's is (by int)."""

    def __init__(self) -> None:
        self.sd = {"state": {0: {"m": np.zeros(3)}, 1: {"m": np.ones(3)}}, "lr": 0.1}
        self.calls = 0

    def state_dict(self) -> dict:
        self.calls += 1
        return self.sd

    def load_state_dict(self, sd: dict) -> None:
        self.sd = sd


def test_held_values_are_what_lookup_finds_each_state_dict_taken_once():
    """The restore's lookups through :class:`Held` give what ``matching.lookup`` gives, at
    every path (missing ones too), and open each stateful object once."""
    from hpcckpt.store.restore.load import Held
    from hpcckpt.store.tree.matching import lookup
    from hpcckpt.store.tree.state_tree import Targets

    obj = Stateful()
    ints = {0: np.arange(2), "0": np.arange(3), 1.5: np.arange(4), None: np.arange(5)}
    state = {"opt": obj, "ints": ints, "l": [np.zeros(1), (np.ones(2),)], "a/b": np.zeros(6)}
    paths = ["", "opt", "opt/state", "opt/state/0/m", "opt/state/1/m", "opt/state/2/m"]
    paths += ["opt/lr", "ints/0", "ints/1.5", "ints/None", "ints/7", "l/0", "l/1/0", "l/2"]
    paths += ["l/x", "a%2Fb", "missing/deeper/still", "opt/state/0/m/extra"]
    wants = {path: lookup(state, path, Targets()) for path in paths}
    assert wants["ints/1.5"] is ints[1.5] and wants["ints/None"] is ints[None]
    assert wants["opt/state/1/m"] is obj.sd["state"][1]["m"] and wants["l/1/0"] is not None
    obj.calls = 0
    held = Held(state, Targets())
    for path in paths + paths[::-1]:  # the second time from what was opened
        assert held(path) is wants[path], path
    assert held("ints/0") is ints["0"]  # a str key first, as lookup takes it
    assert obj.calls == 1


def test_rank_0_reads_through_the_reader_that_validated_the_file(store, make_state, monkeypatch):
    """Rank 0 opens the checkpoint once for its validation and its own planned read."""
    from hpcckpt.store.file.reader import CheckpointReader
    from hpcckpt.store.restore import read_plan

    given = []
    inner = read_plan.PlanReader.__init__

    def init(self, plan, **kw):
        given.append(kw.get("opened"))
        inner(self, plan, **kw)

    monkeypatch.setattr(read_plan.PlanReader, "__init__", init)
    store.save(1, make_state(1))
    target = make_state(0)
    assert store.restore(target).step == 1
    assert len(given) == 1 and isinstance(given[0], CheckpointReader)
    assert given[0].fd == -1  # closed once the restore ended
    assert np.array_equal(target["u"], make_state(1)["u"])
