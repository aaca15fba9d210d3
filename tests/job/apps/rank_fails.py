"""An mpi4py application in which one rank fails mid-run, as a bug in one rank does.

Usage: ``rank_fails.py CKPT_DIR FAILING_RANK HOW`` with HOW ``exit`` (the rank raises an
exception: Python exits 1) or ``kill`` (the rank is SIGKILLed: the OOM killer). The
other ranks go on to their next collective and wait there for it, as real MPI codes do.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import hpcckpt

ckpt_dir, failing, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
ck = hpcckpt.Checkpointer(ckpt_dir, comm, every_steps=1000)
state = {"u": np.zeros(1000)}
for step in range(10_000):
    time.sleep(0.1)
    state["u"] += comm.allreduce(1.0)
    if step == 20 and rank == failing:
        print(f"rank {rank}: failing ({how}) at step {step}", flush=True)
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("a bug in one rank")
ck.finish()
