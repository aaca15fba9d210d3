"""make demo: the whole cycle on a local Slurm cluster, narrated.

1. bring up the local cluster (munged, slurmctld, slurmd) with ``hpcckpt cluster up``;
2. run heat2d straight through with mpirun, for reference;
3. submit the same run as a batch job with a one-minute limit and ``--signal=B:USR1@50``,
   so Slurm warns it long before it can finish; the wrapper forwards the signal, the
   ranks checkpoint, the wrapper requeues the job; the demo releases each requeued
   job from its ~2 min BeginTime wait; the job resumes from its checkpoint;
4. compare the job's final field with the reference, bit for bit.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "demo-out"
VENV_BIN = Path(sys.executable).parent
HEAT_ARGS = ["--nx", "256", "--ny", "256", "--steps", "450"]
# The batch job computes slowly on purpose (45 s of work against a 1-minute limit), so that
# Slurm's warning signal, which comes 10-40 s in, always cuts the first run short.
SLOW = ["--sleep", "0.1"]


def say(msg: str) -> None:
    print(f"demo: {msg}", flush=True)


def run(cmd: list[str], env: dict[str, str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=env, text=True, capture_output=True, timeout=300, check=False, **kw
    )


def job_info(job: str, env: dict[str, str]) -> dict[str, str]:
    out = run(["scontrol", "show", "job", "-o", job], env).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def main() -> int:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")

    say("starting the local Slurm cluster")
    up = run([str(VENV_BIN / "hpcckpt"), "cluster", "up"], env)
    print(up.stdout + up.stderr, end="")
    if up.returncode != 0:
        return up.returncode
    match = re.search(r"SLURM_CONF=(\S+)", up.stdout)
    if not match:
        say("could not read SLURM_CONF from 'hpcckpt cluster up'")
        return 1
    env["SLURM_CONF"] = match.group(1)

    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    say("reference: heat2d straight through with mpirun -n 2")
    ref = run(
        [
            "mpirun",
            "-n",
            "2",
            sys.executable,
            "examples/heat2d.py",
            *HEAT_ARGS,
            "--ckpt-dir",
            str(OUT / "ref-ckpt"),
            "--out",
            str(OUT / "reference.npy"),
        ],
        env,
        cwd=ROOT,
    )
    if ref.returncode != 0:
        print(ref.stderr)
        return ref.returncode
    print("  " + ref.stdout.strip())

    say("submitting heat2d with a 1-minute limit and --signal=B:USR1@50: every run is cut short")
    sub = run(
        [
            "sbatch",
            "--parsable",
            "--time=1",
            "--signal=B:USR1@50",
            f"--output={OUT / 'job.out'}",
            f"--export=ALL,HPCCKPT_DIR={OUT / 'ckpt'}",
            "examples/heat2d.sbatch",
            *HEAT_ARGS,
            *SLOW,
            "--out",
            str(OUT / "resumed.npy"),
        ],
        env,
        cwd=ROOT,
    )
    if sub.returncode != 0:
        print(sub.stderr)
        return sub.returncode
    job = sub.stdout.strip().split(";")[0]
    say(f"job {job} submitted; following it")

    seen_restarts = 0
    deadline = time.monotonic() + 15 * 60
    while time.monotonic() < deadline:
        info = job_info(job, env)
        state, reason = info.get("JobState", "?"), info.get("Reason", "")
        restarts = int(info.get("Restarts", "0") or 0)
        if restarts > seen_restarts:
            seen_restarts = restarts
            say(f"job {job} was requeued (restart {restarts}); it resumes from its checkpoint")
        if state == "PENDING" and reason == "BeginTime":
            say(
                "releasing the requeued job from its BeginTime wait (scontrol update StartTime=now)"
            )
            run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(2)
    else:
        say("the job did not finish within 15 minutes")
        return 1

    say(f"job {job} ended: {state} after {seen_restarts} requeue(s). Its log:")
    log = (OUT / "job.out").read_text() if (OUT / "job.out").exists() else ""
    for line in log.splitlines():
        if line.startswith(("hpcckpt", "heat2d", "***")):
            print("  | " + line)
    if state != "COMPLETED":
        return 1

    a, b = np.load(OUT / "reference.npy"), np.load(OUT / "resumed.npy")
    same = a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    digest = hashlib.sha256(b.tobytes()).hexdigest()[:16]
    verdict = "bit-identical to" if same else "DIFFERENT from"
    print(
        f"VERDICT: after {seen_restarts} signal/checkpoint/requeue cycle(s) the resumed result "
        f"is {verdict} the uninterrupted run (sha256 {digest})"
    )
    return 0 if same and seen_restarts >= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
