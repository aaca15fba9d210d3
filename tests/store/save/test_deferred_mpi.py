"""Staged saves whose collective steps run in the background (store/save/deferred.py),
under real mpirun: a save blocks for its copy only, never for the other ranks; a failure
any rank meets is raised on every rank at the commit; a rank whose budget holds no copy
writes its live state and waits, the others do not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpcckpt.rundir.events import read_events
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.tier import copies as fast_tier
from tests.mpi_helpers import mpirun, rank_reports

pytestmark = pytest.mark.mpi

APP = Path(__file__).parents[1] / "apps" / "deferred_app.py"
ROWS = 1 << 17


def run(
    case: str, d: Path, n: int, env: dict[str, str] | None = None, cache: Path | None = None
) -> list[dict]:
    r = mpirun(n, [APP, case, d, *([] if cache is None else [cache])], timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return rank_reports(r.stdout, n)


def exact(d: Path, step: int, n: int) -> bool:
    with CheckpointReader(d / layout.checkpoint_name(step)) as r:
        assert r.verify() == []
        return all(
            np.array_equal(r.rank_array("u", k), np.arange(ROWS, dtype=np.float64) * (k + 1) + step)
            for k in range(n)
        )


def deferred_after_the_first(rep: dict) -> None:
    """The ``slow`` case's report: every save committed; the first staged save makes the
    background's group with every rank and waits for the file, the later ones return
    while rank 0 is still 1.5 s from it."""
    assert rep["committed"] == [0, 1, 2, 3] and rep["error"] is None
    assert rep["said"] == ["full", "staged", "staged", "staged"]
    assert rep["blocked"][0] > 1.5, rep["blocked"]
    assert max(rep["blocked"][1:]) < 0.75, rep["blocked"]
    assert "hpcckpt-save" in rep["threads"][1]


def test_a_save_does_not_wait_for_rank_0_to_create_its_file(tmp_path):
    d = tmp_path / "ck"
    reports = run("slow", d, 3)
    for rep in reports:
        deferred_after_the_first(rep)
    assert all(exact(d, int(name[5:-3]), 3) for name in reports[0]["files"])


def test_the_ranks_threads_commit_a_save_staged_in_the_background(tmp_path):
    """After the first save, each checkpoint is renamed into place by the ranks' threads
    once every rank's write is durable, with no call of the application's: ``wait()``
    only takes the outcome. The first save (staged the classic way) is committed by it."""
    d = tmp_path / "ck"
    reports = run("behind", d, 3)
    for rep in reports:
        assert rep["committed"] == [0, 1, 2, 3] and rep["error"] is None
        assert rep["said"] == ["full", "staged", "staged", "staged"]
        assert rep["in_place"] == [True, True, True], rep["in_place"]
    assert all(exact(d, int(name[5:-3]), 3) for name in reports[0]["files"])


def test_the_ranks_threads_commit_a_node_local_save_with_every_copy_sealed(tmp_path):
    """``cache=`` without redundancy: the threads agree that every rank sealed its copy
    and commit the drained file, with no call of the application's; ``wait()`` takes
    the outcome, and each rank's copy of every step is sealed (its manifest)."""
    d = tmp_path / "ck"
    reports = run("behind", d, 3, cache=tmp_path / "cache" / "%n")
    for rep in reports:
        assert rep["committed"] == [0, 1, 2, 3] and rep["error"] is None
        assert rep["said"] == ["full", "staged", "staged", "staged"]
        assert rep["in_place"] == [True, True, True], rep["in_place"]
        for step, names in enumerate(rep["cache_files"]):
            assert fast_tier.manifest_name(step, rep["rank"]) in names, (step, names)
    assert all(exact(d, int(name[5:-3]), 3) for name in reports[0]["files"])


