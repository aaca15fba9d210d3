"""torch tensors in a state: every dtype, views, 0-d, empty, in-place restore, plain h5py.

torch is required here (installed by ``make setup``): a missing torch fails these tests.
"""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcckpt.store.store import CheckpointError, CheckpointStore
from hpcckpt.store.tree import tensors
from hpcckpt.store.tree.state_tree import decode_into, encode
from tests.format_helpers import described

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(shape, generator=g) * 50
    if dtype == torch.bool:
        return raw > 0
    if dtype.is_complex:
        return torch.complex(raw, -raw).to(dtype)
    if dtype in (torch.uint8, torch.uint16):
        return raw.abs().to(torch.int32).to(dtype)
    return raw.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical values and the same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
    flat_a, flat_b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.dtype.is_complex:
        flat_a, flat_b = torch.view_as_real(flat_a), torch.view_as_real(flat_b)
    if flat_a.dtype == torch.bool:
        return torch.equal(flat_a, flat_b)
    return torch.equal(
        flat_a.reshape(-1).view(width[flat_a.element_size()]),
        flat_b.reshape(-1).view(width[flat_b.element_size()]),
    )


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(tmp_path / "ck", MPI.COMM_WORLD)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly_in_place(store, dtype):
    value = sample(dtype)
    store.save(1, {"t": value})
    target = torch.zeros_like(value)
    ptr = target.data_ptr()
    state = {"t": target}
    store.restore(state)
    assert state["t"] is target and target.data_ptr() == ptr  # filled in place
    assert same(target, value)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tensor_absent_from_the_state_is_created(store, dtype):
    value = sample(dtype, (4,))
    store.save(1, {"t": value})
    state: dict = {}
    store.restore(state)
    assert same(state["t"], value)


def test_views_zero_d_empty_and_requires_grad(store):
    base = torch.arange(24.0).reshape(4, 6)
    values = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "zero_d": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 7),
        "bool0": torch.tensor(True),
        "param": torch.nn.Parameter(torch.ones(3)),
        "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
    }
    store.save(1, dict(values))
    state: dict = dict.fromkeys(values)  # None: a new tensor each
    state["transposed"] = torch.zeros(4, 6).t()  # non-contiguous target: copied into
    target = state["transposed"]
    store.restore(state)
    assert state["transposed"] is target
    for key, value in values.items():
        got = state[key]
        expected = value.detach().resolve_conj()
        assert torch.equal(got, expected), key
        assert got.shape == value.shape and got.dtype == value.dtype, key
    assert state["param"].requires_grad


def test_plain_h5py_reads_tensors_and_names_their_dtype(store, tmp_path):
    bf = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    store.save(1, {"w": torch.arange(6, dtype=torch.int32).reshape(2, 3), "bf": bf})
    with h5py.File(tmp_path / "ck" / "ckpt-0000000001.h5", "r") as f:
        assert f["state/w"][...].tolist() == [[0, 1, 2], [3, 4, 5]]
        assert described(f, "w")["torch_dtype"] == "int32"
        raw = f["state/bf"]
        assert raw.dtype == np.uint16 and described(f, "bf")["torch_dtype"] == "bfloat16"
        # bfloat16 is the upper half of a float32: shift the bits back
        as_f32 = (raw[...].astype(np.uint32) << 16).view(np.float32)
        assert as_f32.tolist() == [1.0, -2.5, 3.140625]
        back = torch.from_numpy(raw[...].view(np.int16)).view(torch.bfloat16)
        assert torch.equal(back, bf)


def test_a_tensor_of_another_shape_or_dtype_is_refused_untouched(store):
    store.save(1, {"t": torch.ones(3, 4)})
    for target in (torch.zeros(4, 3), torch.zeros(3, 4, dtype=torch.float64)):
        before = target.clone()
        with pytest.raises(CheckpointError, match=r"state\['t'\].*torch.float32\[3, 4\]"):
            store.restore({"t": target})
        assert torch.equal(target, before)


def test_unsupported_tensors_name_their_key_path():
    with pytest.raises(TypeError, match=r"state\['a/s'\]: a torch.sparse_coo tensor"):
        encode({"a": {"s": torch.eye(3).to_sparse()}})


