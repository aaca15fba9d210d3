"""The ranks' half of ``hpcckpt.store.file.writer.write_file`` under ``mpirun -n 3``:
a rank that fails before the file is planned (here: a state tree JSON cannot write)
does not leave the others waiting in a collective; every rank raises, alike."""

from __future__ import annotations

import textwrap

import pytest

from tests.mpi_helpers import mpirun, rank_reports

pytestmark = pytest.mark.mpi

APP = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import numpy as np
    from mpi4py import MPI
    from hpcckpt.store.comm import as_comm
    from hpcckpt.store.file.writer import write_file

    comm = as_comm(MPI.COMM_WORLD)
    rank = comm.rank
    path = Path(sys.argv[1]) / "ckpt.h5.partial"
    arrays = {"u": np.arange(10.0) + rank}
    tree = {"u": {"__array__": "u"}, "bad": {1, 2} if rank == 1 else None}
    try:
        write_file(path, comm, 3, tree, arrays)
        outcome = "written"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"rank": rank, "outcome": outcome}), flush=True)
    """
)


def test_a_rank_failing_before_the_gather_fails_every_rank_and_hangs_none(tmp_path):
    app = tmp_path / "app.py"
    app.write_text(APP)
    proc = mpirun(3, [app, tmp_path], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = rank_reports(proc.stdout, 3)
    assert reports[1]["outcome"].startswith("TypeError"), reports  # its own error, as it is
    for other in (reports[0], reports[2]):
        assert other["outcome"].startswith("CheckpointError: rank 1 could not describe"), reports
        assert "TypeError" in other["outcome"], reports
    assert not (tmp_path / "ckpt.h5.partial").exists(), "no file was created"
