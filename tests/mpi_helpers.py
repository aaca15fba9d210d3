"""Run Python under real ``mpirun`` from tests. Missing MPI is a failure, never a skip."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    env.update(extra or {})
    return env


def mpirun_cmd(n: int, args: Sequence[str]) -> list[str]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun not found: install openmpi-bin (make setup does)")
    return [
        mpirun,
        "-n",
        str(n),
        "--oversubscribe",
        sys.executable,
        "-m",
        "mpi4py",
        *map(str, args),
    ]


def mpirun(
    n: int, args: Sequence[str], *, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` on ``n`` ranks; the finished process, whatever its exit code."""
    return subprocess.run(
        mpirun_cmd(n, args), env=mpi_env(env), capture_output=True, text=True, timeout=timeout
    )


def rank_reports(stdout: str, n: int) -> list[dict]:
    """The JSON objects the ranks printed, sorted by ``rank``; there must be ``n``.

    Ranks print at the same moment and mpirun may join their lines ("{...}{...}"), so
    each line is decoded object by object rather than as one document.
    """
    decoder = json.JSONDecoder()
    reports = []
    for line in stdout.splitlines():
        at = 0
        while line.startswith("{", at):
            report, at = decoder.raw_decode(line, at)
            reports.append(report)
    assert len(reports) == n, f"expected {n} rank reports, got {len(reports)}:\n{stdout}"
    return sorted(reports, key=lambda rep: rep["rank"])


def start_mpirun(
    n: int, args: Sequence[str], *, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        mpirun_cmd(n, args),
        env=mpi_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
