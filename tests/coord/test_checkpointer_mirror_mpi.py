"""The Checkpointer with a mirror under real mpirun: a run whose checkpoint directory is
wiped between two segments resumes from the mirror, bit-identical."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from hpcckpt.rundir.env import MIRROR_ENV, MIRROR_WAIT_ENV
from hpcckpt.rundir.events import read_events
from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror.backend import DirectoryBackend
from tests.mpi_helpers import HEAT2D, heat2d_reference, mpirun

pytestmark = pytest.mark.mpi


def test_a_wiped_directory_resumes_from_the_mirror_bit_identical(tmp_path):
    reference = heat2d_reference(2, tmp_path)
    ck, out, mirror_dir = tmp_path / "ck", tmp_path / "out.npy", tmp_path / "project"
    mirror_dir.mkdir()
    env = {MIRROR_ENV: str(mirror_dir)}
    every = ["--steps", "60", "--every", "10", "--ckpt-dir", str(ck)]
    # Steps of 0.1 s: the copy of step 29 (at nice 19) has until step 35 on a busy machine.
    crashed = mpirun(2, [*HEAT2D, *every, "--crash-at", "35", "--sleep", "0.1"], env=env)
    assert crashed.returncode != 0, "the injected crash must fail the run"
    copied = [e["step"] for e in read_events(ck) if e["event"] == "mirrored"]
    assert copied and copied[-1] == 29, crashed.stderr
    on_mirror = mirror.newest_good(DirectoryBackend(mirror_dir))
    assert on_mirror is not None and on_mirror.step == 29
    shutil.rmtree(ck)  # scratch purged, or a new scratch directory after a requeue
    resumed = mpirun(2, [*HEAT2D, *every, "--out", str(out)], env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert "restored step 29 from the mirror" in resumed.stderr
    (restore,) = [e for e in read_events(ck) if e["event"] == "restore"]
    assert restore["tier"] == "mirror" and restore["step"] == 29
    assert np.array_equal(np.load(out), reference)
    waited = [e for e in read_events(ck) if e["event"] == "mirror_wait"]
    assert waited and waited[-1]["done"] and waited[-1]["step"] == 59
    assert mirror.newest_good(DirectoryBackend(mirror_dir)).step == 59
    assert [e.step for e in layout.scan(ck)][0] == 59


def test_a_mirror_directory_that_is_not_there_never_stops_the_run(tmp_path):
    reference = heat2d_reference(2, tmp_path)
    ck, out, missing = tmp_path / "ck", tmp_path / "out.npy", tmp_path / "not-mounted"
    env = {MIRROR_ENV: str(missing), MIRROR_WAIT_ENV: "2"}  # finish() waits 2 s, says so
    args = [*HEAT2D, "--steps", "60", "--every", "10", "--ckpt-dir", str(ck), "--out", str(out)]
    r = mpirun(2, args, env={**env, "HPCCKPT_LOG_LEVEL": "normal"})
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.load(out), reference)
    events = list(read_events(ck))
    failed = [e for e in events if e["event"] == "mirror_failed"]
    assert failed and "does not exist" in failed[0]["reason"]
    (waited,) = [e for e in events if e["event"] == "mirror_wait"]
    assert waited["done"] is False and "does not exist" in waited["error"]
    assert "did not reach the mirror within 2 s (finish)" in r.stderr
    assert f"the checkpoint directory keeps it ({ck}) and a run started on it" in r.stderr
    assert [e.step for e in layout.scan(ck)][0] == 59
