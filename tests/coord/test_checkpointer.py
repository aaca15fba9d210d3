"""The Checkpointer in one process (MPI.COMM_SELF): online interval, validation of options."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt import Checkpointer
from hpcckpt.policy import Young


def test_online_interval_follows_the_measured_cost(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    mtbf = 1000.0
    ck = Checkpointer(
        tmp_path, comm=MPI.COMM_SELF, policy=Young(mtbf, min_interval=0), initial_cost=2.0
    )
    try:
        assert ck.interval == pytest.approx(math.sqrt(2 * 2.0 * mtbf))
        small = {"u": np.zeros(1000)}
        for step in range(3):
            ck.save(step, small)
        c_small = ck.cost_estimate
        assert c_small < 1.0  # measured, no longer the 2 s guess
        assert ck.interval == pytest.approx(math.sqrt(2 * c_small * mtbf))
        big = {"u": np.ones(40_000_000)}  # 320 MB: the cost goes up a lot
        for step in range(3, 8):
            big["u"][:] = step  # all of it changes: every save writes 320 MB (not a delta)
            ck.save(step, big)
        c_big = ck.cost_estimate
        assert c_big > 3 * c_small
        assert ck.interval == pytest.approx(math.sqrt(2 * c_big * mtbf))
        assert ck.interval > ck.policy.interval(c_small)
    finally:
        ck.close()


def test_default_policy_is_daly_from_node_mtbf(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "100")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    ck = Checkpointer(tmp_path, comm=MPI.COMM_SELF, node_mtbf="100h", initial_cost=10)
    try:
        assert ck.policy.name == "daly"
        assert ck.policy.mtbf == pytest.approx(3600.0)  # 100 h / 100 nodes
    finally:
        ck.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"interval": -1}, r"Checkpointer\(interval=-1\)"),
        ({"interval": 0}, "interval must be a positive"),
        ({"every_steps": 0}, "every_steps must be a positive integer"),
        ({"policy": "sometimes"}, "unknown interval policy"),
        ({"mtbf": "twelve hours"}, r"Checkpointer\(mtbf='twelve hours'\)"),
    ],
)
def test_bad_options_are_named(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Checkpointer(tmp_path, comm=MPI.COMM_SELF, **kwargs)


def test_missing_directory_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv("HPCCKPT_DIR", raising=False)
    with pytest.raises(ValueError, match="HPCCKPT_DIR"):
        Checkpointer(comm=MPI.COMM_SELF)


def test_with_drain_every_a_stop_checkpoint_still_goes_to_the_directory(tmp_path):
    import os
    import signal

    from hpcckpt.store import layout

    ck = Checkpointer(
        tmp_path / "ck", comm=MPI.COMM_SELF, cache=tmp_path / "cache", every_steps=1,
        drain_every=5, signal="USR1",
    )  # fmt: skip
    try:
        state = {"u": np.arange(10.0)}
        ck.save(0, state)  # node-local only
        assert ck.last_save is not None and ck.last_save.tier == "cache"
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ck.due(1) and ck.due(2)
        ck.save(2, state)
        assert ck.stop_requested and ck.last_save.tier == "directory"
        assert [e.step for e in layout.scan(tmp_path / "ck")] == [2]
    finally:
        ck.close()


def test_change_detection_is_chosen_logged_and_recorded(tmp_path, capfd, caplog):
    from hpcckpt.rundir.events import read_events

    with pytest.raises(ValueError, match="change_detection must be one of"):
        Checkpointer(tmp_path / "bad", comm=MPI.COMM_SELF, change_detection="dirty-bits")
    ck = Checkpointer(tmp_path / "ck", comm=MPI.COMM_SELF, every_steps=1, change_detection="kernel")
    try:
        state = {"u": np.random.default_rng(0).random(4 << 20)}  # 32 MiB
        ck.save(1, state)
        state["u"][12345] = -1.0
        ck.save(2, state)
        logged = capfd.readouterr().err + caplog.text  # wherever the hpcckpt handler writes
        assert ck.last_save.change_detection == "kernel" and ck.last_save.pages_written >= 1
        assert "checkpoint step 2: " in logged and "(kernel: 1 page written, " in logged
        assert "(hashes, 32.0 MiB hashed)" in logged  # the first save hashed it all
        saved = [e for e in read_events(tmp_path / "ck") if e.get("event") == "checkpoint"]
        assert [e["change_detection"] for e in saved] == ["hashes", "kernel"]
        assert saved[1]["bytes_hashed"] < saved[0]["bytes_hashed"] / 8
        assert saved[1]["pages_written"] >= 1 and "tracking_audit" not in saved[1]
    finally:
        ck.close()
