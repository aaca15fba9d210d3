"""Encoding a state to JSON + arrays and back, without pickle."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpcckpt.store.tree.state_tree import decode_into, encode, escape, unescape


def roundtrip(state):
    tree, arrays = encode(state)
    tree = json.loads(json.dumps(tree))  # what the file stores is JSON text
    copies = {k: np.array(v, copy=True) for k, v in arrays.items()}
    return tree, copies


def test_scalars_and_containers_roundtrip():
    state = {
        "big": 2**200 + 7,
        "neg": -(2**70),
        "f": 0.1,
        "inf": float("inf"),
        "b": True,
        "none": None,
        "s": "héllo/..",
        "raw": b"\x00\xffbytes",
        "c": 1 + 2j,
        "tup": (1, "a", 2.5),
        "nested": {"list": [1, [2, {"x": 3}]], "": "empty key", "a/b": 4, "..": 5},
        "np": np.float32(1.5),
        "npi": np.int64(-3),
    }
    tree, arrays = roundtrip(state)
    out = decode_into({}, tree, arrays)
    assert out == state
    assert type(out["np"]) is np.float32 and type(out["tup"]) is tuple


def test_arrays_fill_in_place_including_views_and_fortran_order():
    base = np.arange(24.0).reshape(4, 6)
    view = base[:, ::2]  # non-contiguous
    fort = np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3))
    state = {
        "v": view,
        "f": fort,
        "z": np.array(3.5),
        "e": np.zeros((0, 3)),
        "m": np.array([True, False]),
    }
    tree, arrays = roundtrip(state)
    target_base = np.zeros((4, 6))
    target = {
        "v": target_base[:, ::2],
        "f": np.zeros((2, 3), dtype=np.int16, order="F"),
        "z": np.array(0.0),
        "e": np.zeros((0, 3)),
        "m": np.zeros(2, dtype=bool),
    }
    keep = target["f"]
    decode_into(target, tree, arrays)
    assert np.array_equal(target_base[:, ::2], view) and np.all(target_base[:, 1::2] == 0)
    assert target["f"] is keep and np.array_equal(keep, fort)
    assert target["z"] == 3.5 and target["m"].tolist() == [True, False]


def test_random_generators_resume_the_same_stream():
    gen = np.random.default_rng(42)
    rs = np.random.RandomState(7)
    gen.random(5)
    rs.rand(3)
    tree, arrays = roundtrip({"g": gen, "r": rs})
    expected = (gen.random(4), rs.rand(4))
    g2, r2 = np.random.default_rng(0), np.random.RandomState(0)
    target = {"g": g2, "r": r2}
    decode_into(target, tree, arrays)
    assert target["g"] is g2
    assert np.array_equal(g2.random(4), expected[0]) and np.array_equal(r2.rand(4), expected[1])


@pytest.mark.parametrize(
    "value, fragment",
    [
        (object(), "state['a/b']: object"),
        ({(1, 2): 3}, "keys must be str, int, float, bool or None"),
        (np.array(["x"]), "dtype <U1"),
    ],
)
def test_unsupported_values_name_their_key_path(value, fragment):
    with pytest.raises(TypeError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        encode({"a": {"b": value}})


def test_escape_is_reversible_and_path_safe():
    for key in ["a/b", "..", ".", "", "100%", "x y"]:
        name = escape(key)
        assert "/" not in name and name not in ("", ".", "..")
        assert unescape(name) == key
