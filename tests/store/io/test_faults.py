"""Fault points pick their rank from the launcher's variables, torchrun's workers too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt.store.io import faults
from tests.mpi_helpers import ROOT

TORCHRUN = Path(sys.executable).parent / "torchrun"


def test_parse_reads_phase_rank_and_step() -> None:
    assert faults.parse("save.begin:1:*, commit.renamed") == [
        ("save.begin", 1, None),
        ("commit.renamed", None, None),
    ]
    with pytest.raises(ValueError, match="not phase"):
        faults.parse("no.such.phase")


def test_the_rank_comes_from_mpi_or_slurm_and_from_torchrun_before_them() -> None:
    assert faults._my_rank({"OMPI_COMM_WORLD_RANK": "3", "SLURM_PROCID": "0"}) == 3
    assert faults._my_rank({"SLURM_PROCID": "2", "RANK": "5"}) == 2  # srun-launched rank
    # A torchrun worker under srun inherits its agent's task number (one per node) and,
    # with --mpi=pmix, its PMIx rank: its own rank is RANK.
    worker = {"TORCHELASTIC_RUN_ID": "j", "SLURM_PROCID": "1", "PMIX_RANK": "1", "RANK": "3"}
    assert faults._my_rank(worker) == 3


@pytest.mark.slow
def test_a_fault_for_rank_1_kills_torchruns_rank_1_even_under_srun_variables(tmp_path) -> None:
    """Two real torchrun workers that both inherit ``SLURM_PROCID=0`` (as under one srun
    task): ``save.begin:1`` kills the worker of rank 1, not the one of rank 0."""
    if not TORCHRUN.exists():
        pytest.fail(f"{TORCHRUN} not found: install torch (make setup does)")
    program = tmp_path / "point.py"
    program.write_text(
        "import os, pathlib, time\n"
        "from hpcckpt.store.io.faults import fault_point\n"
        "passed = pathlib.Path('rank0-passed')\n"
        "if os.environ['RANK'] == '1':  # torchrun ends rank 0 once rank 1 dies: after it\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not passed.exists() and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
        "fault_point('save.begin', 0)\n"
        "print('survived rank', os.environ['RANK'], flush=True)\n"
        "if os.environ['RANK'] == '0':\n"
        "    passed.touch()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCCKPT_"))}
    env.update(SLURM_PROCID="0", HPCCKPT_FAULT="save.begin:1", PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node=2", str(program)],
        env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert "survived rank 0" in out and "survived rank 1" not in out, out
    assert "injected fault save.begin" in out and r.returncode != 0, out
