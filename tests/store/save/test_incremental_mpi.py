"""Incremental checkpoints under real mpirun: chains on 2 and 3 ranks, a rank killed in
the middle of a delta, restart on another rank count through deltas."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store import catalog
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.restore.resharding import even_split
from hpcckpt.store.store import CheckpointStore
from tests.mpi_helpers import mpirun, rank_reports

pytestmark = pytest.mark.mpi

APP = Path(__file__).parents[1] / "apps" / "incr_app.py"
_spec = importlib.util.spec_from_file_location("incr_app", APP)
app = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(app)


def run(n: int, *args, ok: bool = True) -> list[dict]:
    r = mpirun(n, [APP, *args])
    if ok:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode != 0, "the killed rank must fail the run"
        return []
    return rank_reports(r.stdout, n)


def check_every_checkpoint(d: Path, n: int, steps, with_p: bool = True) -> None:
    """Each retained checkpoint holds exactly the state of its step, bit for bit."""
    for step in steps:
        with CheckpointReader(d / layout.checkpoint_name(step)) as r:
            assert r.nranks == n and r.verify() == []
            got = r.rows("u", 0, app.ROWS)
            assert got.tobytes() == app.global_u(step).tobytes(), step
            if with_p:
                for rank in range(n):
                    assert r.rank_array("p", rank).tobytes() == app.per_rank(rank, step).tobytes()


@pytest.mark.parametrize("n", [2, 3])
def test_chain_is_bitwise_and_a_restart_continues_the_chain(tmp_path, n):
    d = tmp_path / "ck"
    reports = run(n, "save", d, 6)
    assert reports[0]["kinds"] == ["full"] + ["incremental"] * 5
    check_every_checkpoint(d, n, range(1, 7))
    sizes = {e.step: e.path.stat().st_size for e in layout.scan(d)}
    assert all(sizes[s] < sizes[1] / 2 for s in range(2, 7)), sizes

    reports = run(n, "restore", d)
    for rep in reports:
        assert rep["ok"] and rep["step"] == 6 and rep["saved_ranks"] == n
        # The first save after the restart is a delta against the restored checkpoint.
        assert rep["next_kind"] == "incremental" and rep["next_dirty"] == n  # a row per rank
    with CheckpointReader(d / layout.checkpoint_name(7)) as r:
        assert [p.step for p in r.chain] == [1, 2, 3, 4, 5, 6, 7] and r.verify() == []


@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_killed_in_the_middle_of_a_delta(tmp_path, n):
    d = tmp_path / "ck"
    run(n, "crash", d, 4, ok=False)
    assert [e.step for e in layout.scan(d)] == [3, 2, 1]
    assert [p.name for p in layout.partials(d)] == [layout.checkpoint_name(4) + ".partial"]
    check_every_checkpoint(d, n, [1, 2, 3])
    reports = run(n, "restore", d)
    for rep in reports:
        assert rep["ok"] and rep["step"] == 3 and rep["skipped"] == []
        assert rep["next_kind"] == "incremental"
    assert layout.partials(d) == []
    check_every_checkpoint(d, n, [1, 2, 3])


@pytest.mark.parametrize("saved_n, n", [(3, 2), (2, 3)])
def test_restore_on_another_rank_count_through_deltas(tmp_path, saved_n, n):
    d = tmp_path / "ck"
    run(saved_n, "save", d, 5, "u")
    with CheckpointReader(d / layout.checkpoint_name(5)) as r:
        assert r.kind == "incremental" and len(r.chain) == 5
    reports = run(n, "restore", d, "u")
    for rep in reports:
        assert rep["ok"] and rep["step"] == 5 and rep["saved_ranks"] == saved_n
        # Another rank count: the blocks are per rank, so the next save starts a new chain.
        assert rep["next_kind"] == "full"


def test_one_process_restores_a_three_rank_delta(tmp_path):
    d = tmp_path / "ck"
    run(3, "save", d, 4, "u")
    store = CheckpointStore(d, MPI.COMM_SELF, distributed=["u"], block_size=app.BLOCK)
    state: dict = {"u": None, "step": None}
    assert store.restore(state).step == 4
    assert state["u"].tobytes() == app.global_u(4).tobytes()
    report = catalog.verify(d / layout.checkpoint_name(4))
    assert report["good"] and report["kind"] == "incremental" and len(report["chain"]) == 3
    lo, hi = even_split(app.ROWS, 3, 1)
    with CheckpointReader(d / layout.checkpoint_name(4)) as r:
        assert np.array_equal(r.rows("u", lo + 3, hi - 2), app.global_u(4)[lo + 3 : hi - 2])
