"""DTensors under real mpirun (tests/store/apps/dtensor_app.py): Shard on dims 0 and 1,
uneven and empty shards, Replicate, bfloat16, on 1-D and 2-D meshes. Each rank saves its
local shard; the file describes the global shape and every rank's piece; replicas are
checked equal and stored once; a restore on another rank count or mesh fills DTensors
in place (checked against torch's own sharding and gather), each rank reading only the
bytes of its new shard."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.restore.pieces import PieceReader
from hpcckpt.store.tree import sharded
from tests.format_helpers import described
from tests.mpi_helpers import ROOT, mpirun

pytestmark = [pytest.mark.mpi]

APP = ROOT / "tests" / "store" / "apps" / "dtensor_app.py"
NAMES = ["w0", "w1", "b", "r", "z", "big"]
FILE = "ckpt-0000000005.h5"


def run(n: int, directory: Path, what: str, mesh: str, *extra: str, expect: int = 0) -> dict:
    out = directory.parent / f"{directory.name}-{what}-{n}-{mesh}.json"
    proc = mpirun(n, [APP, directory, what, "--mesh", mesh, "--out", out, *extra], timeout=240)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same tensors saved by 1 rank, by 2 ranks on a 1-D and a 2-D mesh (replicas
    over its first dimension), and by 4 ranks on a 2 x 2 mesh."""
    root = tmp_path_factory.mktemp("dtensors")
    out = {}
    for key, n, mesh in [("1", 1, "1"), ("2", 2, "2"), ("2x1", 2, "2,1"), ("2x2", 4, "2,2")]:
        out[key] = root / key
        assert run(n, out[key], "save", mesh)["error"] is None
    return out


def test_the_file_holds_each_piece_once_with_its_place(saved):
    with h5py.File(saved["2"] / FILE, "r") as f:
        info = described(f, "t/w0")  # Shard(0): the dataset is the global array
        assert info["dtensor"] == {"shape": [10, 6], "offsets": [[0, 0], [5, 0]]}
        assert info["torch_dtype"] == "float32"
        want = np.arange(60, dtype=np.float64).reshape(10, 6) * 0.5 + 2
        assert np.array_equal(f["state/t/w0"][...], want.astype(np.float32))
        info = described(f, "t/w1")  # Shard(1) of 7 columns: 4 and 3, C order per rank
        assert info["dtensor"]["offsets"] == [[0, 0], [0, 4]]
        assert info["rank_shapes"] == [[5, 4], [5, 3]] and info["torch_dtype"] == "bfloat16"
        info = described(f, "t/r")  # Replicate: rank 0's copy only
        assert info["dtensor"]["offsets"] == [[0, 0], None]
        assert info["rank_shapes"] == [[3, 4], [0, 4]]
    with h5py.File(saved["2x2"] / FILE, "r") as f:
        info = described(f, "t/w1")  # (Replicate, Shard(0)) on 2 x 2: ranks 2, 3 are copies
        assert info["dtensor"]["offsets"] == [[0, 0], [3, 0], None, None]
        assert info["rank_shapes"][2:] == [[0, 7], [0, 7]]


@pytest.mark.parametrize(
    "source, n, mesh",
    [
        ("2", 2, "2"),  # the same mesh
        ("2", 1, "1"),  # 2 -> 1
        ("2", 3, "3"),  # 2 -> 3: uneven, z's third shard empty
        ("1", 2, "2"),  # 1 -> 2
        ("2x2", 2, "2"),  # 4 ranks on 2 x 2 -> 2 on a 1-D mesh
        ("2", 2, "1,2"),  # 1-D -> 2-D: other placements on the same ranks
        ("2x1", 3, "3"),  # a mesh of replicas -> 3 ranks
    ],
)
def test_restore_on_any_mesh_fills_the_dtensors_in_place(saved, tmp_path, source, n, mesh):
    directory = tmp_path / "d"
    shutil.copytree(saved[source], directory)
    result = run(n, directory, "load", mesh)
    assert result["restored"] == 5 and result["n"] == 5, result
    assert result["ok"] == dict.fromkeys(NAMES, True)


def test_restore_into_nothing_gives_the_global_tensors(saved, tmp_path):
    shutil.copytree(saved["2x2"], tmp_path / "d")
    result = run(1, tmp_path / "d", "load", "1", "--plain")
    assert result["ok"] == dict.fromkeys(NAMES, True)


def test_a_replica_that_differs_is_refused_naming_it(tmp_path):
    result = run(2, tmp_path / "d", "save", "2", "--perturb", expect=3)
    assert (
        "DTensor 't/r': rank 1's copy of the shard at [0, 0] differs from rank 0's"
        in (result["error"])
    )
    assert not list((tmp_path / "d").glob("ckpt-*.h5"))


def test_each_rank_reads_only_the_bytes_of_its_new_shard(saved):
    """'big' (64 x 256 float32, 4 KiB blocks) saved as 2 Shard(0) pieces, read as the
    shards of 3 ranks: each reads exactly its own rows."""
    with CheckpointReader(saved["2"] / FILE) as reader:
        full = PieceReader(reader).whole("t/big")
        for r in range(3):
            boxes = PieceReader(reader)
            start, rows = sharded.chunk(64, 3, r)
            got = boxes.box("t/big", (start, 0), (rows, 256))
            assert np.array_equal(got, full[start : start + rows])
            # Rows are 1 KiB: a share's bytes, rounded out to the 4 KiB blocks it touches.
            lo, hi = start // 4 * 4, -(-(start + rows) // 4) * 4
            assert boxes.bytes_read == (hi - lo) * 1024 <= (rows + 6) * 1024


def test_a_damaged_piece_is_corrupt_naming_its_rank_and_block(saved, tmp_path):
    path = tmp_path / FILE
    shutil.copy(saved["2"] / FILE, path)
    with h5py.File(path, "r") as f:
        at = f["state/t/big"].id.get_offset() + 40 * 1024  # rank 1's piece, its block 2
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with CheckpointReader(path) as reader:
        boxes = PieceReader(reader)
        assert boxes.box("t/big", (0, 0), (32, 256)).shape == (32, 256)  # rank 0's: intact
        with pytest.raises(CorruptCheckpoint, match="'t/big' of rank 1, block 2, fails"):
            boxes.box("t/big", (30, 0), (20, 256))


def crafted(saved: Path, tmp_path: Path, offsets: list) -> Path:
    """A copy of the 2-rank file whose description of 't/b' says ``offsets``."""
    path = tmp_path / FILE
    shutil.copy(saved / FILE, path)
    with h5py.File(path, "r+") as f:
        meta = f["meta"]
        names = json.loads(meta.attrs["arrays"])
        info = json.loads(meta.attrs["array_info"])
        info[names.index("t/b")]["dtensor"]["offsets"] = offsets
        meta.attrs["array_info"] = json.dumps(info)
    return path


def test_a_piece_outside_the_global_shape_is_damage_found_before_any_read(saved, tmp_path):
    path = crafted(saved["2"], tmp_path, [[0], [5]])
    with pytest.raises(CorruptCheckpoint, match="'t/b'.*outside the DTensor's global shape"):
        CheckpointReader(path)


def test_pieces_that_overlap_are_damage_at_the_read(saved, tmp_path):
    path = crafted(saved["2"], tmp_path, [[0], [3]])  # [0, 4) and [3, 6) of 7
    with CheckpointReader(path) as reader:
        with pytest.raises(CorruptCheckpoint, match="'t/b': the stored pieces overlap"):
            PieceReader(reader).whole("t/b")
