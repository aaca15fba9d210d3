"""Submit and follow real batch jobs on the local cluster from tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.mpi_helpers import ROOT

#: Seconds a requeued job stays in PENDING/BeginTime before follow() releases it.
RELEASE_AFTER = 2.0
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


def cluster_env(cluster) -> dict[str, str]:
    """The submitting shell's environment for ``cluster``: this venv's hpcckpt and python
    first on PATH, the checkout on PYTHONPATH, no Slurm or hpcckpt variables of an
    enclosing job."""
    env = dict(os.environ, **cluster.env())
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for key in [k for k in env if k.startswith(("SLURM_", "HPCCKPT_")) and k != "SLURM_CONF"]:
        del env[key]
    return env


def sbatch(args: Sequence[str], env: dict[str, str], cwd: str | None = None) -> str:
    """Submit; returns the job id. A failed submission fails the test."""
    r = subprocess.run(
        ["sbatch", "--parsable", *map(str, args)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if r.returncode != 0:
        pytest.fail(f"sbatch failed: {r.stderr.strip()}")
    return r.stdout.strip().split(";")[0]


def job_info(job: str, env: dict[str, str]) -> dict[str, str]:
    r = subprocess.run(
        ["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True, timeout=30
    )
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout))


def follow(
    job: str,
    env: dict[str, str],
    timeout: float = 600,
    release: bool = True,
    on_poll: Callable[[dict[str, str]], None] | None = None,
) -> dict[str, str]:
    """Wait for the job to end, releasing requeued runs from their BeginTime wait; final info.

    ``on_poll(info)``: called with the job's info every second until it ends, before a
    held run is released."""
    deadline = time.monotonic() + timeout
    held_since: float | None = None
    while time.monotonic() < deadline:
        info = job_info(job, env)
        if info.get("JobState") in FINAL:
            return info
        if on_poll is not None:
            on_poll(info)
        held = info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
        if not held:
            held_since = None
        elif held_since is None:
            held_since = time.monotonic()
        # Not at once: slurmd revokes the job's credential at the requeue with a time
        # stamp in whole seconds; a restart in the same second is refused ("Job credential
        # revoked") and the job ends FAILED. Two seconds later it starts normally.
        if release and held and time.monotonic() - held_since >= RELEASE_AFTER:
            subprocess.run(
                ["scontrol", "update", f"JobId={job}", "StartTime=now"],
                env=env,
                capture_output=True,
                timeout=30,
            )
        time.sleep(1)
    subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    pytest.fail(f"job {job} did not end within {timeout} s (last: {job_info(job, env)})")


def wait_for_event(ckpt, predicate, timeout: float = 120, job: str | None = None, env=None):
    """Poll ``ckpt/events.jsonl`` until an event satisfies ``predicate``; returns it."""
    from hpcckpt.rundir.events import read_events

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in read_events(ckpt):
            if predicate(ev):
                return ev
        if job is not None and env is not None and job_info(job, env).get("JobState") in FINAL:
            break
        time.sleep(0.3)
    pytest.fail(f"no matching event in {ckpt}/events.jsonl within {timeout} s")


def job_task_pids(job: str, procid: int | None = None) -> list[int]:
    """Pids of the tasks of ``job`` (SLURM_JOB_ID and SLURM_STEP_ID in their environment)."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = open(f"/proc/{entry}/environ", "rb").read()
        except OSError:
            continue
        env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        if env.get(b"SLURM_JOB_ID") != job.encode() or b"SLURM_STEP_ID" not in env:
            continue
        if env.get(b"SLURM_STEP_ID") == b"batch" or b"SLURM_PROCID" not in env:
            continue
        if procid is not None and env.get(b"SLURM_PROCID") != str(procid).encode():
            continue
        found.append(int(entry))
    return found


def follow_chain(first: str, ckpt, env: dict[str, str], timeout: float = 600) -> list[dict]:
    """Follow a --chain computation job by job (``chain_submitted`` events); each final info."""
    from hpcckpt.rundir.events import read_events

    infos = []
    job = first
    deadline = time.monotonic() + timeout
    while True:
        info = follow(job, env, timeout=max(10.0, deadline - time.monotonic()))
        infos.append(info)
        nxt = [
            e["next_job"]
            for e in read_events(ckpt)
            if e.get("event") == "chain_submitted" and e.get("job_id") == job
        ]
        if not nxt:
            return infos
        job = nxt[-1]
