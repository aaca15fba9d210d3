"""Test app: synchronous saves that let the writer choose direct or buffered writes.

    path_app.py DIR --saves N --mib M [--direct-io yes|no]

Every rank saves M MiB N times (``CheckpointStore.save``, full saves), then rank 0
restores the last one; rank 0 prints one JSON line: per rank, the path of every
save, the decisions made, and whether the restored state is the last one saved.
"""

import argparse
import json
import sys

import numpy as np
from mpi4py import MPI

from hpcckpt.store.io.filesystem import TuningOptions
from hpcckpt.store.store import CheckpointStore

ap = argparse.ArgumentParser()
ap.add_argument("directory")
ap.add_argument("--saves", type=int, required=True)
ap.add_argument("--mib", type=int, required=True)
ap.add_argument("--direct-io", choices=["yes", "no"])
args = ap.parse_args()
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
forced = None if args.direct_io is None else args.direct_io == "yes"
store = CheckpointStore(
    args.directory, comm, incremental=False, fs_tuning=TuningOptions(direct_io=forced)
)
u = np.zeros(args.mib * (1 << 20) // 8)
paths, decisions = [], []
for step in range(args.saves):
    u[:] = rank * 1000 + step
    result = store.save(step, {"u": u})
    paths.append(result.write_path)
    if result.write_decision:
        decisions.append({"step": step, **result.write_decision})
back = {"u": np.empty_like(u)}
restored = CheckpointStore(args.directory, comm).restore(back)
ok = restored is not None and restored.step == args.saves - 1 and np.array_equal(back["u"], u)
every = comm.gather({"rank": rank, "paths": paths, "decisions": decisions, "restored": ok})
if rank == 0:
    print(json.dumps(every))
    sys.stdout.flush()
