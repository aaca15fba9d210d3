"""The store under real mpirun: distributed arrays restored on 3 -> 2, 2 -> 3 and 3 -> 1 ranks."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.store import CheckpointStore
from tests.mpi_counting import strace_counts
from tests.mpi_helpers import mpi_env, mpirun, mpirun_cmd, rank_reports

pytestmark = pytest.mark.mpi

APP = Path(__file__).parent / "apps" / "reshard_app.py"
ROWS = 17


def global_u(rows: int) -> np.ndarray:
    return (np.arange(rows * 5, dtype=np.float64).reshape(rows, 5) * 1.000001) ** 1.5


def run(n: int, *args) -> list[dict]:
    r = mpirun(n, [APP, *args])
    assert r.returncode == 0, r.stderr
    return rank_reports(r.stdout, n)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, Path]:
    """Checkpoints of the same global state written by 2 and by 3 ranks (uneven splits)."""
    out = {}
    for n in (2, 3):
        d = tmp_path_factory.mktemp(f"saved{n}") / "ck"
        reports = run(n, "save", d, ROWS)
        assert reports[0]["hi"] - reports[0]["lo"] > reports[-1]["hi"] - reports[-1]["lo"]
        out[n] = d
    return out


def test_the_file_holds_the_global_array(saved):
    for n, d in saved.items():
        with CheckpointReader(d / layout.checkpoint_name(7)) as r:
            assert r.nranks == n and r.arrays["fields/u"].distributed
            assert r.verify() == []
            assert np.array_equal(r.rows("fields/u", 0, ROWS), global_u(ROWS))


@pytest.mark.parametrize("saved_n, n", [(3, 2), (2, 3), (3, 3), (2, 2)])
@pytest.mark.parametrize("how", ["array", "none", "callable"])
def test_restore_on_another_rank_count_is_bitwise(saved, tmp_path, saved_n, n, how):
    out = tmp_path / "u.npy"
    reports = run(n, "restore", saved[saved_n], ROWS, how, out)
    u = np.load(out)
    assert u.dtype == np.float64 and u.tobytes() == global_u(ROWS).tobytes()
    assert np.array_equal(np.load(str(out) + ".w.npy"), np.arange(ROWS, dtype=np.int32))
    rows = [rep["rows"] for rep in reports]
    if how == "callable":
        assert rows == [0] * (n - 1) + [ROWS]
    elif how == "none" and n == saved_n:  # same count, no hint: the split it was saved with
        assert rows == [8, 6, 3] if n == 3 else rows == [11, 6]
    else:
        assert rows == [len(range(*s)) for s in _even(n)]
    for rep in reports:
        assert rep["step"] == 7 and rep["saved_ranks"] == saved_n
        assert rep["t"] == 1.25 and rep["params"] == [0.5, 2.0] and rep["name"] == "run"
        assert rep["in_place"] == (how == "array")


def _even(n):
    from hpcckpt.store.restore.resharding import even_split

    return [even_split(ROWS, n, r) for r in range(n)]


def test_one_process_reads_a_three_rank_checkpoint(saved):
    store = CheckpointStore(saved[3], MPI.COMM_SELF, distributed=["fields/u", "fields/w"])
    state = {"fields": {"u": np.zeros((ROWS, 5)), "w": None}, "t": None, "params": None, "name": ""}
    assert store.restore(state).saved_ranks == 3
    assert np.array_equal(state["fields"]["u"], global_u(ROWS))


def test_wrong_global_size_names_the_array_and_both_counts(saved):
    store = CheckpointStore(saved[3], MPI.COMM_SELF, distributed=["fields/u"])
    state = {"fields": {"u": np.zeros((ROWS - 1, 5)), "w": None}, "t": 0.0, "params": None}
    state["name"] = ""
    with pytest.raises(CheckpointError, match=r"fields/u.*16 rows.*has 17"):
        store.restore(state)
    assert not state["fields"]["u"].any()
    assert layout.scan(saved[3])[0].good_candidate, "a misfit is not a corrupt checkpoint"


@pytest.mark.parametrize("saved_n, n", [(2, 3), (3, 2)])
def test_per_rank_scalars_on_another_rank_count_fail_on_every_rank_untouched(tmp_path, saved_n, n):
    run(saved_n, "perrank", tmp_path / "ck")
    reports = run(n, "tryrestore", tmp_path / "ck", 2 * saved_n)
    for rep in reports:
        assert "state['seed'] differs" in rep["error"]
        assert f"{saved_n} ranks" in rep["error"] and f"this run has {n} ranks" in rep["error"]
        assert rep["untouched"]


def test_per_rank_array_on_another_rank_count_names_it(tmp_path):
    run(2, "perrank", tmp_path / "ck")
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)  # "u" not declared distributed
    state = {"u": None, "seed": None, "cfg": {}}
    with pytest.raises(CheckpointError) as err:
        store.restore(state)
    assert "written by 2 ranks" in str(err.value) or "2 ranks" in str(err.value)
    assert state == {"u": None, "seed": None, "cfg": {}}


def test_checkpointer_declares_distributed_and_prunes(tmp_path):
    d = tmp_path / "ck"
    run(3, "checkpointer", d)
    # keep_last=2 keeps 30, 25 and keep_every=20 keeps 5, 20; "u" never changes, so 10..30
    # are incremental checkpoints built on 5 and their chain (5..25) stays with them.
    assert [e.step for e in layout.scan(d)] == [30, 25, 20, 15, 10, 5]
    store = CheckpointStore(d, MPI.COMM_SELF, distributed=["u"])
    state: dict = {"u": None, "k": None}
    assert store.restore(state).step == 30 and state["k"] == 30
    assert np.array_equal(state["u"], global_u(12))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("what, error", [("type", "TypeError"), ("names", "CheckpointError")])
def test_a_failure_on_one_rank_raises_on_every_rank_without_hanging(tmp_path, n, what, error):
    reports = run(n, "failsave", tmp_path / "ck", what)
    for rep in reports:
        assert rep["error"].startswith(error) and f"rank {n - 1}" in rep["error"]
    assert layout.scan(tmp_path / "ck") == [] and layout.partials(tmp_path / "ck") == []


# -- what a save and a restore cost in messages and files, per rank count ------------------
COUNTS_APP = Path(__file__).parent / "apps" / "counts_app.py"
#: The most MPI collectives a rank calls (docs/performance.md): the first save (it also
#: detects the file system), every later save, a restore. Point-to-point: none.
MAX_COLLECTIVES = {"save1": 7, "save2": 6, "restore": 4}


def counted(n: int, directory: Path, *extra: str) -> tuple[list[dict], dict]:
    """Each rank's MPI counts per phase, and the strace counts per (rank, phase)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.fail("strace not found: install it (apt-get install strace)")
    log = directory.parent / f"strace-{n}-{'-'.join(extra)}.log"
    argv = [strace, "-f", "-o", str(log), *mpirun_cmd(n, [COUNTS_APP, directory, *extra])]
    r = subprocess.run(argv, env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return rank_reports(r.stdout, n), strace_counts(log)


def cost_problems(runs: dict[int, tuple[list[dict], dict]]) -> list[str]:
    """What grows with the rank count or passes the bound, between runs on 2 and 3 ranks."""
    problems = []
    for phase, bound in MAX_COLLECTIVES.items():
        seen = {}
        for n, (reports, sys_counts) in runs.items():
            for rep in reports:
                c = rep[phase]
                if c["p2p"]:
                    problems.append(f"{phase}: rank {rep['rank']}/{n} sent or received {c['p2p']}")
                if c["collectives"] > bound:
                    problems.append(f"{phase}: {c['collectives']} collectives > {bound}: {c}")
            other = [sys_counts[(r, phase)] for r in range(1, n)]
            seen[n] = (
                reports[0][phase]["kinds"],
                reports[-1][phase]["kinds"],
                dict(sys_counts[(0, phase)]),
                {k: max(o[k] for o in other) for k in ("opens", "fsyncs", "h5_opens")},
            )
        if seen[2] != seen[3]:
            problems.append(f"{phase}: per rank counts differ on 2 and 3 ranks: {seen}")
    return problems


def test_a_save_and_a_restore_cost_each_rank_the_same_at_any_rank_count(tmp_path):
    runs = {n: counted(n, tmp_path / f"ck{n}") for n in (2, 3)}
    assert cost_problems(runs) == []
    reports, sys_counts = runs[3]
    assert sys_counts[(0, "save2")]["fsyncs"] >= 2  # the file and its directory: durable
    assert all(sys_counts[(r, "save2")]["fsyncs"] >= 1 for r in range(3))
    # A restore validates the checkpoint once, on rank 0 (HDF5's open, one descriptor for
    # the heap check and its own read, the .reading marker); every other rank opens it
    # once, for its own bytes, and never through HDF5.
    assert [sys_counts[(r, "restore")]["h5_opens"] for r in range(3)] == [3, 1, 1]


def test_a_per_rank_message_loop_is_caught(tmp_path):
    runs = {n: counted(n, tmp_path / f"ck{n}", "p2p") for n in (2, 3)}
    problems = cost_problems(runs)
    assert any("sent or received" in p for p in problems), problems
    assert any("differ on 2 and 3 ranks" in p for p in problems), problems


def test_a_state_of_thousands_of_arrays_on_three_ranks(tmp_path):
    """3 ranks x 3,000 arrays: the block hash offsets alone are 72 KiB, more than an
    HDF5 object header holds (the save failed so before the files moved to 1.8's
    object format)."""
    r = mpirun(3, [Path(__file__).parent / "apps" / "many_arrays_app.py", tmp_path / "ck", 3000])
    assert r.returncode == 0, r.stderr[-3000:]
    reports = rank_reports(r.stdout, 3)
    assert all(rep["step"] == 1 and rep["same"] for rep in reports), reports


KEYS_APP = Path(__file__).parent / "apps" / "keys_app.py"


@pytest.mark.parametrize("who", ["all", "last"])
def test_a_renamed_key_is_an_error_on_every_rank_without_hanging(tmp_path, who):
    """The strict key check on 2 ranks: the same error on every rank, whether every
    rank's state has the key renamed or one rank's alone; a rank whose keys differ has
    nothing read into its state."""
    r = mpirun(2, [KEYS_APP, "save", tmp_path / "ck"])
    assert r.returncode == 0, r.stderr
    r = mpirun(2, [KEYS_APP, "renamed", tmp_path / "ck", who])
    assert r.returncode == 0, r.stderr
    reports = rank_reports(r.stdout, 2)
    assert {rep["error"] for rep in reports} == {
        "the checkpoint of step 7 holds keys ['u'] that the state lacks, and the state holds "
        "['v'] that the checkpoint lacks: rename them back, or restore(state, strict=False) "
        "to take what matches"
    }
    for rep in reports:
        assert rep["keys"] == (["k", "v"] if rep["renamed"] else ["k", "u"])
        assert rep["untouched"] or not rep["renamed"]
    assert layout.scan(tmp_path / "ck")[0].good_candidate
