"""hpcckpt.job.delivery: the path a signal takes to the ranks, with real processes.

The srun paths need Slurm (tests/job/test_stops_slurm.py); here the process-tree paths.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from hpcckpt.job import delivery

# A launcher that starts two "ranks" (each a child with OMPI_COMM_WORLD_RANK, as mpirun's)
# and reports how each ended; the launcher itself ignores nothing and must survive.
LAUNCHER = """
import os, subprocess, sys
rank = ("import signal, sys, time; "
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); time.sleep(60)")
procs = [subprocess.Popen([sys.executable, "-c", rank],
                          env=dict(os.environ, OMPI_COMM_WORLD_RANK=str(r))) for r in range(2)]
print("ready", flush=True)
print(" ".join(str(p.wait()) for p in procs), flush=True)
"""


def test_launcher_kind():
    assert delivery.launcher_kind(["/usr/bin/srun", "-n", "2"]) is delivery.Launcher.SRUN
    assert delivery.launcher_kind(["mpiexec", "-n", "2"]) is delivery.Launcher.MPIRUN
    assert delivery.launcher_kind(["python", "app.py"]) is delivery.Launcher.OTHER


def _start_launcher() -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # both ranks started and catching TERM
        ranks = delivery.rank_processes(proc.pid)
        if len(ranks) == 2 and all(_catches_term(pid) for pid in ranks):
            break
        time.sleep(0.05)
    return proc


def _catches_term(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            mask = next(int(ln.split()[1], 16) for ln in fh if ln.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def test_term_under_mpirun_goes_to_the_ranks_not_the_launcher():
    proc = _start_launcher()
    try:
        ranks = delivery.rank_processes(proc.pid)
        assert len(ranks) == 2 and proc.pid not in ranks
        got = delivery.deliver(delivery.Launcher.MPIRUN, proc.pid, signal.SIGTERM, environ={})
        assert got.path == "ranks" and sorted(map(int, got.targets)) == ranks
        assert "rank processes directly" in got.describe()
        out, _ = proc.communicate(timeout=20)
        assert out.split() == ["7", "7"] and proc.returncode == 0  # each rank once, launcher alive
    finally:
        proc.kill()
        proc.wait()


def test_usr1_and_plain_commands_go_to_the_launcher():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        got = delivery.deliver(delivery.Launcher.OTHER, proc.pid, signal.SIGTERM)
        assert got.path == "launcher" and got.targets == [str(proc.pid)]
        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()


def test_no_rank_found_falls_back_to_the_launcher_with_a_note():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        got = delivery.deliver(delivery.Launcher.MPIRUN, proc.pid, signal.SIGTERM, environ={})
        assert got.path == "launcher" and "no rank process" in got.note
    finally:
        proc.kill()
        proc.wait()


def test_a_gone_step_raises():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(ProcessLookupError):
        delivery.deliver(delivery.Launcher.MPIRUN, proc.pid, signal.SIGTERM, environ={})
    assert os.getpid() > 0


def test_task_processes_of_a_job_on_this_node():
    env = dict(os.environ, SLURM_JOB_ID="987654321", SLURM_STEP_ID="0", SLURM_PROCID="0")
    task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    batch = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env=dict(env, SLURM_STEP_ID="batch"))  # fmt: skip
    try:
        deadline = time.monotonic() + 5
        while delivery.task_processes("987654321") != [task.pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert delivery.task_processes("987654321") == [task.pid]
    finally:
        for proc in (task, batch):
            proc.kill()
            proc.wait()
