"""The Checkpointer under real mpirun: crash and resume, stop signals, agreement on one step."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.rundir.events import read_events
from hpcckpt.rundir.status import read_status
from hpcckpt.store.file import layout
from tests.mpi_helpers import (
    HEAT2D,
    heat2d,
    heat2d_crash_and_resume,
    heat2d_reference,
    mpirun,
    start_mpirun,
    stop,
    wait_for,
)

pytestmark = pytest.mark.mpi

HEAT = HEAT2D
APPS = Path(__file__).parent / "apps"


def heat(tmp: Path, n: int, name: str, *extra: str, timeout: float = 120):
    return heat2d(n, tmp / name, *extra, timeout=timeout)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, np.ndarray]:
    tmp = tmp_path_factory.mktemp("ref")
    refs = {n: heat2d_reference(n, tmp) for n in (2, 3)}
    # The decomposition must not change the arithmetic: 2 and 3 ranks agree bit for bit.
    assert np.array_equal(refs[2], refs[3])
    return refs


@pytest.mark.parametrize("n", [2, 3])
def test_crash_then_resume_is_bit_identical(tmp_path, references, n):
    # Also run from the installed wheel, in its own venv (tests/install/test_wheel.py).
    assert np.array_equal(heat2d_crash_and_resume(n, tmp_path), references[n])


@pytest.mark.parametrize("n,signal_rank", [(2, 1), (3, 2), (3, 0)])
def test_signal_on_one_rank_stops_all_at_one_step(tmp_path, n, signal_rank):
    r = mpirun(n, [APPS / "signal_app.py", tmp_path, signal_rank, 20, 1000])
    assert r.returncode == 0, r.stderr
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("report-*.json"))]
    assert len(reports) == n
    saved = {tuple(rep["saved"]) for rep in reports}
    assert len(saved) == 1, f"ranks disagree on the checkpoint step: {reports}"
    (steps,) = saved
    assert len(steps) == 1 and 20 < steps[0] <= 22, steps
    assert all(rep["stop"] for rep in reports)
    status = read_status(tmp_path)
    assert status.state == "stopped" and status.step == steps[0]


def test_usr1_to_mpirun_checkpoints_and_resume_matches(tmp_path, references):
    ck = tmp_path / "ck"
    proc = start_mpirun(2, [*HEAT, "--ckpt-dir", ck, "--steps", "60", "--sleep", "0.05"])
    try:
        wait_for(
            lambda: (s := read_status(ck)) is not None and s.state == "running",
            60,
            "status running",
        )
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert proc.returncode == 0, err
    status = read_status(ck)
    assert status.state == "stopped" and status.step is not None and status.step < 59
    out = tmp_path / "out.npy"
    r = heat(tmp_path, 2, "ck", "--steps", "60", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"restored step {status.step}" in r.stderr
    assert np.array_equal(np.load(out), references[2])


def test_interval_checkpoints_agree_across_ranks(tmp_path):
    r = heat(tmp_path, 3, "ck", "--steps", "80", "--interval", "0.15", "--sleep", "0.01")
    assert r.returncode == 0, r.stderr
    entries = layout.scan(tmp_path / "ck")
    assert len(entries) >= 2, "an interval of 0.15 s over ~0.8 s of work must checkpoint"
    reasons = {e["reason"] for e in read_events(tmp_path / "ck") if e["event"] == "checkpoint"}
    assert reasons == {"interval"}


def test_deadline_checkpoints_and_stops_before_end_time_without_signal(tmp_path):
    end = (
        time.time() + 26.0
    )  # default margin 20 s + 1.5 x the ~1 s first cost guess => ~4 s of work
    r = mpirun(
        2,
        [*HEAT, "--ckpt-dir", tmp_path / "ck", "--steps", "60", "--sleep", "0.2"],
        env={"HPCCKPT_END_TIME": f"{end:.3f}"},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    status = read_status(tmp_path / "ck")
    assert status.state == "stopped" and status.reason == "deadline", status
    assert status.time < end, "the deadline checkpoint must be committed before the end time"
    assert 0 < status.step < 59
    assert [e.step for e in layout.scan(tmp_path / "ck")] == [status.step]


@pytest.mark.parametrize("level", ["quiet", "normal", "verbose"])
def test_log_level_from_the_wrapper_sets_what_the_ranks_say(tmp_path, level):
    r = mpirun(
        2,
        [*HEAT, "--ckpt-dir", tmp_path / "ck", "--steps", "20", "--every", "10"],
        env={"HPCCKPT_LOG_LEVEL": level},
    )
    assert r.returncode == 0, r.stderr
    rank0 = [x for x in r.stderr.splitlines() if x.startswith("hpcckpt[0] checkpoint step")]
    rank1 = [x for x in r.stderr.splitlines() if x.startswith("hpcckpt[1] checkpoint step")]
    assert len(rank0) == (0 if level == "quiet" else 2), r.stderr
    assert len(rank1) == (2 if level == "verbose" else 0), r.stderr
