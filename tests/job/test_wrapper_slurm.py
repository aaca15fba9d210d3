"""The wrapper on the local Slurm cluster: crashes, crash loops, chains, preemption,
applications without the Python API, and the deadline without any warning signal.

Each test submits real batch jobs to the session cluster (``slurm_cluster``) and
releases requeued runs from their BeginTime wait (``tests.slurm_helpers.follow``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.rundir.events import read_events
from tests.mpi_helpers import EXAMPLES, ROOT, mpi_env, mpirun
from tests.slurm_helpers import (
    cluster_env,
    follow,
    follow_chain,
    job_info,
    sbatch,
    wait_for_event,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HEAT = ["--nx", "64", "--ny", "64", "--sleep", "0.1"]
VENV_BIN = str(Path(sys.executable).parent)


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)
    return path


def kinds(ckpt: Path) -> list[str]:
    return [e["event"] for e in read_events(ckpt)]


def log_of(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"


def heat_reference(tmp_path: Path, steps: int) -> np.ndarray:
    ref = tmp_path / "reference.npy"
    args = [EXAMPLES / "heat2d.py", *HEAT, "--steps", str(steps), "--sleep", "0"]
    r = mpirun(2, [*args, "--ckpt-dir", tmp_path / "ref", "--out", ref])
    assert r.returncode == 0, r.stderr
    return np.load(ref)


def heat_script(tmp_path: Path, wrapper_args: str, steps: int, extra_heat: str = "") -> Path:
    heat = " ".join(map(str, HEAT))
    return write_script(
        tmp_path / "heat.sbatch",
        f"exec hpcckpt srun {wrapper_args} -- --mpi=pmix python {EXAMPLES}/heat2d.py "
        f"{heat} --steps {steps} --every 10 --out {tmp_path}/out.npy {extra_heat}\n",
    )


def _procs_of(job: str, needle: str) -> dict[int, int]:
    """{SLURM_PROCID: pid} of the job's processes whose command line contains needle."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            raw = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle not in cmd or "srun" in cmd.split(" ")[0]:
            continue
        env = dict(i.split(b"=", 1) for i in raw.split(b"\0") if b"=" in i)
        if env.get(b"SLURM_JOB_ID") == job.encode() and b"SLURM_PROCID" in env:
            found[int(env[b"SLURM_PROCID"])] = int(entry)
    return found


