"""The communicator interface (hpcckpt/store/comm/): which transport a Checkpointer gets,
what ``comm=`` accepts, and every operation on 2-3 ranks of each transport (real mpirun,
real torch.distributed over gloo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401 (the torch transport's tests fail, never skip, without torch)
from mpi4py import MPI

from hpcckpt.store import comm as C
from hpcckpt.store.comm.mpi import MpiComm
from tests.mpi_helpers import mpirun, rank_reports

APP = Path(__file__).parent / "apps" / "ops_app.py"
ROOT = Path(__file__).resolve().parents[3]
DONE = [
    "barrier", "bcast", "gather", "allgather", "scatter", "allreduce", "allreduce_array",
    "iallreduce_array", "exscan_sum", "bcast_bytes", "reduce_array", "reduce_scatter_block",
    "send/recv", "send_bytes/recv_bytes", "sendrecv_bytes", "split", "split_node",
    "background", "free",
]  # fmt: skip


def test_the_ops_are_named_once():
    assert C.OPS == {"sum", "max", "min", "land", "lor", "bxor"}
    assert isinstance(C.OPS, frozenset) and isinstance(C.OPERATIONS, frozenset)


def test_every_operation_of_the_interface_is_checked_by_the_app():
    """The app's list of checks covers the Protocol: a new operation needs its check."""
    covered = {part for name in DONE for part in name.split("/")} | {"rank", "size"}
    assert covered == C.OPERATIONS
    members = {n for n in vars(C.Comm) if not n.startswith("_")}
    assert members == C.OPERATIONS


def test_an_mpi4py_communicator_is_wrapped_and_a_comm_kept():
    wrapped = C.as_comm(MPI.COMM_SELF)
    assert isinstance(wrapped, MpiComm) and wrapped.mpi == MPI.COMM_SELF
    assert (wrapped.rank, wrapped.size) == (0, 1)
    assert isinstance(wrapped, C.Comm)
    assert C.as_comm(wrapped) is wrapped


def test_anything_else_is_refused_naming_what_is_accepted():
    with pytest.raises(TypeError, match="mpi4py communicator, a torch.distributed ProcessGroup"):
        C.as_comm(42)


def test_an_mpi_launcher_is_known_by_its_variables():
    assert C.mpi_launched({"OMPI_COMM_WORLD_SIZE": "2"})
    assert C.mpi_launched({"PMI_SIZE": "4"}) and C.mpi_launched({"PMIX_RANK": "0"})
    assert not C.mpi_launched({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0"})
    # a torchrun worker under srun --mpi=pmix inherits the agent's PMIx variables
    assert not C.mpi_launched({"PMIX_RANK": "0", "TORCHELASTIC_RUN_ID": "1", "RANK": "1"})


def test_a_lone_process_without_torch_distributed_gets_mpi(monkeypatch):
    for name in C.MPI_LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    assert C.default_comm() == C.as_comm(MPI.COMM_WORLD)
    assert C.running_rank() == 0


def test_every_operation_over_mpi():
    r = mpirun(3, [APP, "mpi"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank, rep in enumerate(rank_reports(r.stdout, 3)):
        assert (rep["rank"], rep["size"], rep["done"]) == (rank, 3, DONE)


def test_every_operation_over_torch_distributed_gloo_without_mpi():
    """Two processes of torch.multiprocessing over gloo; mpi4py is never loaded."""
    env = {k: v for k, v in __import__("os").environ.items() if k not in C.MPI_LAUNCHER_ENV}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run(
        [sys.executable, str(APP), "torch", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for rank, rep in enumerate(rank_reports(r.stdout, 2)):
        assert (rep["rank"], rep["size"], rep["done"]) == (rank, 2, DONE)
        assert rep["mpi_loaded"] is False
