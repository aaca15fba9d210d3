"""Test app: one rank raises the stop signal at a step; all ranks must stop at one step."""

import json
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

import hpcckpt

directory, signal_rank, signal_step, nsteps = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    int(sys.argv[4]),
)
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
state = {"x": np.full(1000, float(rank)), "step": 0}
ck = hpcckpt.Checkpointer(directory, comm=comm)
start = ck.restore(state)
saved = []
for step in range(0 if start is None else start + 1, nsteps):
    state["x"] += 1.0
    state["step"] = step
    if rank == signal_rank and step == signal_step:
        os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.001 * rank)  # ranks drift apart a little
    if ck.due(step):
        ck.save(step, state)
        saved.append(step)
        if ck.stop_requested:
            break
else:
    ck.finish()
report = {"rank": rank, "saved": saved, "stop": ck.stop_requested}
with open(os.path.join(directory, f"report-{rank}.json"), "w") as f:  # stdout lines interleave
    json.dump(report, f)
