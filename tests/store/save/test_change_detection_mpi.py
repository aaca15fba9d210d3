"""Kernel write tracking under real mpirun: arrays written by MPI transfers (and by
views sharing their pages) are saved exactly as hashing every block saves them."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from tests.mpi_helpers import mpirun, rank_reports

pytestmark = pytest.mark.mpi

APP = Path(__file__).parents[1] / "apps" / "tracked_app.py"
STEPS = 10


def run(n: int, d: Path, detection: str) -> list[dict]:
    r = mpirun(n, [APP, d, detection, STEPS])
    assert r.returncode == 0, r.stderr
    return rank_reports(r.stdout, n)


@pytest.mark.parametrize("n", [2, 3])
def test_tracked_saves_equal_hashed_saves_bit_for_bit(tmp_path, n):
    kernel = run(n, tmp_path / "kernel", "kernel")
    hashes = run(n, tmp_path / "hashes", "hashes")
    for k, h in zip(kernel, hashes, strict=True):
        assert [s[0] for s in k["saves"]] == [s[0] for s in h["saves"]]  # full/incremental
        assert [s[2] for s in k["saves"]] == [s[2] for s in h["saves"]]  # dirty blocks
        methods = [s[1] for s in k["saves"]]
        assert methods[0] == "hashes" and methods.count("kernel") >= STEPS - 2, methods
        assert {s[1] for s in h["saves"]} == {"hashes"}
    for step in range(1, STEPS + 1):
        name = layout.checkpoint_name(step)
        with CheckpointReader(tmp_path / "kernel" / name) as a:
            with CheckpointReader(tmp_path / "hashes" / name) as b:
                assert a.verify() == [] and b.verify() == []
                for array in ("u", "v"):
                    for rank in range(n):
                        got = a.rank_array(array, rank).tobytes()
                        assert got == b.rank_array(array, rank).tobytes(), (step, array, rank)
