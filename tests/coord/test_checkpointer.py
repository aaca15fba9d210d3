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

    from hpcckpt.store.file import layout

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


def test_each_save_says_its_kind_and_why_a_full_one_is_not_a_delta(tmp_path, capfd, caplog):
    from hpcckpt.rundir.events import read_events

    ck = Checkpointer(tmp_path / "ck", comm=MPI.COMM_SELF, every_steps=1, keep_last=None)
    try:
        state = {f"bias{i}": np.full(16, float(i)) for i in range(200)}  # small arrays
        state["w"] = np.arange(1 << 20, dtype=np.float64)  # 8 MiB: 8 blocks
        ck.save(1, state)
        state["w"][7] = -1.0
        state["bias3"][0] = -1.0
        ck.save(2, state)  # 201 arrays: the 7 MiB left out are under 201 x 64 KiB
        state = {"w": state["w"]}
        ck.save(3, state)  # other arrays than step 2's: full
        state["w"][9] = -2.0
        ck.save(4, state)
        logged = capfd.readouterr().err + caplog.text
        saved = [e for e in read_events(tmp_path / "ck") if e.get("event") == "checkpoint"]
        assert [e["save_kind"] for e in saved] == ["full", "full", "full", "incremental"]
        reasons = [e["full_reason"] for e in saved]
        assert reasons[0].startswith("no checkpoint of this run to build on (the first save")
        assert (
            reasons[1].startswith("a delta would leave out ")
            and "min_delta_saving=65,536" in (reasons[1])
        )
        assert reasons[2].startswith("the arrays, ranks or block size differ from the last")
        assert reasons[3] is None
        assert f"checkpoint step 2: full ({reasons[1]}), " in logged
        assert "checkpoint step 4: incremental (12.5 % of blocks), " in logged
    finally:
        ck.close()


def test_restore_is_strict_and_strict_false_says_what_it_took(tmp_path, capfd, caplog):
    """A key renamed in the code is an error; ``restore(state, strict=False)`` takes what
    matches and says what it left and added, in one log line and in the restore event."""
    from hpcckpt.rundir.events import read_events
    from hpcckpt.store.errors import CheckpointError

    with Checkpointer(tmp_path / "ck", comm=MPI.COMM_SELF, every_steps=1) as ck:
        ck.save(7, {"u": np.arange(4.0), "k": 7})
    with Checkpointer(tmp_path / "ck", comm=MPI.COMM_SELF, every_steps=1) as ck:
        state = {"v": np.zeros(4), "k": 0}
        with pytest.raises(CheckpointError, match=r"holds keys \['u'\] .* holds \['v'\]"):
            ck.restore(state)
        assert list(state) == ["v", "k"] and state["k"] == 0
        assert ck.restore(state, strict=False) == 7
        assert state["k"] == 7 and not state["v"].any()
        assert np.array_equal(state["u"], np.arange(4.0))
    logged = capfd.readouterr().err + caplog.text
    assert (
        "restored step 7 from ckpt-0000000007.h5; strict=False: left ['v'] as they were "
        "(not in the checkpoint), added ['u'] (not in the state)"
    ) in logged
    [restore] = [e for e in read_events(tmp_path / "ck") if e["event"] == "restore"]
    assert restore["skipped_keys"] == ["v"] and restore["added_keys"] == ["u"]
    assert restore["ignored_keys"] == []


def test_a_save_over_a_step_marked_bad_clears_the_mark_and_says_so(tmp_path, capfd, caplog):
    from hpcckpt.rundir.events import read_events
    from hpcckpt.store.file import layout

    with Checkpointer(tmp_path / "ck", comm=MPI.COMM_SELF, every_steps=1) as ck:
        ck.save(1, {"u": np.arange(4.0)})
        ck.save(2, {"u": np.arange(4.0)})
    second = tmp_path / "ck" / layout.checkpoint_name(2)
    layout.mark_bad(second, "rank 0's state tree fails its checksum")
    with Checkpointer(tmp_path / "ck", comm=MPI.COMM_SELF, every_steps=1) as ck:
        state = {"u": np.zeros(4)}
        assert ck.restore(state) == 1
        ck.save(2, state)
        assert ck.last_save.cleared_bad_mark == "rank 0's state tree fails its checksum"
    assert layout.read_bad(second) is None and layout.scan(tmp_path / "ck")[0].good_candidate
    logged = capfd.readouterr().err + caplog.text
    assert (
        "checkpoint step 2: ckpt-0000000002.h5 replaces a file marked bad (rank 0's state "
        "tree fails its checksum); its mark is removed"
    ) in logged
    kinds = [e["event"] for e in read_events(tmp_path / "ck")]
    cleared = [e for e in read_events(tmp_path / "ck") if e["event"] == "bad_mark_cleared"]
    assert [(e["step"], e["path"], e["reason"]) for e in cleared] == [
        (2, "ckpt-0000000002.h5", "rank 0's state tree fails its checksum")
    ]
    assert kinds[kinds.index("bad_mark_cleared") - 1] == "checkpoint"  # of that save


def test_restore_beats_restore_while_the_store_reads_then_compute(tmp_path):
    import threading
    import time

    from hpcckpt.rundir.heartbeat import read_heartbeats

    before = set(threading.enumerate())
    ck = Checkpointer(tmp_path, comm=MPI.COMM_SELF, every_steps=1)
    try:
        ck.save(1, {"u": np.arange(10.0)})
        seen: list[str] = []
        inner = ck.store.restore

        def restore(*args, **kwargs):
            # the hang watch's "restore" lands while the store is reading (from a thread)
            end = time.monotonic() + 10
            while time.monotonic() < end:
                beat = read_heartbeats(tmp_path).get(0)
                if beat is not None and beat.phase == "restore":
                    seen.append(beat.phase)
                    break
                time.sleep(0.01)
            return inner(*args, **kwargs)

        ck.store.restore = restore
        state = {"u": np.zeros(10)}
        assert ck.restore(state) == 1 and np.array_equal(state["u"], np.arange(10.0))
        assert seen == ["restore"]
    finally:
        ck.close()
    assert read_heartbeats(tmp_path)[0].phase == "compute"  # written by the time close returns
    assert not [t for t in set(threading.enumerate()) - before if t.name == "hpcckpt-heartbeat"]
