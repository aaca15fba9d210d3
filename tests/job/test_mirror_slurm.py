"""The mirror (second tier) in real batch jobs on the local Slurm: ``hpcckpt srun --mirror
s3://...`` against the real S3 server of the tests (tests/s3_server.py), the endpoint and
credentials passed the standard way, through the job's environment (``AWS_*``).

examples/heat2d.py checkpoints with the Checkpointer; each final field is compared with an
uninterrupted run's, byte for byte.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.rundir.events import read_events
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror.backend import open_backend
from tests.mpi_helpers import EXAMPLES, mpirun
from tests.slurm_helpers import (
    FINAL,
    RELEASE_AFTER,
    cluster_env,
    follow,
    job_info,
    sbatch,
    wait_for_event,
)

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

VENV_BIN = str(Path(sys.executable).parent)
HEAT = [str(EXAMPLES / "heat2d.py"), "--nx", "64", "--ny", "64", "--every", "10"]


def job_env(cluster, s3_server) -> dict[str, str]:
    """The submitting shell's environment: the venv first on PATH, the checkout on
    PYTHONPATH, no Slurm or hpcckpt variables of an enclosing job, and the S3 store's
    endpoint and credentials (sbatch exports them to the job, srun to the ranks)."""
    env = cluster_env(cluster)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        env.pop(key, None)
    env.update(s3_server.env())
    return env


def reference(tmp_path: Path, steps: int) -> bytes:
    out = tmp_path / "reference.npy"
    r = mpirun(2, [*HEAT, "--steps", str(steps), "--ckpt-dir", tmp_path / "ref", "--out", out])
    assert r.returncode == 0, r.stderr
    return np.load(out).tobytes()


def submit(
    tmp_path: Path,
    env: dict[str, str],
    url: str,
    steps: int,
    sleep: float,
    limit: tuple[str, ...] = ("--time=5",),
) -> str:
    ckpt, out, log = tmp_path / "ckpt", tmp_path / "out.npy", tmp_path / "job.out"
    app = [sys.executable, *HEAT, "--steps", str(steps), "--sleep", str(sleep), "--out", str(out)]
    wrapper = [f"{VENV_BIN}/hpcckpt", "srun", "--ckpt-dir", str(ckpt), "--mirror", url,
               "--", "--mpi=pmix", "-n", "2", *app]  # fmt: skip
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\ntrap '' USR1 USR2\nexec " + shlex.join(wrapper) + "\n")
    script.chmod(0o755)
    return sbatch([*limit, "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                   script], env, cwd=str(tmp_path))  # fmt: skip


def log_of(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"


def job_processes(job: str) -> list[int]:
    """Pids of every process of ``job`` still alive (the batch shell's included)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            raw = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in raw.split(b"\0"):
            found.append(int(entry))
    return found


def wait_requeued(job: str, env: dict[str, str], timeout: float = 180) -> None:
    """Until the job waits in PENDING (BeginTime) after a requeue and no process of its
    first run is left: its checkpoint directory is then nobody's."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job, env)
        assert info.get("JobState") not in FINAL, f"the job ended, not requeued: {info}"
        if info.get("JobState") == "PENDING" and not job_processes(job):
            return
        time.sleep(0.3)
    pytest.fail(f"job {job} was not requeued within {timeout} s: {job_info(job, env)}")


def of(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["event"] == kind]


def test_a_checkpoint_directory_wiped_between_segments_resumes_from_s3(
    slurm_cluster, s3_mirror, tmp_path
):
    """Stopped by the batch shell's signal, the stop's checkpoint waited for on S3,
    requeued; the checkpoint directory is removed while the job waits (scratch purged);
    the next segment restores the stop's step from the mirror (event ``restore``, tier
    ``mirror``) and finishes bit-identical to an uninterrupted run."""
    steps = 150
    expected = reference(tmp_path, steps)
    env = job_env(slurm_cluster, s3_mirror.server)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    job = submit(tmp_path, env, s3_mirror.url, steps, sleep=0.1)
    wait_for_event(ckpt, lambda e: e.get("event") == "mirrored" and e.get("step", 0) >= 19,
                   timeout=120, job=job, env=env)  # fmt: skip
    subprocess.run(["scancel", "-b", "--signal=USR1", job], env=env, check=True, timeout=30)
    wait_requeued(job, env)
    first = list(read_events(ckpt))
    (stop,) = of(first, "stop")
    stopped_at = stop["step"]
    assert 19 < stopped_at < steps - 1, f"stopped at step {stopped_at}: not mid-run"
    waited = of(first, "mirror_wait")
    assert waited and waited[-1]["done"] and waited[-1]["step"] == stopped_at, first
    assert of(first, "requeue"), log_of(log)
    shutil.rmtree(ckpt)  # scratch purged while the job waited

    time.sleep(RELEASE_AFTER)
    info = follow(job, env, timeout=240)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, text
    second = list(read_events(ckpt))
    (restore,) = [e for e in of(second, "restore") if e.get("step") is not None]
    assert restore["tier"] == "mirror" and restore["step"] == stopped_at, second
    assert f"restored step {stopped_at} from the mirror" in text
    assert not of(second, "mirror_failed"), second
    assert np.load(tmp_path / "out.npy").tobytes() == expected
    newest = mirror.newest_good(open_backend(s3_mirror.url))
    assert newest is not None and newest.step == steps - 1


def test_the_store_down_then_back_never_stalls_the_run_and_the_mirror_catches_up(
    slurm_cluster, own_s3_server, tmp_path
):
    """The S3 store refuses connections from the job's start for several checkpoints, then
    comes back on the same port: the checkpoints went on while it was down (``mirror_failed``
    with the reason, never a save held up), the mirror caught up once it was back
    (``mirrored``) and finish() found the last checkpoint there; the result is
    bit-identical to an uninterrupted run."""
    steps = 150
    expected = reference(tmp_path, steps)
    own_s3_server.bucket("down")
    url = "s3://down/run"
    env = job_env(slurm_cluster, own_s3_server)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    own_s3_server.stop()
    job = submit(tmp_path, env, url, steps, sleep=0.1)
    wait_for_event(ckpt, lambda e: e.get("event") == "checkpoint" and e.get("step", 0) >= 39,
                   timeout=120, job=job, env=env)  # fmt: skip
    down_until = max(e["step"] for e in of(list(read_events(ckpt)), "checkpoint"))
    own_s3_server.start()
    info = follow(job, env, timeout=240)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 0, text

    events = list(read_events(ckpt))
    saves = {e["step"]: e["time"] for e in of(events, "checkpoint")}
    assert [s for s in saves if s <= down_until] == list(range(9, down_until + 1, 10))
    # 10 steps of 0.1 s between checkpoints while the store was down: no save waited on it
    gaps = [saves[s + 10] - saves[s] for s in range(9, down_until, 10)]
    assert max(gaps) < 5.0, gaps
    failed = of(events, "mirror_failed")
    assert failed and failed[0]["step"] == 9, failed
    assert all("refused" in e["reason"] for e in failed), failed
    mirrored = [e["step"] for e in of(events, "mirrored")]
    assert mirrored and mirrored[-1] == steps - 1, events
    (waited,) = of(events, "mirror_wait")
    assert waited["done"] and waited["step"] == steps - 1, waited
    assert np.load(tmp_path / "out.npy").tobytes() == expected
    newest = mirror.newest_good(open_backend(url))
    assert newest is not None and newest.step == steps - 1


def test_a_stop_with_the_store_down_is_requeued_before_the_end_and_the_mirror_catches_up(
    slurm_cluster, own_s3_server, tmp_path
):
    """The S3 store is down when Slurm's ``--signal=B:USR1@55`` comes to a 1-minute job:
    the stop's wait for the mirror (``mirror_wait`` 300 s) is cut so that the job is
    requeued before its end time, and says so; the next segment resumes from the
    directory, sends the stop's checkpoint to the store, back by then, and finishes
    bit-identical, the stop's and the last checkpoint verified on the mirror."""
    steps = 450  # 45 s of work: USR1@55 arrives 5-35 s in, so the first run always stops
    expected = reference(tmp_path, steps)
    own_s3_server.bucket("stopdown")
    url = "s3://stopdown/run"
    env = job_env(slurm_cluster, own_s3_server)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    own_s3_server.stop()
    job = submit(tmp_path, env, url, steps, sleep=0.1,
                 limit=("--time=1", "--signal=B:USR1@55"))  # fmt: skip
    # The node may run another session's job first: the limit counts from the start.
    wait_for_event(ckpt, lambda e: e.get("event") == "wrapper_start", timeout=600, job=job,
                   env=env)  # fmt: skip
    wait_for_event(ckpt, lambda e: e.get("event") == "requeue", timeout=120, job=job, env=env)
    wait_requeued(job, env)
    first = list(read_events(ckpt))
    (stop,) = of(first, "stop")
    stopped_at = stop["step"]
    (waited,) = of(first, "mirror_wait")
    assert waited["reason"] == "stop" and waited["step"] == stopped_at, waited
    assert waited["done"] is False and waited["newest_mirrored"] is None, waited
    assert 0 <= waited["cut_to"] < 55 and waited["seconds"] < 60, waited
    (requeue,) = of(first, "requeue")
    assert requeue["time"] < waited["job_end"], (requeue, waited)  # before Slurm's limit
    text = log_of(log)
    assert f"step {stopped_at} did not reach the mirror within" in text, text
    assert "(stop; mirror_wait 300 s cut for the time limit: the job ends in" in text, text
    assert f"keeps it ({ckpt}) and the next run copies it" in text, text

    own_s3_server.start()
    # The next segment gets 5 minutes: it finishes before another USR1 comes.
    subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=5"], env=env, check=True,
                   timeout=30)  # fmt: skip
    info = follow(job, env, timeout=600)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, text
    events = list(read_events(ckpt))
    later = events[len(first) :]
    (restore,) = [e for e in of(later, "restore") if e.get("step") is not None]
    assert restore["tier"] == "directory" and restore["step"] == stopped_at, later
    assert stopped_at in [e["step"] for e in of(later, "mirrored")], later  # caught up
    assert np.load(tmp_path / "out.npy").tobytes() == expected
    backend = open_backend(url)
    assert mirror.verify_mirrored(backend, str(stopped_at)).good
    newest = mirror.newest_good(backend)
    assert newest is not None and newest.step == steps - 1
    assert mirror.verify_mirrored(backend, str(steps - 1)).good
