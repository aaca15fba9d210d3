"""The real srun agrees with hpcckpt/slurm/srun_options.py on where the program starts
(the local Slurm cluster)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpcckpt.slurm import srun_options

pytestmark = pytest.mark.slurm

PROG = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))"]

CASES = [
    ["-n", "1", "-t", "1", *PROG, "-K", "-N", "4"],
    ["-lK", "-n1", *PROG, "-K"],
    ["--ntasks", "1", "--kill-on-bad", "--", *PROG, "a", "-K"],
    ["--exclusive", "-n", "1", *PROG, "-w", "x"],
    ["-D", "/tmp", "--job-name", "-K", *PROG, "--nodes=3"],
    ["-K0", "--mpi", "none", "-I30", *PROG, "--exclude", "n9"],
    ["--kill-on-bad-exit=1", "-N1", "-uQ", *PROG],
]


@pytest.mark.parametrize("args", CASES, ids=range(len(CASES)))
def test_the_real_srun_starts_the_program_where_we_say(slurm_cluster, args):
    _, at = srun_options.parse(args)
    assert args[at : at + len(PROG)] == PROG
    out = subprocess.run(
        ["srun", "-t", "2", *args],
        env=slurm_cluster.slurm_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    line = out.strip().splitlines()[-1]
    line = line.split(": ", 1)[1] if line.startswith("0: ") else line  # -l labels
    assert json.loads(line) == args[at + len(PROG) :]