def test_a_node_local_save_does_not_wait_for_rank_0_and_each_rank_seals_its_copy(tmp_path):
    """``cache=`` without redundancy: after the first, a save returns once its copy is on
    the node-local tier; the file's creation, each rank's seal and the drain run in the
    background, and every commit leaves each rank's copy sealed (its manifest)."""
    d = tmp_path / "ck"
    r = mpirun(3, [APP, "slow", d, tmp_path / "cache" / "%n"], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    reports = rank_reports(r.stdout, 3)
    for rep in reports:
        deferred_after_the_first(rep)
        k = rep["rank"]
        for step, names in enumerate(rep["cache_files"]):
            assert fast_tier.manifest_name(step, k) in names, (step, names)
            assert fast_tier.data_name(step, k) in names, (step, names)
    assert all(exact(d, int(name[5:-3]), 3) for name in reports[0]["files"])


def test_a_node_local_save_with_redundancy_stays_in_the_foreground(tmp_path):
    """A partner copy is exchanged between the ranks while sealing: no save is deferred,
    each waits for rank 0's file as before, and every checkpoint is exact."""
    d = tmp_path / "ck"
    r = mpirun(2, [APP, "slow", d, tmp_path / "cache" / "%n", "partner"], timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    reports = rank_reports(r.stdout, 2)
    for rep in reports:
        assert rep["committed"] == [0, 1, 2, 3] and rep["error"] is None
        assert "staged" not in rep["said"], rep["said"]
        assert min(rep["blocked"]) > 1.5, rep["blocked"]
        assert not any("hpcckpt-save" in names for names in rep["threads"])
    assert all(exact(d, int(name[5:-3]), 2) for name in reports[0]["files"])


def test_a_value_one_rank_cannot_save_fails_the_commit_on_every_rank(tmp_path):
    d = tmp_path / "ck"
    reports = run("bad", d, 2)
    for rep in reports:
        assert rep["said"][2] == "staged"  # save() itself returned on every rank
        err = rep["error"]
        assert err is not None and err["step"] == 2, rep
        assert "rank 1" in err["message"] and "TypeError" in err["message"], err
        assert rep["committed"] == [0, 1, 3]
    assert layout.checkpoint_name(3) in reports[0]["files"]
    assert layout.checkpoint_name(2) not in reports[0]["files"] and layout.partials(d) == []
    assert all(exact(d, int(name[5:-3]), 2) for name in reports[0]["files"])


def test_a_rank_without_room_to_copy_writes_its_live_state_and_the_others_go_on(tmp_path):
    d = tmp_path / "ck"
    reports = run("short", d, 2)
    for rep in reports:
        # The first staged save, refused on every rank, was written synchronously (its
        # save() committed it); the later ones: rank 1 wrote uncopied, rank 0 copied.
        assert rep["committed"] == [None, 1, 2, 3] and rep["error"] is None
    # Rank 0's saves returned once copied; rank 1's once its write was done (so they knew).
    assert reports[0]["said"] == ["full", "staged", "staged", "staged"]
    assert reports[1]["said"] == ["full"] * 4
    assert all(exact(d, int(name[5:-3]), 2) for name in reports[0]["files"])
    refused = [e for e in read_events(d) if e["event"] == "staging_refused"]
    assert [e["step"] for e in refused] == [0, 1, 2, 3], refused
    assert all("rank 1" in e["reason"] for e in refused), refused


def test_below_mpi_thread_multiple_every_staged_save_stays_in_the_foreground(tmp_path):
    """MPI initialized MPI_THREAD_SERIALIZED (``MPI4PY_RC_THREAD_LEVEL``): no collective
    may run in a second thread, so no save is deferred; each says its kind at once."""
    d = tmp_path / "ck"
    reports = run("plain", d, 2, env={"MPI4PY_RC_THREAD_LEVEL": "serialized"})
    for rep in reports:
        assert rep["multiple"] is False
        assert rep["committed"] == [0, 1, 2, 3] and rep["error"] is None
        assert "staged" not in rep["said"] and rep["said"][0] == "full", rep["said"]
        assert not any("hpcckpt-save" in names for names in rep["threads"])
    assert all(exact(d, int(name[5:-3]), 2) for name in reports[0]["files"])
