"""Every way a Slurm job is stopped, on the local cluster, with examples/c/stopapp.c.

stopapp behaves like the compiled codes of the wild: ``term`` checkpoints on the first
SIGTERM (>= 10 s, in pieces), exits 1, dies at once on a second TERM, ignores USR1;
``periodic`` takes no signal and rewrites its restart files every few steps. Each test
submits real batch jobs and compares the final field with an uninterrupted run.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcckpt.job.events import read_events
from tests.mpi_helpers import EXAMPLES, ROOT, mpi_env
from tests.slurm_helpers import FINAL, RELEASE_AFTER, job_info, sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

VENV_BIN = str(Path(sys.executable).parent)
HPCCKPT = f"{VENV_BIN}/hpcckpt"


def cluster_env(cluster) -> dict[str, str]:
    env = dict(os.environ, **cluster.env())
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for key in [k for k in env if k.startswith(("SLURM_", "HPCCKPT_")) and k != "SLURM_CONF"]:
        del env[key]
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


@pytest.fixture(scope="module")
def stopapp(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stopapp")
    build = subprocess.run(["make", "-C", str(EXAMPLES / "c"), f"OUT={out}", f"{out}/stopapp"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert build.returncode == 0, build.stderr
    return out / "stopapp"


def reference(binary: Path, tmp_path: Path, mode_args: list[str]) -> bytes:
    """The result of an uninterrupted run (no sleep)."""
    mode, steps, _sleep, *rest = mode_args
    args = [mode, steps, "0", str(tmp_path / "ref-rs"), str(tmp_path / "ref.bin"), *rest]
    r = subprocess.run(["mpirun", "-n", "2", str(binary), *args], env=mpi_env(),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return (tmp_path / "ref.bin").read_bytes()


def app_args(binary: Path, tmp_path: Path, mode_args: list[str]) -> list[str]:
    mode, steps, sleep, *rest = mode_args
    return [str(binary), mode, steps, sleep, str(tmp_path / "rs"), str(tmp_path / "out.bin"),
            *rest]  # fmt: skip


def launcher_words(launcher: str, app: list[str]) -> list[str]:
    if launcher == "srun":
        return ["srun", "--", "--mpi=pmix", "-n", "2", *app]
    return ["run", "--", "mpirun", "-n", "2", *app]


def write_script(path: Path, line: str, header: str = "") -> Path:
    path.write_text(f"#!/bin/bash\n{header}{line}\n")
    path.chmod(0o755)
    return path


def log_of(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"


def drive(job: str, env: dict[str, str], ckpt: Path, timeout: float, on_start=None) -> dict:
    """Follow the job to its end, releasing requeued runs; ``on_start(restart, seconds since
    that run's wrapper_start)`` is called every half second while a run is going on."""
    deadline = time.monotonic() + timeout
    held_since = None
    seen: dict[int, float] = {}
    while time.monotonic() < deadline:
        info = job_info(job, env)
        if info.get("JobState") in FINAL:
            return info
        for ev in read_events(ckpt) if ckpt.exists() else []:
            if ev.get("event") == "wrapper_start" and ev["restart"] not in seen:
                seen[ev["restart"]] = time.monotonic()
        if on_start is not None and seen and info.get("JobState") == "RUNNING":
            restart = max(seen)
            on_start(restart, time.monotonic() - seen[restart])
        held = info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
        held_since = (held_since or time.monotonic()) if held else None
        if held and time.monotonic() - held_since >= RELEASE_AFTER:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env,
                           capture_output=True, timeout=30)  # fmt: skip
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    pytest.fail(f"job {job} did not end within {timeout} s (last: {job_info(job, env)})")


def events_of(ckpt: Path, kind: str) -> list[dict]:
    return [e for e in read_events(ckpt) if e["event"] == kind]


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_term_app_three_segments(slurm_cluster, tmp_path, stopapp, launcher):
    """The B: signal becomes the app's TERM, delivered once to every rank (scancel --signal
    JOB under srun, the rank processes under mpirun): three segments, each resuming later,
    every run's exit status 1 after complete restart files is a stop; result identical."""
    mode = ["term", "400", "50"]
    expected = reference(stopapp, tmp_path, mode)
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    wrapper = [HPCCKPT, *launcher_words(launcher, app_args(stopapp, tmp_path, mode))]
    opts = ["--ckpt-dir", str(ckpt), "--app-signal", "TERM", "--app-ready", "2",
            "--restart-files", f"{tmp_path}/rs.*"]  # fmt: skip
    wrapper[2:2] = opts
    script = write_script(tmp_path / "job.sbatch", "exec " + shlex.join(wrapper))
    job = sbatch(["--time=5", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(tmp_path))  # fmt: skip
    signalled: set[int] = set()

    def stop_twice(restart: int, running_for: float) -> None:
        if restart < 2 and restart not in signalled and running_for > 6:
            signalled.add(restart)  # what Slurm's --signal=B:USR1@T does, at a known moment
            subprocess.run(["scancel", "-b", "--signal=USR1", job], env=env, timeout=30)

    info = drive(job, env, ckpt, timeout=300, on_start=stop_twice)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 2, text
    delivered = events_of(ckpt, "signal_delivered")
    path = "scancel" if launcher == "srun" else "ranks"
    assert [(e["signal"], e["path"]) for e in delivered] == [("TERM", path)] * 2, text
    assert text.count("stopapp: stop signal; writing restart files") == 2, text
    sets = events_of(ckpt, "restart_set")
    assert [e["stop"] for e in sets] == [True, True] and all(e["seconds"] >= 10 for e in sets)
    ends = [(e["outcome"], e["exit_code"]) for e in events_of(ckpt, "step_end")]
    assert [o for o, _ in ends] == ["stopped", "stopped", "finished"], text
    assert ends[0][1] != 0, "stopapp exits 1 after its restart files: still a stop"
    resumed = [int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("stopapp: resuming after step")]  # fmt: skip
    assert len(resumed) == 2 and 0 < resumed[0] < resumed[1] < 400, text
    assert not events_of(ckpt, "crashed"), text
    assert (tmp_path / "out.bin").read_bytes() == expected
