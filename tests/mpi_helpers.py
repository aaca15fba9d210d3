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


#: What Open MPI sets in a process that initialized MPI alone (a singleton: a test that
#: imported mpi4py.MPI): an mpirun started with them takes itself for one of that job's
#: processes and exits 1 without a word.
SINGLETON_ENV = (
    "PMIX_",
    "OMPI_MCA_ess",
    "OMPI_MCA_orte_",
    "OMPI_MCA_pmix",
    "OMPI_APP_CTX_",
    "OMPI_COMM_WORLD_",
    "OMPI_NUM_APP_CTX",
    "OMPI_FIRST_RANKS",
    "OMPI_UNIVERSE_SIZE",
    "OMPI_FILE_LOCATION",
)


def mpi_env(extra: dict[str, str] | None = None, *, checkout: bool = True) -> dict[str, str]:
    """The environment of an mpirun: root allowed, oversubscription, and the checkout on
    ``PYTHONPATH``, unless ``checkout`` is False (a venv that must use its installed
    hpcckpt: then ``PYTHONPATH`` is removed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SINGLETON_ENV)}
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
    )
    if checkout:
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    else:
        env.pop("PYTHONPATH", None)
    env.update(extra or {})
    return env


def mpirun_cmd(
    n: int, args: Sequence[str], *, python: str | os.PathLike | None = None
) -> list[str]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun not found: install openmpi-bin (make setup does)")
    return [
        mpirun,
        "-n",
        str(n),
        "--oversubscribe",
        str(python or sys.executable),
        "-m",
        "mpi4py",
        *map(str, args),
    ]


def mpirun(
    n: int,
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    python: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` on ``n`` ranks; the finished process, whatever its exit code.

    ``python``: another interpreter (a venv's) instead of the one running the tests,
    without the checkout on its path, so that it imports its own hpcckpt (``-m mpi4py
    SCRIPT`` puts the script's folder first on the path, not the working directory).
    """
    return subprocess.run(
        mpirun_cmd(n, args, python=python),
        env=mpi_env(env, checkout=python is None),
        capture_output=True,
        text=True,
        timeout=timeout,
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


# -- examples/heat2d.py: a crash mid-run, a resume, the result bit-identical -------------------

#: heat2d on a small grid: a run of 60 steps takes about a second.
HEAT2D = [str(EXAMPLES / "heat2d.py"), "--nx", "64", "--ny", "48"]


def heat2d(
    n: int, ckpt: Path, *extra: str, python: str | os.PathLike | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``examples/heat2d.py`` on ``n`` ranks, checkpointing into ``ckpt``."""
    return mpirun(n, [*HEAT2D, "--ckpt-dir", ckpt, *extra], python=python, timeout=timeout)


def heat2d_reference(n: int, tmp: Path, *, python: str | os.PathLike | None = None):
    """The final field of an uninterrupted 60-step run (a numpy array)."""
    import numpy as np

    out = tmp / f"ref{n}.npy"
    r = heat2d(n, tmp / f"ref{n}", "--steps", "60", "--out", str(out), python=python)
    assert r.returncode == 0, r.stderr
    return np.load(out)


def heat2d_crash_and_resume(n: int, tmp: Path, *, python: str | os.PathLike | None = None):
    """Run 60 steps checkpointing every 10, rank 1 dying at step 35, then resume.

    Checks what the crash left (checkpoints 29, 19, 9, no partial file, status
    ``running``) and that the resumed run restored step 29 rather than starting over and
    finished; returns its final field, to compare with :func:`heat2d_reference`.
    """
    import numpy as np

    from hpcckpt.rundir.events import read_events
    from hpcckpt.rundir.status import read_status
    from hpcckpt.store.file import layout

    ck, out = tmp / "ck", tmp / "out.npy"
    every = ["--steps", "60", "--every", "10"]
    crashed = heat2d(n, ck, *every, "--crash-at", "35", python=python)
    assert crashed.returncode != 0, "the injected crash must fail the run"
    assert [e.step for e in layout.scan(ck)] == [29, 19, 9], crashed.stderr
    assert layout.partials(ck) == []
    assert read_status(ck).state == "running"

    resumed = heat2d(n, ck, *every, "--out", str(out), python=python)
    assert resumed.returncode == 0, resumed.stderr
    assert "restored step 29" in resumed.stderr, "the resumed run must not start over"
    assert read_status(ck).state == "finished"
    kinds = [e["event"] for e in read_events(ck)]
    assert kinds.count("checkpoint") == 6  # 9, 19, 29 before the crash; 39, 49, 59 after
    return np.load(out)


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
