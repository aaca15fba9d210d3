"""Array descriptions (``hpcckpt.store.file.descriptions``): crafted or damaged ones, of format
version 4 (``meta.attrs['array_info']``) or 1-3 (attributes of each dataset), are a clear
CorruptCheckpoint, never a huge allocation, and restore falls back to the previous one."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.file import descriptions
from hpcckpt.store.file.descriptions import checked_rank_shapes, integer, offsets, plain
from hpcckpt.store.file.reader import CheckpointReader
from tests.format_helpers import (
    as_version_3,
    crafted_falls_back,
    redescribe,
    small_state,
    two_checkpoints,
)

FILE = Path("ckpt-0000000002.h5")


state = small_state


@pytest.fixture(params=["python", "numpy"])
def checks(request, monkeypatch):
    """Both ways a description's per-rank lists are checked: in plain Python (a few
    ranks) and with numpy (many); each must take and refuse exactly the same."""
    if request.param == "numpy":
        monkeypatch.setattr(descriptions, "FEW_RANKS", -1)
    return request.param


@pytest.fixture
def two(tmp_path):
    """A store with good checkpoints of steps 1 and 2; returns (store, newest path)."""
    return two_checkpoints(tmp_path / "ck")


DESCRIBED = {
    "offsets_huge": (
        lambda f: redescribe(f, "u", rank_offsets=[0, 10**15]),
        "offsets",
    ),
    "offsets_negative": (
        lambda f: redescribe(f, "u", rank_offsets=[-5, 100]),
        "offsets",
    ),
    "offsets_short": (
        lambda f: redescribe(f, "u", rank_offsets=[0]),
        "offsets",
    ),
    "shape_huge": (
        lambda f: redescribe(f, "u", rank_shapes=[[10**15]]),
        "shape",
    ),
    "shape_negative": (
        lambda f: redescribe(f, "s", rank_shapes=[[-1, -1]]),
        "outside",
    ),
    "layout_unknown": (lambda f: redescribe(f, "u", layout="spiral"), "layout"),
    "array_info_not_json": (lambda f: f["meta"].attrs.__setitem__("array_info", "["), "array_info"),
    "array_info_short": (lambda f: f["meta"].attrs.__setitem__("array_info", "[{}]"), "array_info"),
    "array_info_missing": (lambda f: f["meta"].attrs.__delitem__("array_info"), "array_info"),
    "offsets_not_integers": (lambda f: redescribe(f, "u", rank_offsets=[0.0, 100.0]), "offsets"),
    "offsets_too_big_for_int64": (lambda f: redescribe(f, "u", rank_offsets=[0, 2**70]), "offsets"),
    "shapes_not_a_list": (lambda f: redescribe(f, "u", rank_shapes="[[100]]"), "rank_shapes"),
    "shape_a_bool": (lambda f: redescribe(f, "u", rank_shapes=[[True]]), "not an integer"),
    "shape_a_float": (lambda f: redescribe(f, "u", rank_shapes=[[100.0]]), "not an integer"),
}


@pytest.mark.parametrize("name", sorted(DESCRIBED))
def test_a_crafted_description_is_corrupt_and_restore_falls_back(two, name, checks):
    crafted_falls_back(*two, *DESCRIBED[name])


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("rank_offsets", np.array([0, 10**15]), "offsets"),
        ("rank_shapes", json.dumps([[-1]]), "shape"),
        ("rank_shapes", "[[", "rank_shapes"),
        ("layout", "spiral", "layout"),
    ],
)
def test_crafted_attributes_of_a_format_3_file_are_corrupt(two, key, value, fragment):
    """Files of an older hpcckpt describe each array on its dataset: checked as before."""
    store, newest = two
    with h5py.File(newest, "r+") as f:
        as_version_3(f)
    with CheckpointReader(newest) as r:
        assert r.format_version == 3 and r.arrays["u"].rank_offsets == (0, 100)
        assert r.rank_array("u", 0).tobytes() == state(2)["u"].tobytes() and not r.verify()
    with h5py.File(newest, "r+") as f:
        f["state/u"].attrs[key] = value
    with pytest.raises(CorruptCheckpoint, match=fragment):
        CheckpointReader(newest)


def test_attribute_values_read_as_plain_python():
    assert plain(b"rows") == "rows" and plain(np.int64(3)) == 3 and type(plain(np.int64(3))) is int
    assert plain(np.array([0, 5])) == [0, 5] and plain("flat") == "flat"


@pytest.mark.parametrize("value", [True, np.bool_(False), 1.0, "1", None])
def test_integer_refuses_what_is_not_an_integer(value):
    with pytest.raises(CorruptCheckpoint, match="step is not an integer"):
        integer(value, "step")


def test_integer_keeps_to_its_bounds():
    assert integer(np.uint64(7), "n", 1, 7) == 7
    with pytest.raises(CorruptCheckpoint, match=r"n = 8 is outside \[1, 7\]"):
        integer(8, "n", 1, 7)
    with pytest.raises(CorruptCheckpoint, match="outside"):
        integer(1 << 63, "dim")


def test_offsets_rise_from_zero_to_the_extent_and_name_the_file(checks):
    assert offsets(np.array([0, 2, 2, 5]), 3, 5, "t", FILE) == (0, 2, 2, 5)
    assert offsets([0, 2, 2, 5], 3, 5, "t", FILE) == (0, 2, 2, 5)
    assert offsets((0, 2, 2, 5), 3, 5, "t", FILE) == (0, 2, 2, 5)
    refused = [[0, 3, 2, 5], [1, 2, 3, 5], [0, 2, 3, 4], [0, 2, 5], [0, 2, True, 5]]
    refused += [[0, 2.0, 3, 5], [0, 2, 3, 2**70], [0, -1, 3, 5], "[0, 2, 3, 5]"]
    for raw in (None, [0, 5], np.array([0, 3, 2, 5]), np.array([1, 2, 3, 5]), *refused):
        with pytest.raises(CorruptCheckpoint, match=f"^{FILE.name}: t: offsets") as got:
            offsets(raw, 3, 5, "t", FILE)
        assert got.value.culprit == FILE


@pytest.mark.parametrize(
    "shapes, offs, shape, layout_, good",
    [
        ([[2, 3], [1, 3]], (0, 2, 3), (3, 3), "rows", True),
        ([[2, 3], [1, 4]], (0, 2, 3), (3, 3), "rows", False),
        ([[2, 3], [2, 3]], (0, 2, 3), (3, 3), "rows", False),
        ([[2, 2], [1]], (0, 4, 5), (5,), "flat", True),
        ([[2, 2], [2]], (0, 4, 5), (5,), "flat", False),
        ([[], [5]], (0, 1, 6), (6,), "flat", True),  # a 0-d array: one element, no dims
    ],
)
def test_rank_shapes_fast_and_rank_by_rank_checks_agree(shapes, offs, shape, layout_, good, checks):
    """The one-pass numpy check and the rank-by-rank one take the same shapes: a float
    among them sends the check rank by rank, where it must fail only on the float."""
    if good:
        got = checked_rank_shapes(shapes, offs, shape, layout_, "a", FILE)
        assert got == tuple(map(tuple, shapes))
    else:
        with pytest.raises(CorruptCheckpoint, match=r"rank \d's shape .* does not match"):
            checked_rank_shapes(shapes, offs, shape, layout_, "a", FILE)
    slow = [*shapes, [1.5]]  # a last rank with a float: never the numpy pass
    with pytest.raises(CorruptCheckpoint, match="not an integer" if good else "does not match"):
        checked_rank_shapes(slow, (*offs, offs[-1]), shape, layout_, "a", FILE)


def test_descriptions_are_read_from_meta_in_version_4_only():
    names = ["u", "s"]
    raw = json.dumps([{"layout": "rows"}, {"layout": "flat"}])
    assert descriptions.descriptions(raw, names, 4, FILE) == [
        {"layout": "rows"},
        {"layout": "flat"},
    ]
    assert descriptions.descriptions(None, names, 3, FILE) is None
    with pytest.raises(CorruptCheckpoint, match="one per entry"):
        descriptions.descriptions(json.dumps([{}]), names, 4, FILE)


def test_a_version_3_file_and_its_version_4_twin_give_the_same_infos(two):
    _, newest = two
    with CheckpointReader(newest) as r:
        v4 = r.arrays
    with h5py.File(newest, "r+") as f:
        as_version_3(f)
    with CheckpointReader(newest) as r:
        assert r.format_version == 3 and r.arrays == v4
