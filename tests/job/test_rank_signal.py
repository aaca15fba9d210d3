"""The per-node rank signaller (hpcckpt/job/rank_signal.py), against real processes.

Two "ranks" of job 77 pretend to run on nodes na and nb of one machine (as on the
local multi-node cluster, where every node shares this /proc); a signaller started as
node na's must signal only na's rank."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hpcckpt.job import rank_signal

SLEEPER = (
    "import signal, sys, time\n"
    "def on_term(*_):\n"
    "    open(sys.argv[1], 'w').write('TERM')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, on_term)\n"
    "time.sleep(60)\n"
)


def _rank(tmp_path: Path, rank: int, node: str, job: str = "77") -> tuple[subprocess.Popen, Path]:
    mark = tmp_path / f"got-{job}-{node}-{rank}"
    env = dict(os.environ, OMPI_COMM_WORLD_RANK=str(rank), SLURM_JOB_ID=job, SLURMD_NODENAME=node)
    return subprocess.Popen([sys.executable, "-c", SLEEPER, str(mark)], env=env), mark


def test_each_node_signals_only_its_own_ranks(tmp_path):
    procs = [_rank(tmp_path, 0, "na"), _rank(tmp_path, 1, "nb"), _rank(tmp_path, 0, "na", "78")]
    try:
        time.sleep(1.0)  # their handlers installed
        env = dict(os.environ, SLURMD_NODENAME="na")
        out = subprocess.run([sys.executable, "-m", "hpcckpt.job.rank_signal", "TERM", "77"],
                             env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        (report,) = rank_signal.parse_reports("srun: noise\n" + out.stdout)
        assert report == {"node": "na", "signal": "TERM", "pids": [procs[0][0].pid], "ranks": [0]}
        procs[0][0].wait(timeout=10)
        assert procs[0][1].read_text() == "TERM"
        time.sleep(0.3)
        assert procs[1][0].poll() is None and not procs[1][1].exists()  # node nb's rank
        assert procs[2][0].poll() is None and not procs[2][1].exists()  # another job's rank
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.wait()


def test_bad_arguments_say_what_is_wrong():
    assert rank_signal.main(["TERM"]) == 2
    assert rank_signal.main(["NOSUCH", "77"]) == 2
    assert rank_signal.ranks_here("no-such-job", None) == {}