def test_numpy_free_dtypes_are_stored_as_raw_unsigned_bits():
    assert tensors.storage_dtype("bfloat16") == np.dtype("<u2")
    assert tensors.storage_dtype("complex32") == np.dtype("<u4")
    for name in ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz", "e8m0fnu"):
        assert tensors.storage_dtype(f"float8_{name}") == np.dtype("u1")
    assert tensors.storage_dtype("float32") == np.dtype("float32")


def test_complex32_round_trips_as_two_float16s(store, tmp_path):
    value = torch.tensor([1 + 2j, -0.5 + 0.25j], dtype=torch.complex64).to(torch.complex32)
    store.save(1, {"c": value})
    with h5py.File(tmp_path / "ck" / "ckpt-0000000001.h5", "r") as f:
        assert described(f, "c")["torch_dtype"] == "complex32"
        assert f["state/c"][...].view(np.float16).tolist() == [1.0, 2.0, -0.5, 0.25]
    state: dict = {}
    store.restore(state)
    assert same(state["c"], value)


def test_decode_without_a_checkpoint_file():
    tree, arrays = encode({"t": torch.tensor([1, 2, 3])})
    assert tree["v"]["t"] == {"$t": "tensor", "path": "t", "dtype": "int64"}
    out = decode_into({}, tree, arrays)
    assert torch.equal(out["t"], torch.tensor([1, 2, 3]))


def test_import_hpcckpt_does_not_import_torch():
    code = (
        "import sys, hpcckpt, hpcckpt.store.store, hpcckpt.training; "
        "hpcckpt.Checkpointer; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_tensor_for_a_numpy_array_or_the_reverse_is_refused_untouched(store):
    store.save(1, {"t": torch.ones(4), "a": np.ones(4, dtype=np.float32)})
    for state in (
        {"t": np.zeros(4, dtype=np.float32), "a": None},
        {"t": None, "a": torch.zeros(4)},
    ):
        held = next(v for v in state.values() if v is not None)
        with pytest.raises(CheckpointError, match="the application's value is"):
            store.restore(state)
        assert not held.sum()


def test_a_cold_restore_reads_a_large_tensor_past_the_page_cache_exactly(
    tmp_path, read_past, uncached
):
    """torch's memory starts 64 bytes into a page, not where O_DIRECT wants it: the
    shifted direct read must still land every byte in the application's tensor."""
    from hpcckpt.store.io import direct_io, filesystem

    w = torch.randn(3 << 20, dtype=torch.float32)  # 12 MiB
    h = torch.randn(1000, 333, dtype=torch.bfloat16)[:, 7:300]  # a view, not contiguous
    res = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF).save(1, {"w": w, "h": h})
    uncached(res.path)
    state = {"w": torch.zeros_like(w), "h": torch.zeros(1000, 293, dtype=torch.bfloat16)}
    target = state["w"]
    CheckpointStore(tmp_path / "ck", MPI.COMM_SELF).restore(state)
    assert state["w"] is target and torch.equal(target, w)
    assert torch.equal(state["h"], h)
    if filesystem.detect(tmp_path).name in filesystem.DIRECT_IO_NAMES:
        assert len(read_past) == 1 and read_past[0] > w.numel() * 4 - 3 * direct_io.ALIGN


def test_a_deep_model_with_adamw_state_restores_bit_exactly(tmp_path):
    """48 blocks of Linear + LayerNorm (192 parameters, 576 optimizer tensors after a
    step): the file's many attribute strings fill an HDF5 global heap collection to its
    end, which restore used to take for damage (it marked the checkpoint bad)."""

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Sequential(
            *[
                torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
                for _ in range(48)
            ]
        )
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    torch.manual_seed(0)
    model, opt = make()
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    CheckpointStore(tmp_path, MPI.COMM_SELF).save(1, {"model": model, "optim": opt})
    fresh, fresh_opt = make()  # other weights, and no optimizer state before a step
    result = CheckpointStore(tmp_path, MPI.COMM_SELF).restore({"model": fresh, "optim": fresh_opt})
    assert result is not None and result.step == 1 and not list(tmp_path.glob("*.bad"))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    saved, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert len(got) == len(saved) == 192
    for k in saved:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved[k][name], got[k][name])
