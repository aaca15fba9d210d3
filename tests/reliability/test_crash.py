"""SIGKILL at every phase of a save, on one rank or the whole job: nothing committed is lost.

Each case runs ``apps/crash_app.py`` on 2 ranks under mpirun, checkpointing every step;
``HPCCKPT_FAULT=<phase>:<rank or *>:3`` kills it during the save of step 3. Then a new
"job" (a Checkpointer in this process) must: take over the dead job's lock, restore the
newest *committed* checkpoint (step 2, or step 3 once the rename happened) exactly,
never a partial one; and its next save must remove the leftovers. Every checkpoint
left must pass ``verify``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt import Checkpointer
from hpcckpt.rundir.events import read_events
from hpcckpt.store import catalog
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io import faults
from hpcckpt.store.io.lock import LOCK_NAME, read_owner
from tests.mpi_helpers import mpirun, wait_for

pytestmark = pytest.mark.mpi

APP = Path(__file__).parent / "apps" / "crash_app.py"
FAULT_STEP = 3
NSTEPS = 5
NROWS, COLS = 7, 4  # 2 ranks: 3 + 4 rows
#: Phases after which the checkpoint of the fault step is committed (renamed into place).
COMMITTED_AT = {"commit.renamed", "checkpointer.saved", "prune.deleting"}
#: Phases only rank 0 reaches (the commit and the deletes are rank 0's).
RANK0_ONLY = {"commit.fsynced", "commit.renamed", "prune.deleting"}


def _cases() -> list[tuple[str, str]]:
    cases = []
    for phase in faults.PHASES:
        if phase in RANK0_ONLY:
            cases.append((phase, "0"))
        elif phase == "checkpointer.saved":
            cases += [(phase, "1"), (phase, "*")]
        else:
            cases += [(phase, "0"), (phase, "1"), (phase, "*")]
    return cases


INC_CASES = [
    ("write.data", "1"),
    ("write.data", "*"),
    ("write.closed", "0"),
    ("commit.fsynced", "0"),
    ("commit.renamed", "0"),
    ("checkpointer.saved", "*"),
    ("prune.deleting", "0"),  # run with "inc-chain2": step 3 is full, 0..2 a chain to delete
]
#: Staged saves (async_save / cache): the save of step 3 is staged at step 3 and
#: committed inside the save of step 4, so the commit phases meet step 3 there.
STAGED_CASES = [
    ("async", "save.begin", "*"),
    ("async", "stage.written", "0"),
    ("async", "stage.written", "*"),
    ("async", "drain.writing", "0"),
    ("async", "drain.writing", "1"),
    ("async", "drain.writing", "*"),
    ("async", "commit.fsynced", "0"),
    ("async", "commit.renamed", "0"),
    ("async", "checkpointer.saved", "*"),
    ("async-inc", "drain.writing", "1"),
    ("async-inc", "commit.renamed", "0"),
    ("cache", "stage.written", "1"),
    ("cache", "drain.writing", "1"),
    ("cache", "drain.writing", "*"),
    ("cache", "commit.renamed", "0"),
]
W = 4096


def is_inc(mode: str) -> bool:
    return mode.startswith("inc") or mode.endswith("-inc")


def kind_of(path: Path) -> str:
    with CheckpointReader(path, resolve_chain=False) as reader:
        return reader.kind


def global_w(step: int) -> np.ndarray:
    w = np.arange(2 * W, dtype=np.float64)
    if step > 0:
        w[0], w[W] = 1000.0 * step, 1000.0 * step + 1
    return w


def global_u(step: int) -> np.ndarray:
    return np.arange(NROWS * COLS, dtype=np.float64).reshape(NROWS, COLS) * (step + 1) + 0.25


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_every_phase_is_covered():
    assert {p for p, _ in _cases()} == set(faults.PHASES)
    staged = {p for _, p, _ in STAGED_CASES}
    assert set(faults.STAGED_PHASES) - {"drain.eio"} <= staged  # eio: tests/coord


def test_the_fault_spec_is_parsed_strictly():
    assert faults.parse("write.data:1:3, commit.renamed") == [
        ("write.data", 1, 3),
        ("commit.renamed", None, None),
    ]
    assert faults.parse("save.begin:*:7") == [("save.begin", None, 7)]
    for bad in ("nope", "write.data:x", "write.data:1:2:3"):
        with pytest.raises(ValueError, match="HPCCKPT_FAULT"):
            faults.parse(bad)


@pytest.mark.parametrize(
    "mode, phase, who",
    [("full", p, w) for p, w in _cases()]
    + [("inc-chain2" if p == "prune.deleting" else "inc", p, w) for p, w in INC_CASES]
    + STAGED_CASES,
    ids=lambda v: str(v).replace("*", "all"),
)
def test_crash_then_restore_gets_the_newest_committed(tmp_path, mode, phase, who, reliability_log):
    d = tmp_path / "ck"
    t0 = time.monotonic()
    r = mpirun(
        2,
        [APP, d, NSTEPS, FAULT_STEP, mode],
        env={"HPCCKPT_FAULT": f"{phase}:{who}:{FAULT_STEP}"},
        timeout=180,
    )
    assert r.returncode != 0, f"the fault did not kill the job:\n{r.stderr}"
    assert f"injected fault {phase} (step {FAULT_STEP})" in r.stderr, r.stderr
    expected = FAULT_STEP if phase in COMMITTED_AT else FAULT_STEP - 1

    entries = layout.scan(d)
    assert entries[0].step == expected, [e.step for e in entries]
    if phase == "prune.deleting":  # killed between two deletions: one gone, two kept
        assert [e.step for e in entries] == [3, 1, 0] or len(entries) == 3
    for e in entries:
        report = catalog.verify(e.path)
        assert report["good"], report
    kind = kind_of(entries[0].path)
    if mode != "async-inc":  # its step 2 is a delta, its step 3 (committed) too
        assert kind == ("incremental" if mode == "inc" else "full")
    else:
        assert kind == "incremental"
    kinds = {e.step: kind_of(e.path) for e in entries}
    partial_left = [p.name for p in layout.partials(d)]
    # the event log and the status file are whole (single writes, atomic replace)
    for line in (d / "events.jsonl").read_text().splitlines():
        json.loads(line)
    json.loads((d / "hpcckpt-status.json").read_text())
    assert (d / LOCK_NAME).exists(), "a SIGKILLed job leaves its lock behind"
    owner = read_owner(d / LOCK_NAME)
    wait_for(lambda: not _alive(owner["pid"]), 30, "the killed job's rank 0 to be gone")

    # The next job: one process, 2 -> 1 ranks ("u" is distributed, "v" replicated).
    state: dict = {"u": None, "v": None, "step": None, "name": None}
    if is_inc(mode):
        state["w"] = None
    arrays = ["u", "w"] if is_inc(mode) else ["u"]
    ck = Checkpointer(d, comm=MPI.COMM_SELF, every_steps=1, keep_last=None, distributed=arrays)
    try:
        got = ck.restore(state)
        assert got == expected
        if is_inc(mode):
            assert state["u"].tobytes() == global_u(0).tobytes()
            assert state["w"].tobytes() == global_w(expected).tobytes()
        else:
            assert state["u"].tobytes() == global_u(expected).tobytes()
        assert np.array_equal(state["v"], np.arange(5) * expected)
        assert state["step"] == expected and state["name"] == f"crash-{expected}"
        ck.save(expected + 1, state)
    finally:
        ck.finish()
    assert layout.partials(d) == [], "the next save removes the leftovers"
    assert not (d / LOCK_NAME).exists()
    assert all(catalog.verify(e.path)["good"] for e in layout.scan(d))
    reliability_log.add(
        "crash",
        save=mode,
        phase=phase,
        killed={"*": "all ranks"}.get(who, f"rank {who}"),
        on_disk=" ".join(f"{s}{kinds[s][0].upper()}" for s in sorted(kinds)),
        partial_left="yes" if partial_left else "no",
        restored=got,
        leftovers_after_next_save=len(layout.partials(d)),
        outcome="recovered",
        seconds=f"{time.monotonic() - t0:.1f}",
    )


@pytest.mark.parametrize("who", ["0", "1"])
def test_a_restore_that_dies_reading_a_checkpoint_falls_back_on_the_next_try(
    tmp_path, who, reliability_log
):
    """Some damaged HDF5 headers crash the library itself: the next restore must skip them."""
    d = tmp_path / "ck"
    r = mpirun(2, [APP, d, NSTEPS, -1, "full"], timeout=180)
    assert r.returncode == 0, r.stderr
    newest = NSTEPS - 1
    # The next run dies (SIGKILL, as a segfault would) while it reads the newest checkpoint.
    r = mpirun(
        2,
        [APP, d, NSTEPS + 2, -1, "full"],
        env={"HPCCKPT_FAULT": f"restore.reading:{who}:{newest}"},
        timeout=180,
    )
    assert r.returncode != 0 and "injected fault restore.reading" in r.stderr, r.stderr
    owner = read_owner(d / LOCK_NAME)
    wait_for(lambda: not _alive(owner["pid"]), 30, "the killed job's rank 0 to be gone")
    # The run after that skips it (marked bad) and resumes from the one before; its own
    # save of that step is a new file, and the mark, which judged the old one, goes.
    r = mpirun(2, [APP, d, NSTEPS + 2, -1, "full"], timeout=180)
    assert r.returncode == 0, r.stderr
    assert f"restored step {newest - 1}" in r.stderr, r.stderr
    events = list(read_events(d))
    skipped = [e for e in events if e["event"] == "skip_bad"]
    assert [e["step"] for e in skipped] == [newest] and "died while reading" in skipped[0]["reason"]
    cleared = [e for e in events if e["event"] == "bad_mark_cleared"]
    assert [e["step"] for e in cleared] == [newest] and "died while reading" in cleared[0]["reason"]
    assert layout.read_bad(d / layout.checkpoint_name(newest)) is None
    assert not list(d.glob("*.reading"))
    reliability_log.add(
        "crash",
        save="restore",
        phase="restore.reading",
        killed=f"rank {who}",
        on_disk="",
        partial_left="no",
        restored=newest - 1,
        leftovers_after_next_save=0,
        outcome="recovered",
        seconds="",
    )
