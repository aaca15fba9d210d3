"""Every supported state type survives a real save and restore through parallel HDF5."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.store import CheckpointStore

DTYPES = [
    "?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8",
    "f2", "f4", "f8", "c8", "c16", ">f8", ">i4", ">c16", "<u2",
]  # fmt: skip


def sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    if dt.kind == "b":
        return (np.arange(n) % 3 == 0).reshape(shape)
    if dt.kind == "c":
        return (np.arange(n) + 1j * np.arange(n)[::-1]).astype(dt).reshape(shape)
    values = np.arange(n) * 7 - (3 if dt.kind in "if" else 0)
    if dt.kind == "u":
        values = np.arange(n) * 7 + np.iinfo(dt).max // 2
    return values.astype(dt).reshape(shape)


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 0, 3)])
def test_array_dtypes_and_shapes_roundtrip_bitwise(store, dtype, shape):
    a = sample(dtype, shape)
    store.save(1, {"a": a})
    fresh: dict = {}
    store.restore(fresh)
    assert fresh["a"].dtype == a.dtype and fresh["a"].shape == a.shape
    assert fresh["a"].tobytes() == a.tobytes()
    held = np.zeros(shape, dtype=dtype)
    store.restore({"a": held})
    assert held.tobytes() == a.tobytes()


def test_views_and_fortran_order_fill_in_place(store):
    base = np.arange(40.0).reshape(5, 8)
    fort = np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4))
    store.save(1, {"v": base[1:4, ::3], "f": fort, "t": base.T})
    target_base = np.zeros((5, 8))
    tgt = {"v": target_base[1:4, ::3], "f": np.zeros((3, 4), np.int16, order="F"), "t": None}
    keep = tgt["f"]
    store.restore(tgt)
    assert np.array_equal(target_base[1:4, ::3], base[1:4, ::3])
    assert target_base[0].sum() == 0 and tgt["f"] is keep and np.array_equal(keep, fort)
    assert np.array_equal(tgt["t"], base.T)


def test_scalars_and_containers_roundtrip(store):
    state = {
        "big": 2**200 + 1,
        "neg": -(2**100),
        "f": 1e-310,
        "nan": float("nan"),
        "b": False,
        "s": "日本/..",
        "raw": bytes(range(256)),
        "none": None,
        "nested": {"l": [1, [2.5, {"deep": (1, "x")}]], "": 0, "a/b": [np.float16(1.5)]},
        "c": 3 - 4j,
    }
    store.save(1, state)
    out: dict = {}
    store.restore(out)
    nan = out.pop("nan")
    assert nan != nan
    expected = dict(state)
    expected.pop("nan")
    assert out == expected
    assert type(out["nested"]["a/b"][0]) is np.float16


def test_random_generators_give_the_same_numbers_after_resume(store):
    gen, rs = np.random.default_rng(2024), np.random.RandomState(11)
    mt = np.random.Generator(np.random.MT19937(5))
    for g in (gen, mt):
        g.random(10)
    rs.rand(10)
    store.save(1, {"g": gen, "r": rs, "mt": mt})
    expected = (gen.random(5), rs.rand(5), mt.integers(0, 2**62, 5))
    targets = {"g": np.random.default_rng(), "r": np.random.RandomState(), "mt": None}
    store.restore(targets)
    got = (targets["g"].random(5), targets["r"].rand(5), targets["mt"].integers(0, 2**62, 5))
    for e, g in zip(expected, got, strict=True):
        assert np.array_equal(e, g)


@pytest.mark.parametrize(
    "value, where",
    [
        (object(), "state['cfg/x']"),
        (np.array(["a"]), "state['cfg/x']"),
        (np.array([{}], dtype=object), "state['cfg/x']"),
        ({1, 2}, "state['cfg/x']"),
        ([1, lambda: 0], "state['cfg/x/1']"),
    ],
)
def test_other_types_are_a_type_error_naming_the_key_path(store, value, where):
    with pytest.raises(TypeError, match=where.replace("[", r"\[").replace("]", r"\]")):
        store.save(1, {"cfg": {"x": value}})
    assert not list(store.directory.glob("ckpt-*")), "nothing is written"


def test_no_pickle_in_the_store():
    root = Path(__file__).resolve().parents[3] / "hpcckpt" / "store"
    for path in root.glob("*.py"):
        assert "import pickle" not in path.read_text(), path


@pytest.mark.parametrize(
    "value",
    [3**30000, -(7**9000), 2**12000, 2**12001 - 1],
    ids=["3^30000", "-7^9000", "2^12000", "2^12001-1"],
)
def test_ints_beyond_json_decimal_limits_roundtrip(store, value):
    store.save(1, {"n": value, "l": [value]})
    out: dict = {}
    store.restore(out)
    assert out["n"] == value and out["l"] == [value]
