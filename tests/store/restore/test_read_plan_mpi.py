"""Restore on the rank count that saved, under real mpirun: rank 0 validates the file
once and each other rank reads its own bytes without opening it through HDF5; every
way an application asks for its rows gives what it saved, a request for other rows
reshards, a refused restore overwrites nothing, and one rank's damaged bytes make every
rank fall back."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.restore import read_plan
from tests.mpi_helpers import ROOT, mpirun, rank_reports

pytestmark = [pytest.mark.mpi]

APP = ROOT / "tests" / "store" / "apps" / "plan_app.py"


def run(n: int, *args: object) -> list[dict]:
    proc = mpirun(n, [APP, *args], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return rank_reports(proc.stdout, n)


@pytest.fixture(scope="module", params=[2, 3])
def saved(request, tmp_path_factory) -> tuple[int, Path]:
    n = request.param
    directory = tmp_path_factory.mktemp(f"plan{n}") / "ck"
    reports = run(n, "save", directory)
    assert reports[0]["kinds"] == ["full", "incremental", "incremental"]
    return n, directory


@pytest.mark.parametrize("how", ["held", "none", "split"])
def test_the_saved_rows_are_read_by_each_rank_without_hdf5(saved, how):
    n, directory = saved
    reports = run(n, "restore", directory, how)
    assert all(r["step"] == 3 and r["exact"] for r in reports), reports
    assert [r["opened"] for r in reports] == [1] + [0] * (n - 1)  # rank 0 validated, once
    assert all(r["chain"] == [1, 2, 3] for r in reports)  # the next save continues the chain
    assert all(r["in_place"] for r in reports) == (how == "held")


def test_asking_for_other_rows_reshards(saved):
    n, directory = saved
    reports = run(n, "restore", directory, "even")
    assert all(r["step"] == 3 and r["exact"] for r in reports), reports
    # every rank opens the file once: rank 0's reader, validated for the plans, reads too
    assert [r["opened"] for r in reports] == [1] * n


def test_a_refused_restore_overwrites_nothing(saved):
    n, directory = saved
    reports = run(n, "restore", directory, "mixed")
    assert all("hold an array and the others do not" in r["error"] for r in reports), reports
    assert reports[0]["untouched"]


def test_one_ranks_damaged_bytes_make_every_rank_fall_back(saved, tmp_path):
    n, directory = saved
    copy = tmp_path / "ck"
    copy.mkdir()
    for f in directory.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    newest = copy / layout.checkpoint_name(3)
    with CheckpointReader(newest) as reader:
        plan = read_plan.plans(reader)[n - 1]
    p = next(a for a in plan.arrays if a.name == "p")
    k, offset = p.extents[0][:2]  # the last rank's p, in the full base
    with open(plan.files[k], "r+b") as f:
        f.seek(offset + 8)
        f.write(b"\xff")
    reports = run(n, "restore", copy, "none")
    # the base is at fault: steps 2 and 3 need it, so no checkpoint is left
    assert all("none of the 3 checkpoints" in r["error"] for r in reports), reports
    assert f"array 'p' of rank {n - 1}, block 0, fails its checksum" in reports[0]["error"]
    assert layout.read_bad(copy / layout.checkpoint_name(1)) is not None


# -- DTensors: on the mesh that saved them, each rank reads its own piece ---------------------
DTENSOR_APP = ROOT / "tests" / "store" / "apps" / "dtensor_plan_app.py"


def run_dtensors(n: int, *args: object) -> list[dict]:
    proc = mpirun(n, [DTENSOR_APP, *args], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return rank_reports(proc.stdout, n)


@pytest.fixture(scope="module")
def dtensors(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("dtensors") / "ck"
    assert run_dtensors(2, "save", directory)[0]["saved"] == [1, 2]
    return directory


def test_dtensors_on_the_mesh_that_saved_them_are_read_without_hdf5(dtensors):
    reports = run_dtensors(2, "restore", dtensors, "same")
    assert all(r["step"] == 2 and r["exact"] for r in reports), reports
    assert [r["opened"] for r in reports] == [1, 0]  # rank 0 validated, once


def test_dtensors_with_other_placements_read_the_pieces(dtensors):
    reports = run_dtensors(2, "restore", dtensors, "swapped")
    assert all(r["step"] == 2 and r["exact"] for r in reports), reports
    assert [r["opened"] for r in reports] == [1, 1]  # rank 0's reader of the plans reads too


def test_a_replicated_dtensor_is_read_from_its_one_copy(tmp_path):
    directory = tmp_path / "ck"
    run_dtensors(2, "save", directory, "--replicate")
    reports = run_dtensors(2, "restore", directory, "same", "--replicate")
    assert all(r["step"] == 2 and r["exact"] for r in reports), reports
    # no plan (rank 1 has no piece of 'r'): every rank opens the file, rank 0 once
    assert [r["opened"] for r in reports] == [1, 1]


def test_a_damaged_dtensor_piece_makes_every_rank_fall_back(dtensors, tmp_path):
    copy = tmp_path / "ck"
    copy.mkdir()
    for f in dtensors.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    newest = copy / layout.checkpoint_name(2)
    with CheckpointReader(newest) as reader:
        plan = read_plan.plans(reader)[1]
    a = next(a for a in plan.arrays if a.name == "t/a")
    assert a.dtensor == ((1001, 33), (501, 0))  # rank 1's piece of the global array
    k, offset = a.extents[0][:2]
    with open(plan.files[k], "r+b") as f:
        f.seek(offset + 5000)
        f.write(b"\xff\xfe")
    reports = run_dtensors(2, "restore", copy, "same")
    assert all(r["step"] == 1 and r["exact"] for r in reports), reports
    bad = layout.read_bad(newest)
    assert bad is not None and "array 't/a' of rank 1, block 1, fails its checksum" in bad, bad