@pytest.mark.mpi
def test_rank_killed_midrun_requeues_and_resumes_bit_identical(slurm_cluster, tmp_path):
    """SIGKILL one rank after the first checkpoints: crash -> requeue -> resume -> same result."""
    steps = 200
    reference = heat_reference(tmp_path, steps)
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    script = heat_script(tmp_path, f"--ckpt-dir {ckpt} --min-progress 3600", steps)
    job = sbatch(["--time=5", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(ROOT))  # fmt: skip
    wait_for_event(ckpt, lambda e: e.get("event") == "checkpoint" and e.get("step", 0) >= 30,
                   timeout=180, job=job, env=env)  # fmt: skip
    ranks = _procs_of(job, "heat2d.py")
    assert 1 in ranks, f"rank 1 of job {job} not found: {ranks}"
    os.kill(ranks[1], signal.SIGKILL)
    info = follow(job, env, timeout=300)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED", text
    assert int(info["Restarts"]) == 1, text
    evs = list(read_events(ckpt))
    crashed = [e for e in evs if e["event"] == "crashed"]
    assert len(crashed) == 1 and crashed[0]["restart"] == 0, text
    requeue = [e for e in evs if e["event"] == "requeue"]
    assert [e["cause"] for e in requeue] == ["crash"], text
    assert "restarting from the last good checkpoint (it wrote a checkpoint" in text
    restored = [e["step"] for e in evs if e["event"] == "restore" and e.get("restart") == 1]
    assert restored and restored[0] >= 30, text
    assert np.load(tmp_path / "out.npy").tobytes() == reference.tobytes()


def test_crash_loop_stops_after_the_budget(slurm_cluster, tmp_path):
    """The app always fails after 2 s: requeued --max-restarts times, then a clear give-up."""
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    app = f"{sys.executable} -c 'import time, sys; time.sleep(2); sys.exit(5)'"
    script = write_script(
        tmp_path / "loop.sbatch",
        f"exec hpcckpt run --ckpt-dir {ckpt} --max-restarts 2 --min-progress 1 -- {app}\n",
    )
    job = sbatch(["--time=5", "-n", "1", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(tmp_path))  # fmt: skip
    info = follow(job, env, timeout=300)
    text = log_of(log)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "5:0", text
    assert int(info["Restarts"]) == 2, text
    assert text.count("step crashed: exit status 5") == 3, text
    assert "giving up: 2 restart(s) after crashes already (--max-restarts 2)" in text
    assert "fix the cause, then submit the same batch script again" in text
    evs = list(read_events(ckpt))
    assert [e["cause"] for e in evs if e["event"] == "requeue"] == ["crash", "crash"]
    give_up = [e for e in evs if e["event"] == "give_up"]
    assert len(give_up) == 1 and give_up[0]["restart"] == 2 and give_up[0]["wrapper_exit"] == 5


def test_a_job_submitted_with_no_requeue_is_told_at_the_start(slurm_cluster, tmp_path):
    """sbatch --no-requeue: the wrapper asks Slurm at the start and says it cannot
    continue by requeue, with the fix, before the step starts (not at the first stop)."""
    env = cluster_env(slurm_cluster)
    log = tmp_path / "job.out"
    app = f"{sys.executable} {ROOT}/tests/job/apps/contract_app.py finish"
    script = write_script(
        tmp_path / "once.sbatch", f"exec hpcckpt run --ckpt-dir {tmp_path}/ck -- {app}\n"
    )
    job = sbatch(["--time=2", "-n", "1", "--no-requeue", f"--output={log}", script], env,
                 cwd=str(tmp_path))  # fmt: skip
    info = follow(job, env, timeout=120)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED", text
    lines = text.splitlines()
    warning = next(i for i, ln in enumerate(lines) if "cannot be requeued" in ln)
    assert lines[warning] == (
        f"hpcckpt: warning: job {job} cannot be requeued: Slurm shows it with Requeue=0 "
        "(submitted with --no-requeue, or without --requeue where the site sets "
        "JobRequeue=0), so a stop would end it after its checkpoint instead of continuing"
    ), text
    assert lines[warning + 1].startswith("hpcckpt: fix: add `#SBATCH --requeue`"), text
    assert warning < next(i for i, ln in enumerate(lines) if "started step" in ln), text


def chain_timeline(infos: list[dict], ckpt: Path) -> str:
    """Each link of a chain: its job's state and run time, then its events but the
    periodic checkpoints (signals, stops, the next link's submission) at seconds after
    its wrapper started."""
    lines = [
        f"job {i.get('JobId')}: {i.get('JobState')} after {i.get('RunTime')} "
        f"(limit {i.get('TimeLimit')}, reason {i.get('Reason')})"
        for i in infos
    ]
    started: dict[str, float] = {}
    for e in read_events(ckpt):
        job = str(e.get("job_id"))
        if e["event"] == "wrapper_start":
            started[job] = e["time"]
        at = e["time"] - started.get(job, e["time"])
        periodic = e["event"] == "checkpoint" and e.get("reason") == "steps"
        if e["event"] != "checkpoint_begin" and not periodic:
            lines.append(f"  {job} +{at:5.1f} s {e['event']} step={e.get('step')}")
    return "\n".join(lines)


@pytest.mark.mpi
def test_chain_mode_through_two_links(slurm_cluster, tmp_path):
    """`hpcckpt submit chain`: each time-limit stop submits the next job; result identical."""
    # 45 s of work in a 1-minute job: Slurm's USR1@50 (it comes 10-40 s in: the controller
    # checks every ~30 s) or the Checkpointer's deadline cuts every link short.
    steps = 450
    reference = heat_reference(tmp_path, steps)
    env = cluster_env(slurm_cluster)
    ckpt = tmp_path / "ckpt"
    heat = [sys.executable, str(EXAMPLES / "heat2d.py"), *HEAT, "--steps", str(steps),
            "--every", "10", "--out", str(tmp_path / "out.npy")]  # fmt: skip
    r = subprocess.run(
        [f"{VENV_BIN}/hpcckpt", "submit", "chain", "--time", "1", "--ntasks", "2",
         "--signal", "USR1@50", "--ckpt-dir", str(ckpt), "--output", f"{tmp_path}/link-%j.out",
         "--script", str(tmp_path / "chain.sbatch"), "--", *heat],  # fmt: skip
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    first = r.stdout.strip()
    infos = follow_chain(first, ckpt, env, timeout=600)
    logs = "\n".join(log_of(p) for p in sorted(tmp_path.glob("link-*.out")))
    # Said in full when it fails (a tuple of dicts is cut to a line): each link's end and
    # when its events came, in seconds after its wrapper started.
    said = f"{chain_timeline(infos, ckpt)}\n{logs}"
    assert len(infos) >= 2, said
    assert all(i["JobState"] == "COMPLETED" for i in infos), said
    assert all(int(i["Restarts"]) == 0 for i in infos), "chain mode must not requeue"
    evs = list(read_events(ckpt))
    subs = [e for e in evs if e["event"] == "chain_submitted"]
    assert [e["chain_next"] for e in subs] == list(range(1, len(infos))), logs
    starts = [e for e in evs if e["event"] == "wrapper_start"]
    assert [e.get("chain_count", 0) for e in starts] == list(range(len(infos)))
    assert "finish" in kinds(ckpt)
    assert np.load(tmp_path / "out.npy").tobytes() == reference.tobytes()


@pytest.mark.mpi
def test_preemption_signal_to_the_tasks_checkpoints_and_requeues(slurm_cluster, tmp_path):
    """`scancel --signal=USR1 JOB` (no -b) reaches the tasks, not the wrapper: still a stop."""
    steps = 150
    reference = heat_reference(tmp_path, steps)
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    script = heat_script(tmp_path, f"--ckpt-dir {ckpt}", steps)
    job = sbatch(["--time=5", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(ROOT))  # fmt: skip
    wait_for_event(ckpt, lambda e: e.get("event") == "checkpoint", timeout=180, job=job, env=env)
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=30)
    info = follow(job, env, timeout=300)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, text
    evs = list(read_events(ckpt))
    stops = [e for e in evs if e["event"] == "stop"]
    assert stops and stops[0]["signal"] == "SIGUSR1", text
    assert [e["cause"] for e in evs if e["event"] == "requeue"] == ["stop"], text
    assert np.load(tmp_path / "out.npy").tobytes() == reference.tobytes()


@pytest.mark.mpi
def test_time_limit_without_signal_checkpoints_by_the_deadline(slurm_cluster, tmp_path):
    """--time=1 and no --signal: the Checkpointer stops by the job's end time, then requeue."""
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    script = heat_script(tmp_path, f"--ckpt-dir {ckpt}", 5000, "--interval 3600")
    t0 = time.monotonic()
    job = sbatch(["--time=1", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(ROOT))  # fmt: skip
    ev = wait_for_event(ckpt, lambda e: e.get("event") == "requeue", timeout=150, job=job, env=env)
    elapsed = time.monotonic() - t0
    subprocess.run(["scancel", job], env=env, timeout=30)
    text = log_of(log)
    assert ev["cause"] == "stop", text
    stops = [e for e in read_events(ckpt) if e["event"] == "stop"]
    assert stops and stops[0]["reason"] == "deadline", text
    assert elapsed < 60, f"the deadline stop came only after {elapsed:.0f} s:\n{text}"
    assert "TIMEOUT" not in job_info(job, env).get("JobState", ""), text


@pytest.mark.mpi
def test_c_application_time_limit_cycle(slurm_cluster, tmp_path):
    """heat1d (C, no Python API) via `hpcckpt submit restart-files`: signal -> restart files
    -> requeue -> resume; bit-identical to an uninterrupted run."""
    build = subprocess.run(["make", "-C", str(EXAMPLES / "c"), f"OUT={tmp_path}"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert build.returncode == 0, build.stderr
    binary = tmp_path / "heat1d"
    # 48 s of work in a 1-minute job: USR1@50 arrives 10-40 s in, before the work is done.
    steps, sleep_ms = 1200, 40
    ref = subprocess.run(
        ["mpirun", "-n", "2", str(binary), str(steps), "0", str(tmp_path / "refrs"),
         str(tmp_path / "ref.bin")],  # fmt: skip
        env=mpi_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    r = subprocess.run(
        [f"{VENV_BIN}/hpcckpt", "submit", "restart-files", "--time", "1", "--ntasks", "2",
         "--signal", "USR1@50", "--ckpt-dir", str(ckpt), "--output", str(log),
         "--script", str(tmp_path / "c.sbatch"),
         "--set", f"RESTART_FILES='{tmp_path}/rs.*'", "--set", "CKPT_EVERY=none",
         "--", str(binary), str(steps), str(sleep_ms), str(tmp_path / "rs"),
         str(tmp_path / "out.bin")],  # fmt: skip
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    info = follow(job, env, timeout=400)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED", text
    assert int(info["Restarts"]) >= 1, text
    evs = list(read_events(ckpt))
    sets = [e for e in evs if e["event"] == "restart_set"]
    assert sets and all(e["stop"] for e in sets) and sets[0]["files"] == 2, text
    ends = [e["outcome"] for e in evs if e["event"] == "step_end"]
    assert ends[-1] == "finished" and set(ends[:-1]) == {"stopped"}, text
    assert "heat1d: resuming after step" in text
    assert (tmp_path / "out.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()
