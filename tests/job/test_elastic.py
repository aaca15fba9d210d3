"""The wrapper with real torchrun processes (no Slurm): workers found and signalled, never
the agent; torchrun's own restarts after a stop (hpcckpt/job/delivery.py, elastic.py).

The application (``tests/job/apps/elastic_app.py``) follows the wrapper's contract under
torchrun without torch.distributed: what is tested is the launcher's process tree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcckpt import procfs
from hpcckpt.job import delivery, rank_signal
from hpcckpt.rundir.status import RUNNING, STOPPED, read_status
from tests.job.test_wrapper import Wrapped, clean_env, events, wait_state

APP = Path(__file__).resolve().parent / "apps" / "elastic_app.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def torchrun(*options: str, app: tuple[str, ...] = ()) -> list[str]:
    if not TORCHRUN.exists():
        pytest.fail(f"{TORCHRUN} not found: install torch (make setup does)")
    return [str(TORCHRUN), "--nproc-per-node=2", "--monitor-interval=0.2", *options,
            str(APP), *app]  # fmt: skip


def got(ckpt: Path, rank: int, restart: int = 0) -> list[str]:
    return json.loads((ckpt / f"signals.rank{rank}.restart{restart}.json").read_text())["received"]


def wait_dumped(ckpt: Path, rank: int, restart: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (ckpt / f"signals.rank{rank}.restart{restart}.json").exists():
        assert time.monotonic() < deadline, f"rank {rank} (restart {restart}) never started"
        time.sleep(0.05)


def test_torchrun_is_recognised_alone_under_srun_and_as_a_module():
    kind = delivery.launcher_kind
    t = delivery.Launcher.TORCHRUN
    assert kind(["torchrun", "--nproc-per-node=2", "train.py"]) is t
    assert kind(["/x/bin/torchrun", "train.py"]) is t
    assert kind(["python", "-m", "torch.distributed.run", "train.py"]) is t
    assert kind(["python3.11", "-u", "-mtorch.distributed.run", "train.py"]) is t
    assert kind(["srun", "--kill-on-bad-exit=1", "-N", "2", "torchrun", "--nnodes=2", "t.py"]) is t
    assert kind(["srun", "--ntasks-per-node", "1", "python", "-m", "torch.distributed.run"]) is t
    # srun's program is python train.py: srun forwards USR1 to its tasks, the ranks
    assert kind(["srun", "-n", "2", "python", "train.py", "torchrun"]) is delivery.Launcher.SRUN
    assert kind(["python", "train.py", "-m", "torch.distributed.run"]) is delivery.Launcher.OTHER
    assert kind(["python", "-c", "print(1)"]) is delivery.Launcher.OTHER
    assert kind(["mpirun", "-n", "2", "python", "t.py"]) is delivery.Launcher.MPIRUN


def _start_torchrun(tmp_path: Path, *app: str, **env: str) -> subprocess.Popen:
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    environ = clean_env(HPCCKPT_DIR=str(ckpt), HPCCKPT_ATTEMPT="a.0.x", **env)
    return subprocess.Popen(torchrun(app=app), env=environ, stderr=subprocess.DEVNULL)


def _workers_up(agent: subprocess.Popen, ckpt: Path) -> None:
    for rank in (0, 1):
        wait_dumped(ckpt, rank, 0)
    assert agent.poll() is None


def test_the_workers_are_found_below_torchrun_not_its_agent(tmp_path):
    """Not the agent, nor a worker's own children (a data loader's workers)."""
    agent = _start_torchrun(tmp_path, "--child")
    try:
        _workers_up(agent, tmp_path / "ck")
        workers = delivery.rank_processes(agent.pid, None, rank_signal.TORCHRUN)
        assert len(workers) == 2 and agent.pid not in workers
        below = [p for w in workers for p in procfs.descendants(w)]
        assert below and not set(below) & set(workers)  # the children: marked, not taken
        assert all("TORCHELASTIC_RUN_ID" in procfs.environ(p) for p in below)
        assert sorted(procfs.environ(p)["RANK"] for p in workers) == ["0", "1"]
        # the agent's environment has no worker marker; an MPI search finds nothing here
        assert "TORCHELASTIC_RUN_ID" not in procfs.environ(agent.pid)
        assert delivery.rank_processes(agent.pid) == []
        got_ = delivery.deliver(delivery.Launcher.TORCHRUN, agent.pid, signal.SIGUSR1, environ={})
        assert got_.path == "ranks" and sorted(map(int, got_.targets)) == workers
        assert agent.wait(timeout=60) == 0  # USR1 to the agent would have killed it (138)
        assert got(tmp_path / "ck", 0) == ["SIGUSR1"] and got(tmp_path / "ck", 1) == ["SIGUSR1"]
    finally:
        _kill_torchrun(agent)


def test_the_per_node_signaller_signals_only_its_nodes_workers(tmp_path):
    """Two torchrun "nodes" of job 91 on this machine (as on the local cluster)."""
    agents, ckpts = [], []
    try:
        for node in ("na", "nb"):
            (tmp_path / node).mkdir()
            agents.append(_start_torchrun(tmp_path / node, SLURM_JOB_ID="91",
                                          SLURMD_NODENAME=node))  # fmt: skip
            ckpts.append(tmp_path / node / "ck")
        for agent, ckpt in zip(agents, ckpts, strict=True):
            _workers_up(agent, ckpt)
        env = dict(os.environ, SLURMD_NODENAME="na")
        out = subprocess.run(
            [sys.executable, "-m", "hpcckpt.job.rank_signal", "USR1", "91", "torchrun"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        (report,) = rank_signal.parse_reports(out.stdout)
        assert report["node"] == "na" and sorted(report["ranks"]) == [0, 1]
        assert agents[0].wait(timeout=60) == 0
        assert got(ckpts[0], 0) == ["SIGUSR1"] and got(ckpts[0], 1) == ["SIGUSR1"]
        time.sleep(0.5)
        assert agents[1].poll() is None and got(ckpts[1], 0) == []  # node nb: untouched
        assert rank_signal.main(["USR1", "91", "nosuch"]) == 2
    finally:
        for agent in agents:
            _kill_torchrun(agent)


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_the_stop_reaches_every_worker_and_the_agent_survives(tmp_path, sig):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, torchrun())
    wait_state(ckpt, RUNNING, wrapper=w)
    w.send(sig)
    assert w.wait(timeout=120) == 0, w.stderr
    assert got(ckpt, 0) == ["SIGUSR1"] and got(ckpt, 1) == ["SIGUSR1"]
    assert "to the rank processes directly (pid" in w.wait_line("forwarded")
    assert read_status(ckpt).state == STOPPED
    delivered = [e for e in events(ckpt) if e["event"] == "signal_delivered"]
    assert len(delivered) == 1 and len(delivered[0]["targets"]) == 2


def test_a_nonzero_exit_after_the_stop_checkpoint_is_a_stop(tmp_path):
    """No torchrun restarts left: the agent exits 1; the status file says stopped."""
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, torchrun("--max-restarts=0", app=("--exit-after-stop", "3")))
    wait_state(ckpt, RUNNING, wrapper=w)
    w.send(signal.SIGUSR1)
    assert w.wait(timeout=120) == 0, w.stderr
    assert "a stop, not a crash" in w.wait_line("note: the step ended with exit status 1")
    assert [e["outcome"] for e in events(ckpt) if e["event"] == "step_end"] == ["stopped"]


def test_torchrun_restarting_the_workers_after_the_stop_checkpoint_is_ended(tmp_path):
    """With restarts left torchrun restarts workers that exit non-zero after their stop
    checkpoint; they would train on. The wrapper ends the step: still a stop."""
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, torchrun("--max-restarts=3", app=("--exit-after-stop", "3")))
    wait_state(ckpt, RUNNING, wrapper=w)
    w.send(signal.SIGUSR1)
    assert w.wait(timeout=180) == 0, w.stderr
    line = w.wait_line("torchrun restarted its workers")
    assert "after their stop checkpoint at step" in line and "ending the step" in line
    ends = [e for e in events(ckpt) if e["event"] == "step_end"]
    assert [e["outcome"] for e in ends] == ["stopped"] and ends[0]["exit_code"] != 0
    assert (ckpt / "ready.rank0.restart1").exists()  # the restart the wrapper ended
    assert not (ckpt / "ready.rank0.restart2").exists()


def test_a_stop_lost_in_a_worker_crash_is_delivered_to_the_restarted_workers(tmp_path):
    ckpt = tmp_path / "ck"
    app = ("--crash-on-stop", "1")
    w = Wrapped(ckpt, torchrun("--max-restarts=1", app=app))
    first = wait_state(ckpt, RUNNING, wrapper=w)
    w.send(signal.SIGUSR1)
    assert w.wait(timeout=180) == 0, w.stderr
    assert "before the stop checkpoint: delivering the stop again" in w.wait_line(
        "torchrun restarted its workers"
    )
    assert got(ckpt, 0, 1) == ["SIGUSR1"] and got(ckpt, 1, 1) == ["SIGUSR1"]
    status = read_status(ckpt)
    assert status.state == STOPPED and status.pid != first.pid


def test_a_worker_crash_without_a_stop_is_torchruns_to_restart(tmp_path):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, torchrun("--max-restarts=1", app=("--crash-after", "0.5", "1")))
    first = wait_state(ckpt, RUNNING, wrapper=w)
    line = w.wait_line("torchrun restarted its workers", timeout=120)
    assert "torchrun's --max-restarts acts, not the wrapper" in line
    assert read_status(ckpt).pid != first.pid
    w.send(signal.SIGUSR1)
    assert w.wait(timeout=120) == 0, w.stderr
    assert got(ckpt, 0, 1) == ["SIGUSR1"] and got(ckpt, 1, 1) == ["SIGUSR1"]


def test_torchruns_agent_dies_of_usr1_and_passes_term_to_its_workers(tmp_path):
    """What the wrapper's way around the agent rests on (torch 2.13; docs/wrapper.md):
    USR1 kills the agent (exit 138) and its workers hear nothing; TERM to the agent
    reaches every worker once and the agent exits 1 (SignalException)."""
    agent = _start_torchrun(tmp_path)
    ckpt = tmp_path / "ck"
    workers: list[int] = []
    try:
        _workers_up(agent, ckpt)
        workers = delivery.rank_processes(agent.pid, None, rank_signal.TORCHRUN)
        agent.send_signal(signal.SIGUSR1)
        assert agent.wait(timeout=30) == -signal.SIGUSR1
        time.sleep(1.0)
        assert len(workers) == 2 and all(_running(pid) for pid in workers)  # orphaned
        assert got(ckpt, 0) == [] and got(ckpt, 1) == []
    finally:
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        agent.kill()
        agent.wait()
    (tmp_path / "2").mkdir()
    agent = _start_torchrun(tmp_path / "2")
    ckpt = tmp_path / "2" / "ck"
    try:
        _workers_up(agent, ckpt)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 1
        assert got(ckpt, 0) == ["SIGTERM"] and got(ckpt, 1) == ["SIGTERM"]
    finally:
        _kill_torchrun(agent)


def _running(pid: int) -> bool:
    fields = procfs.stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def test_a_worker_without_a_handler_yet_is_not_signalled(tmp_path):
    """A worker still starting (torchrun restarting its workers after a crash) would die
    of the stop signal: it is skipped, and nothing is sent when no worker can take it."""
    agent = _start_torchrun(tmp_path, "--handler-delay", "60")
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2:
            assert time.monotonic() < deadline and agent.poll() is None, "no workers"
            time.sleep(0.2)
            workers = delivery.rank_processes(agent.pid, None, rank_signal.TORCHRUN)
        assert rank_signal.ready(workers, signal.SIGUSR1, rank_signal.TORCHRUN) == ([], workers)
        assert rank_signal.ready(workers, signal.SIGUSR1, rank_signal.MPI) == (workers, [])
        with pytest.raises(delivery.SlurmError, match="2 without a handler for it yet"):
            delivery.deliver(delivery.Launcher.TORCHRUN, agent.pid, signal.SIGUSR1, environ={})
        time.sleep(0.5)
        assert all(_running(pid) for pid in workers) and agent.poll() is None
    finally:
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        agent.kill()
        agent.wait()


def _kill_torchrun(agent: subprocess.Popen) -> None:
    """SIGKILL the agent and its workers (which a killed agent would leave running)."""
    workers = delivery.rank_processes(agent.pid, None, rank_signal.TORCHRUN)
    agent.kill()
    agent.wait()
    for pid in workers:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
