"""store/export/safetensors.py: a checkpoint's model as safetensors files, loaded with
the safetensors package and ``load_state_dict``, bit for bit the live model's weights;
from 1 rank and from 2 (distributed rows, replicated, FSDP2 DTensor shards); shards and
their index; memory bounded by the largest tensor."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI
from safetensors import safe_open
from safetensors.torch import load_file

from hpcckpt.store import catalog
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.export.safetensors import (
    INDEX_FILE,
    SINGLE_FILE,
    export_safetensors,
    parse_shard_size,
)
from hpcckpt.store.store import CheckpointStore
from tests.mpi_helpers import ROOT, mpirun

APP = Path(__file__).resolve().parents[1] / "apps" / "safetensors_app.py"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(6, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.Linear(8, 3).to(torch.bfloat16),
        torch.nn.Embedding(5, 4).to(torch.float16),
    )
    m[1].running_mean.uniform_()  # buffers too, int64 num_batches_tracked among them
    m[1].num_batches_tracked.fill_(7)
    return m


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))


def assert_exact(loaded: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> None:
    assert list(loaded) == list(live) or sorted(loaded) == sorted(live)
    for name, value in live.items():
        assert same_bits(loaded[name], value), name


def saved(tmp_path: Path, state: dict, **options) -> Path:
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, **options)
    store.save(5, state)
    return catalog.find(store.directory, 5)


def load_all(out: Path) -> dict[str, torch.Tensor]:
    index = out / INDEX_FILE
    if not index.exists():
        return load_file(out / SINGLE_FILE)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        tensors.update(load_file(out / name))
    return tensors


def test_the_export_loads_into_the_model_bit_for_bit(tmp_path):
    live = model()
    optim = torch.optim.AdamW(live.parameters())
    path = saved(tmp_path, {"model": live, "optim": optim, "step": 5})
    done = export_safetensors(path, tmp_path / "out")
    assert done.key == "model" and [p.name for p in done.files] == [SINGLE_FILE]
    assert done.index is None and not (tmp_path / "out" / INDEX_FILE).exists()
    loaded = load_file(tmp_path / "out" / SINGLE_FILE)
    assert_exact(loaded, live.state_dict())
    assert loaded["2.weight"].dtype == torch.bfloat16 and loaded["3.weight"].dtype == torch.float16
    fresh = torch.nn.Sequential(
        torch.nn.Linear(6, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.Linear(8, 3).to(torch.bfloat16),
        torch.nn.Embedding(5, 4).to(torch.float16),
    )
    fresh.load_state_dict(loaded)  # strict: every name, shape and dtype as the model's
    assert_exact(fresh.state_dict(), live.state_dict())
    assert done.total_size == sum(v.numel() * v.element_size() for v in loaded.values())
    with safe_open(str(tmp_path / "out" / SINGLE_FILE), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_the_file_is_the_safetensors_layout(tmp_path):
    live = model()
    export_safetensors(saved(tmp_path, {"model": live}), tmp_path / "out")
    raw = (tmp_path / "out" / SINGLE_FILE).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    spans = sorted(tuple(h["data_offsets"]) for h in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - n
    assert all(
        a[1] == b[0] for a, b in zip(spans[:-1], spans[1:], strict=True)
    )  # no holes, no overlap
    assert header["2.weight"]["dtype"] == "BF16" and header["2.weight"]["shape"] == [3, 8]
    count = header["1.num_batches_tracked"]
    assert count["dtype"] == "I64" and count["shape"] == []
    assert count["data_offsets"][1] - count["data_offsets"][0] == 8


def test_a_state_dict_under_another_key_is_found_or_named(tmp_path):
    live = model()
    optim = torch.optim.AdamW(live.parameters())
    path = saved(tmp_path, {"net": live.state_dict(), "optim": optim, "rng": np.arange(3)})
    with pytest.raises(CheckpointError, match="several of them hold arrays.*--key"):
        export_safetensors(path, tmp_path / "a")  # net and rng both hold arrays
    done = export_safetensors(path, tmp_path / "b", key="net")
    assert_exact(load_file(tmp_path / "b" / SINGLE_FILE), live.state_dict())
    assert done.key == "net"
    path = saved(tmp_path / "2", {"nets": {"generator": live}, "optim": optim, "step": 1})
    assert export_safetensors(path, tmp_path / "c").key == "nets"  # the only model-like key
    export_safetensors(path, tmp_path / "d", key="nets/generator")
    assert_exact(load_file(tmp_path / "d" / SINGLE_FILE), live.state_dict())
    with pytest.raises(CheckpointError, match=r"no key 'nets/gen'.*'generator'.*--key"):
        export_safetensors(path, tmp_path / "e", key="nets/gen")


def test_damaged_bytes_are_refused_and_nothing_is_left(tmp_path):
    path = saved(tmp_path, {"model": {"w": torch.arange(64.0), "b": torch.ones(3)}})
    with h5py.File(path, "r") as f:
        offset = f["state/model/w"].id.get_offset()
    raw = bytearray(path.read_bytes())
    raw[offset + 9] ^= 0x20
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum"):
        export_safetensors(path, tmp_path / "out")
    assert not list((tmp_path / "out").iterdir())


def test_scalars_under_the_key_are_skipped_and_said(tmp_path):
    path = saved(tmp_path, {"model": {"w": torch.ones(2), "config": {"layers": 2}}})
    done = export_safetensors(path, tmp_path / "out")
    assert done.skipped == ("config.layers",) and done.tensors == 1


def test_dtypes_safetensors_lacks_are_refused_by_name(tmp_path):
    path = saved(tmp_path, {"model": {"z": torch.ones(2, dtype=torch.complex64)}})
    with pytest.raises(CheckpointError, match="'z'.*complex64.*safetensors cannot hold"):
        export_safetensors(path, tmp_path / "out")
    assert not list((tmp_path / "out").iterdir())


def test_shards_are_capped_and_indexed_like_hugging_face(tmp_path):
    torch.manual_seed(1)
    weights = {f"layer{i}.weight": torch.randn(16, 16) for i in range(5)}  # 1 KiB each
    weights["big"] = torch.randn(40, 16)  # 2.5 KiB: over the cap, a file of its own
    path = saved(tmp_path, {"model": weights})
    out = tmp_path / "out"
    done = export_safetensors(path, out, max_shard_size="2.2KiB")
    names = sorted(p.name for p in out.iterdir())
    assert names == [*(f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)), INDEX_FILE]
    index = json.loads((out / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == done.total_size == 5 * 1024 + 2560
    assert set(index["weight_map"]) == set(weights)
    for f in set(index["weight_map"].values()):
        part = load_file(out / f)
        held = sum(v.numel() * v.element_size() for v in part.values())
        assert held <= 2252 or len(part) == 1, f
        assert all(index["weight_map"][k] == f for k in part)
    assert_exact(load_all(out), weights)
    # a new export under a larger cap replaces the shards and the index with one file
    export_safetensors(path, out, max_shard_size="1MB")
    assert sorted(p.name for p in out.iterdir()) == [SINGLE_FILE]
    assert_exact(load_file(out / SINGLE_FILE), weights)


@pytest.mark.parametrize(
    "text, n",
    [("5GB", 5 * 10**9), ("2GiB", 2 << 30), ("2G", 2 << 30), ("100", 100), ("1.5MB", 1_500_000)],
)
def test_shard_sizes_read_as_hugging_face_writes_them(text, n):
    assert parse_shard_size(text) == n


@pytest.mark.parametrize("text", ["", "5 parsecs", "-1", "0"])
def test_bad_shard_sizes_are_refused(text):
    with pytest.raises(ValueError, match="size"):
        parse_shard_size(text)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["rows", "replicated", "fsdp"])
def test_a_checkpoint_of_two_ranks_exports_the_global_weights(tmp_path, mode):
    ref = tmp_path / "live.safetensors"
    r = mpirun(2, [APP, mode, tmp_path / "ck", ref])
    assert r.returncode == 0, r.stdout + r.stderr
    path = catalog.find(tmp_path / "ck", 1)
    done = export_safetensors(path, tmp_path / "out")
    assert_exact(load_file(tmp_path / "out" / SINGLE_FILE), load_file(ref))
    assert done.key == "model"


@pytest.mark.mpi
def test_weights_that_differ_between_ranks_are_refused_with_the_fix(tmp_path):
    r = mpirun(2, [APP, "perrank", tmp_path / "ck", tmp_path / "live.safetensors"])
    assert r.returncode == 0, r.stdout + r.stderr
    with pytest.raises(CheckpointError, match="differs between the ranks.*replicated="):
        export_safetensors(catalog.find(tmp_path / "ck", 1), tmp_path / "out")
    assert not list((tmp_path / "out").iterdir())  # no temporary files left either


MEMORY_PROBE = """
import sys, tracemalloc
from hpcckpt.store.export.safetensors import export_safetensors
tracemalloc.start()
export_safetensors(sys.argv[1], sys.argv[2])
print(tracemalloc.get_traced_memory()[1])
"""


def test_memory_is_bounded_by_the_largest_tensor_not_the_model(tmp_path):
    mib = 1 << 20
    weights = {f"w{i}": torch.full((mib // 4,), float(i)) for i in range(12)}  # 12 x 1 MiB
    weights["largest"] = torch.ones(2 * mib // 4)  # 2 MiB
    path = saved(tmp_path, {"model": weights})
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(path), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    peak = int(proc.stdout.split()[-1])
    assert peak < 2 * mib + mib, f"peak {peak / mib:.1f} MiB for a 14 MiB model"
    assert_exact(load_file(tmp_path / "out" / SINGLE_FILE), weights)
