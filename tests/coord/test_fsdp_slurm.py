"""FSDP2 training (tests/coord/apps/fsdp_app.py) as a real batch job on the local Slurm:
``hpcckpt srun -- --mpi=pmix -n 2 python fsdp_app.py``, stopped mid-run by the batch
shell's warning signal, checkpointed, requeued by the wrapper and resumed. Every loss,
and the final parameters and AdamW moments, equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcckpt.rundir.events import read_events
from tests.mpi_helpers import ROOT, mpirun
from tests.slurm_helpers import FINAL, cluster_env, follow, job_info, sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

APP = ROOT / "tests" / "coord" / "apps" / "fsdp_app.py"
VENV_BIN = str(Path(sys.executable).parent)
STEPS = 8


def logged_steps(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_a_signalled_requeued_job_resumes_bit_identical(slurm_cluster, tmp_path):
    ref = mpirun(2, [APP, tmp_path / "ref", "--out", tmp_path / "ref.json", "--steps", STEPS],
                 timeout=240)  # fmt: skip
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    reference = json.loads((tmp_path / "ref.json").read_text())

    env = cluster_env(slurm_cluster)
    ckpt, log, out, joblog = (tmp_path / n for n in ("ckpt", "losses.jsonl", "out.json", "job.out"))
    app = [sys.executable, APP, ckpt, "--out", out, "--steps", STEPS, "--sleep", "2",
           "--log", log]  # fmt: skip
    wrapper = [f"{VENV_BIN}/hpcckpt", "srun", "--ckpt-dir", ckpt, "--", "--mpi=pmix", "-n", "2",
               *app]  # fmt: skip
    script = tmp_path / "job.sbatch"
    wrapper_line = shlex.join(map(str, wrapper))
    script.write_text(f"#!/bin/bash\ntrap '' USR1 USR2\nexec {wrapper_line}\n")
    job = sbatch(["--time=5", "-n", "2", "--requeue", "--open-mode=append",
                  f"--output={joblog}", script], env, cwd=str(tmp_path))  # fmt: skip

    # What Slurm's --signal=B:USR1@T does, at a known moment: once step 1 is logged.
    deadline = time.monotonic() + 180
    while not any(e["step"] >= 1 for e in logged_steps(log)):
        state = job_info(job, env).get("JobState")
        assert state not in FINAL, f"the job ended before the signal:\n{joblog.read_text()}"
        assert time.monotonic() < deadline, "no step logged within 180 s"
        time.sleep(0.3)
    subprocess.run(["scancel", "-b", "--signal=USR1", job], env=env, check=True, timeout=30)
    info = follow(job, env, timeout=300)
    text = joblog.read_text(errors="replace") if joblog.exists() else "(no log)"
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, text

    events = list(read_events(ckpt))
    stops = [e for e in events if e["event"] == "stop"]
    assert len(stops) == 1 and stops[0]["reason"] == "signal", text
    stopped_at = stops[0]["step"]
    assert 1 <= stopped_at <= STEPS - 2, f"stopped at step {stopped_at}: not mid-run"
    assert [e["event"] for e in events].count("requeue") == 1, text
    restored = [e["step"] for e in events if e["event"] == "restore" and e.get("step") is not None]
    assert restored == [stopped_at], events

    logged = logged_steps(log)
    assert [e["step"] for e in logged] == list(range(STEPS)), text
    assert {str(e["step"]): e["losses"] for e in logged} == reference["losses"]
    result = json.loads(out.read_text())
    assert result["restored"] == stopped_at and result["error"] is None
    assert result["local"] == reference["local"]
    assert result["full"] == reference["full"]
