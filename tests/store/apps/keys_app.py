"""Test app: a strict restore whose state's keys differ from the checkpoint's.

    keys_app.py save DIR          save {"u": ..., "k": 7} as step 7
    keys_app.py renamed DIR WHO   restore with "u" renamed "v" on every rank (WHO=all) or
                                  on the last rank only (WHO=last); report the error

Rank 0 prints one JSON line per rank.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.store import CheckpointStore

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
mode, directory = sys.argv[1], sys.argv[2]


def report(**fields) -> None:
    reports = comm.gather({"rank": rank, **fields}, root=0)
    if rank == 0:
        print("\n".join(json.dumps(r) for r in reports), flush=True)


if mode == "save":
    CheckpointStore(directory, comm).save(7, {"u": np.arange(4.0) + rank, "k": 7})
    report(ok=True)
elif mode == "renamed":
    renamed = sys.argv[3] == "all" or rank == size - 1
    state = {"v" if renamed else "u": np.zeros(4), "k": 0}
    try:
        CheckpointStore(directory, comm).restore(state)
        report(error=None)
    except CheckpointError as exc:
        held = state["v" if renamed else "u"]
        report(error=str(exc), renamed=renamed, keys=sorted(state), untouched=not held.any())
else:
    raise SystemExit(f"unknown mode {mode}")
