"""Two jobs on one directory: the second refuses, naming the first; stale locks are recovered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from hpcckpt import Checkpointer, slurm
from hpcckpt.store.io import lock as lock_module
from hpcckpt.store.io.lock import LOCK_NAME, DirectoryLock, DirectoryLocked, read_owner

ROOT = Path(__file__).resolve().parents[2]

HOLDER = textwrap.dedent(
    """
    import sys, time
    from hpcckpt import slurm
    from hpcckpt.store.io.lock import DirectoryLock
    lock = DirectoryLock(sys.argv[1], refresh=0.2, job_id=slurm.job_id()).acquire()
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    lock.release() if sys.argv[3] == "release" else None
    """
)


def start_holder(d: Path, seconds: float, how: str = "release", env=None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(d), str(seconds), how],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_job_refuses_naming_the_first(tmp_path, monkeypatch, reliability_log):
    monkeypatch.setattr(lock_module, "WAIT", 1.0)
    d = tmp_path / "ck"
    d.mkdir()
    holder = start_holder(d, 30, env={"SLURM_JOB_ID": "4242"})
    try:
        t0 = time.monotonic()
        with pytest.raises(DirectoryLocked) as err:
            Checkpointer(d, comm=MPI.COMM_SELF, every_steps=1)
        assert 1.0 <= time.monotonic() - t0 < 10
        msg = str(err.value)
        assert f"pid {holder.pid}" in msg and "Slurm job 4242" in msg and "since" in msg
        assert "host " in msg and str(d) in msg
        # the lock is refreshed while held (heartbeat)
        before = os.stat(d / LOCK_NAME).st_mtime
        time.sleep(0.6)
        assert os.stat(d / LOCK_NAME).st_mtime > before
    finally:
        holder.kill()
        holder.wait()
    reliability_log.add(
        "lock", case="second job, first alive", result=msg[:70] + "...", outcome="ok"
    )


def test_a_released_lock_is_free_again(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    start_holder(d, 0, "release").wait()
    assert not (d / LOCK_NAME).exists()
    ck = Checkpointer(d, comm=MPI.COMM_SELF, every_steps=1)
    assert read_owner(d / LOCK_NAME)["pid"] == os.getpid()
    ck.finish()
    assert not (d / LOCK_NAME).exists()


def test_a_dead_job_on_this_host_is_stale(tmp_path, reliability_log):
    d = tmp_path / "ck"
    d.mkdir()
    holder = start_holder(d, 30, "keep")
    holder.kill()  # SIGKILL: the lock stays
    holder.wait()
    assert read_owner(d / LOCK_NAME)["pid"] == holder.pid
    with Checkpointer(d, comm=MPI.COMM_SELF, every_steps=1):
        assert read_owner(d / LOCK_NAME)["pid"] == os.getpid()
    assert not (d / LOCK_NAME).exists()
    reliability_log.add(
        "lock", case="stale: owner pid dead (same host)", result="taken over", outcome="ok"
    )


def _fake_lock(d: Path, age: float, **owner) -> None:
    record = {"host": "other-node", "pid": 1, "job_id": "77", "since": time.time() - age}
    record.update(owner, token="feedface")
    (d / LOCK_NAME).write_text(json.dumps(record))
    t = time.time() - age
    os.utime(d / LOCK_NAME, (t, t))


def test_other_host_fresh_lock_is_respected_old_one_is_stale(tmp_path, reliability_log):
    d = tmp_path / "ck"
    d.mkdir()
    _fake_lock(d, age=10)
    with pytest.raises(DirectoryLocked, match="host other-node, pid 1, Slurm job 77"):
        DirectoryLock(d, stale_after=60, wait=0).acquire()
    _fake_lock(d, age=120)
    lock = DirectoryLock(d, stale_after=60).acquire()
    assert read_owner(d / LOCK_NAME)["token"] == lock.token
    lock.release()
    reliability_log.add(
        "lock", case="other host, refreshed 10 s ago", result="refused", outcome="ok"
    )
    reliability_log.add(
        "lock", case="other host, not refreshed for 120 s > 60", result="taken over", outcome="ok"
    )


def test_same_slurm_job_requeued_takes_over(tmp_path, monkeypatch, reliability_log):
    d = tmp_path / "ck"
    d.mkdir()
    _fake_lock(d, age=5, job_id="99")
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    lock = DirectoryLock(d, job_id=slurm.job_id()).acquire()  # as the Checkpointer does
    lock.release()
    reliability_log.add(
        "lock", case="same Slurm job id (requeued)", result="taken over", outcome="ok"
    )


def test_pid_reused_by_another_process_is_stale(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    import socket

    _fake_lock(d, age=5, host=socket.gethostname(), pid=os.getppid(), start=1)
    lock = DirectoryLock(d).acquire()  # the parent is alive, but started at another time
    lock.release()


def test_one_process_may_open_two_checkpointers(tmp_path):
    d = tmp_path / "ck"
    a = Checkpointer(d, comm=MPI.COMM_SELF, every_steps=1)
    b = Checkpointer(d, comm=MPI.COMM_SELF, every_steps=1)
    a.close()
    assert (d / LOCK_NAME).exists(), "still used by b"
    b.close()
    b.close()  # twice is harmless
    assert not (d / LOCK_NAME).exists()


def test_two_racers_for_a_stale_lock_one_wins(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    _fake_lock(d, age=1000)
    code = textwrap.dedent(
        """
        import sys, time
        from hpcckpt.store.io.lock import DirectoryLock, DirectoryLocked
        time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
        try:
            DirectoryLock(sys.argv[1], stale_after=60, wait=0).acquire()
            print("won", flush=True)
            time.sleep(2)
        except DirectoryLocked:
            print("lost", flush=True)
        """
    )
    at = str(time.time() + 3.0)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(d), at], stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        for _ in range(3)
    ]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert outs == ["lost", "lost", "won"]
