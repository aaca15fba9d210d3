"""Submit and follow real batch jobs on the local cluster from tests."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Sequence

import pytest

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


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
    job: str, env: dict[str, str], timeout: float = 600, release: bool = True
) -> dict[str, str]:
    """Wait for the job to end, releasing requeued runs from their BeginTime wait; final info."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job, env)
        if info.get("JobState") in FINAL:
            return info
        if release and info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
            subprocess.run(
                ["scontrol", "update", f"JobId={job}", "StartTime=now"],
                env=env,
                capture_output=True,
                timeout=30,
            )
        time.sleep(1)
    subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    pytest.fail(f"job {job} did not end within {timeout} s (last: {job_info(job, env)})")
