"""Asynchronous saves within a memory budget, under real mpirun (apps/budget_app.py).

The memory limit of the second test is a real memory cgroup (the v1 memory controller
or cgroup v2, whichever this machine has) that the ranks run in: a machine where no
memory cgroup can be made fails the test, it is not skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpcckpt.rundir.events import read_events
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from tests.mpi_helpers import mpi_env, mpirun, mpirun_cmd

pytestmark = pytest.mark.mpi

APP = Path(__file__).parent / "apps" / "budget_app.py"
MiB = 1 << 20
#: What a rank's resident set may grow beyond its budget: HDF5 and MPI buffers, the
#: interpreter's arenas, hash tables (measured: about 2 MiB).
SLACK = 96 * MiB


def checkpoints(directory: Path) -> list[dict]:
    return [e for e in read_events(directory) if e["event"] == "checkpoint"]


@pytest.mark.slow
def test_thirty_async_saves_of_four_times_the_budget_per_rank_stay_within_it(
    tmp_path: Path,
) -> None:
    """Each rank's state is four times its budget (a ring of four 32 MiB pieces, four laps
    of it per save) and more than the allowed growth, so a whole copy of the state would
    fail; thirty saves show no growth from save to save. 512 MiB per rank proves what
    1 GiB did (that ran 260 s alone, 60 GiB written) in half the time."""
    mib, budget = 512, 128 * MiB
    assert mib * MiB > budget + SLACK  # a copy of the whole state would exceed the bound
    out = tmp_path / "result.json"
    args = [APP, tmp_path / "ck", "--out", out, "--mib", mib, "--saves", 30]
    # 30 GiB written in all: about 125 s alone on this machine, more beside other tests
    proc = mpirun(2, [*args, "--budget", str(budget)], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert sorted(map(int, result["problems"])) == list(range(30))
    assert all(p == [] for p in result["problems"].values()), result["problems"]
    events = checkpoints(tmp_path / "ck")
    assert [e["step"] for e in events] == list(range(30))
    for e in events:  # the state does not fit the budget: staged through the ring
        assert e["staging_mode"] == "pieces", e
        assert 0 < e["staging_bytes"] <= budget, e
        assert e["blocked_seconds"] > 0 and e["peak_rss"] > mib * MiB, e
    for r in result["ranks"]:
        growth = [p - r["rss0"] for p in r["peaks"]]
        assert max(growth) <= budget + SLACK, [g // MiB for g in growth]
        # no growth from save to save: the later saves peak no higher than the early ones
        assert max(growth[15:]) <= max(growth[1:15]) + 16 * MiB, [g // MiB for g in growth]
        after = [x - r["rss0"] for x in r["rss"]]
        assert max(after[15:]) <= max(after[1:15]) + 16 * MiB, [a // MiB for a in after]


@contextlib.contextmanager
def memory_cgroup(name: str) -> Iterator[tuple[Path, Path, Path]]:
    """A new memory cgroup below this process's: (cgroup.procs, limit file, usage file).

    cgroup v1 (the ``memory`` controller's hierarchy) or v2 (``memory.max``); fails
    the test, naming what is missing, when neither can be made here.
    """
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((ln.split(":", 2)[2] for ln in lines if ":memory:" in ln), None)
    v2 = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
    root = Path("/sys/fs/cgroup")
    if v1 is not None and (root / "memory").is_dir():
        where = root / "memory" / v1.lstrip("/") / name
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
    elif v2 is not None and (root / "cgroup.controllers").exists():
        where = root / v2.lstrip("/") / name
        files = ("memory.max", "memory.current")
    else:
        pytest.fail("no memory cgroup hierarchy under /sys/fs/cgroup: cannot limit memory")
    try:
        where.mkdir()
    except OSError as exc:
        pytest.fail(f"cannot create a memory cgroup at {where}: {exc} (needs root)")
    try:
        if not (where / files[0]).exists():
            pytest.fail(f"{where} has no {files[0]}: the memory controller is not enabled there")
        yield where / "cgroup.procs", where / files[0], where / files[1]
    finally:
        for _ in range(100):  # the ranks may take a moment to leave it
            try:
                where.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_save_short_of_memory_is_written_without_a_copy(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    out = tmp_path / "result.json"
    args = [APP, tmp_path / "ck", "--out", out, "--mib", 256, "--saves", 2, "--gate", gate]
    args.append("--no-verify")  # verified below, outside the memory limit
    with memory_cgroup(f"hpcckpt-test-{os.getpid()}") as (procs, limit, usage):

        def enter() -> None:  # the child joins the cgroup before exec: every rank is in it
            procs.write_text(str(os.getpid()))

        proc = subprocess.Popen(
            mpirun_cmd(2, args),
            env=mpi_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=enter,
        )
        try:
            ready = Path(str(gate) + ".ready")
            deadline = time.monotonic() + 120
            while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert ready.exists(), proc.communicate(timeout=60)
            # Each rank holds its 256 MiB state; leave about 100 MiB per rank: less than
            # another copy of the state, too little for a ring of pieces.
            used = int(usage.read_text())
            limit.write_text(str(used + 200 * MiB))
            gate.write_text("go")
            stdout, stderr = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    for step in (0, 1):
        with CheckpointReader(tmp_path / "ck" / layout.checkpoint_name(step)) as reader:
            assert reader.verify() == []
    events = list(read_events(tmp_path / "ck"))
    refused = [e for e in events if e["event"] == "staging_refused"]
    assert [e["step"] for e in refused] == [0, 1], events
    assert all("MiB a staged save needs" in e["reason"] for e in refused), refused
    saved = checkpoints(tmp_path / "ck")
    assert [e["step"] for e in saved] == [0, 1]
    # The first staged save agrees on the refusal before it stages: synchronous. At the
    # next one each rank finds alone whether a copy fits: a rank where none does writes
    # its live state and waits for that write ("unstaged"), within the memory limit.
    assert "blocked_seconds" not in saved[0], saved  # synchronous
    staged = [e for e in events if e["event"] == "checkpoint_staged"]
    assert [e["step"] for e in staged] == [1], stderr[-3000:]
    assert staged[0]["staging_mode"] in ("copy", "unstaged"), staged  # rank 0's
    assert "checkpoint step 0 written synchronously" in stderr
    assert re.search(r"checkpoint step 1 written uncopied: rank \d: \d+ MiB to stage", stderr)
