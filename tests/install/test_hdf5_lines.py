"""Both HDF5 lines: the store's and the Checkpointer's MPI paths in the wheel venv (PyPI's
serial h5py, HDF5 2.x), and checkpoint files written under one line restored and verified
under the other (the main .venv: h5py built against Debian's parallel HDF5 1.10).

The apps run with the wheel venv's python: tests/install/apps/chain_app.py (an incremental
chain of a distributed array) and the PyTorch suite's tests/coord/apps/torch_app.py;
heat2d's crash and resume from the wheel is in test_wheel.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from hpcckpt.store.file import layout
from tests.install.conftest import ROOT, WheelVenv
from tests.mpi_helpers import mpirun, rank_reports

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

CHAIN = ROOT / "tests" / "install" / "apps" / "chain_app.py"  # 4 KiB blocks, min_delta_saving=0
TORCH = ROOT / "tests" / "coord" / "apps" / "torch_app.py"


def chain(n: int, *args: object, python: Path | None = None) -> list[dict]:
    r = mpirun(n, [CHAIN, *args], python=python)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return rank_reports(r.stdout, n)


def verify(d: Path, python: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``hpcckpt verify --all`` by the wheel venv's console script, or the main venv's CLI."""
    if python is not None:
        cmd = [str(Path(python).parent / "hpcckpt"), "verify", str(d), "--all"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    else:
        cmd = [sys.executable, "-m", "hpcckpt.cli.entry", "verify", str(d), "--all"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def hdf5_lines(wheel_venv: WheelVenv) -> dict[str, str]:
    """The HDF5 each side runs: they must differ, or these tests compare nothing."""
    wheel = wheel_venv.run("-c", "import h5py; print(h5py.version.hdf5_version)", cwd="/")
    assert wheel.returncode == 0, wheel.stderr
    lines = {"main": h5py.version.hdf5_version, "wheel": wheel.stdout.strip()}
    assert lines["main"].split(".")[:2] != lines["wheel"].split(".")[:2], (
        f"both venvs run HDF5 {lines['main']}: the main .venv must have make setup's h5py, "
        "built against Debian's parallel HDF5 1.10"
    )
    assert h5py.get_config().mpi, "the main .venv's h5py must be make setup's parallel build"
    return lines


@pytest.fixture(scope="module")
def wheel_chain(wheel_venv, hdf5_lines, tmp_path_factory) -> Path:
    """A chain saved by 3 ranks from the wheel venv: full, then 2 deltas of the array u."""
    d = tmp_path_factory.mktemp("wheel-chain") / "ck"
    reports = chain(3, "save", d, 3, python=wheel_venv.python)
    assert reports[0]["kinds"] == ["full", "incremental", "incremental"]
    return d


def test_restore_on_2_ranks_through_the_deltas_of_3(wheel_venv, wheel_chain, tmp_path):
    d = shutil.copytree(wheel_chain, tmp_path / "ck")
    for rep in chain(2, "restore", d, python=wheel_venv.python):
        assert rep["ok"] and rep["step"] == 3 and rep["saved_ranks"] == 3, rep
        assert rep["next_kind"] == "full"  # another rank count starts a new chain


def flip_a_byte(path: Path, dataset: str) -> None:
    with h5py.File(path, "r") as f:
        offset, size = f[dataset].id.get_offset(), f[dataset].id.get_storage_size()
    assert offset is not None and size > 0, f"{dataset} is not contiguous in {path}"
    with open(path, "r+b") as fh:
        fh.seek(offset + size // 2)
        byte = fh.read(1)
        fh.seek(offset + size // 2)
        fh.write(bytes([byte[0] ^ 0x40]))


def test_a_damaged_newest_delta_falls_back_to_the_previous_one(wheel_venv, wheel_chain, tmp_path):
    d = shutil.copytree(wheel_chain, tmp_path / "ck")
    newest = d / layout.checkpoint_name(3)
    flip_a_byte(newest, "delta/u")
    assert verify(d, wheel_venv.python).returncode == 1
    for rep in chain(3, "restore", d, "--no-save", python=wheel_venv.python):
        assert rep["ok"] and rep["step"] == 2 and rep["skipped"] == [3], rep
    reason = layout.read_bad(newest)
    assert reason and "checksum" in reason.lower(), f"the damaged file must be marked: {reason}"
    assert [e.step for e in layout.scan(d) if e.good_candidate] == [2, 1], "restore deletes nothing"


def test_torch_checkpoints_of_the_main_venv_verify_under_the_wheels_hdf5(
    wheel_venv, hdf5_lines, tmp_path
):
    """torch stays out of the wheel venv (its install took 26-81 s here, too long for this
    suite): the PyTorch app trains under the main venv, where
    tests/store/tree/test_replicated_mpi.py stops and resumes it bit-identically; here its
    checkpoints (model, AdamW, scheduler, random states, sampler; full and incremental) pass
    verify under the wheel's HDF5."""
    d, out = tmp_path / "ck", tmp_path / "result.json"
    r = mpirun(2, [TORCH, d, "--out", out, "--steps", "12", "--every", "4"], timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert json.loads(out.read_text())["saves"] == [
        [3, "full"],
        [7, "incremental"],
        [11, "incremental"],
    ]
    checked = verify(d, wheel_venv.python)
    assert checked.returncode == 0, f"HDF5 {hdf5_lines['wheel']}:\n{checked.stdout}{checked.stderr}"


@pytest.mark.parametrize("writer", ["main", "wheel"])
def test_a_chain_written_under_one_hdf5_restores_and_verifies_under_the_other(
    wheel_venv, hdf5_lines, tmp_path, writer
):
    """Full + 2 deltas (4 KiB blocks, min_delta_saving=0) by one side; the other verifies
    every file, restores bit-exactly and appends a delta of its own; the writer then
    verifies the mixed chain."""
    pythons = {"main": None, "wheel": wheel_venv.python}
    reader = "wheel" if writer == "main" else "main"
    d = tmp_path / "ck"
    saved = chain(2, "save", d, 3, python=pythons[writer])
    assert {r["hdf5"] for r in saved} == {hdf5_lines[writer]}
    assert saved[0]["kinds"] == ["full", "incremental", "incremental"]
    checked = verify(d, pythons[reader])
    assert checked.returncode == 0, f"HDF5 {hdf5_lines[reader]}:\n{checked.stdout}{checked.stderr}"
    for rep in chain(2, "restore", d, python=pythons[reader]):
        assert rep["hdf5"] == hdf5_lines[reader], rep
        assert rep["ok"] and rep["step"] == 3 and rep["saved_ranks"] == 2, rep
        assert rep["next_kind"] == "incremental", rep  # step 4: the reader's delta on the chain
    assert [e.step for e in layout.scan(d)] == [4, 3, 2, 1]
    mixed = verify(d, pythons[writer])
    assert mixed.returncode == 0, f"HDF5 {hdf5_lines[writer]}:\n{mixed.stdout}{mixed.stderr}"
