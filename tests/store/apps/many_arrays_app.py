"""Test app: every rank saves a state of COUNT small arrays, a new store restores it.

    many_arrays_app.py DIR COUNT

The file's per-(rank, array) tables then outgrow what an HDF5 object header holds
(64 KiB) once ranks x arrays passes about 8,000, as a model's parameters and optimizer
state do on a few ranks. Each rank prints one JSON line: its rank and whether every
array came back with its own values.
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt.store.store import CheckpointStore


def main() -> None:
    directory, count = Path(sys.argv[1]), int(sys.argv[2])
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    state = {f"layer{i}": np.full(3, rank * count + i, dtype=np.float32) for i in range(count)}
    CheckpointStore(directory, comm).save(1, state)
    out = {k: np.zeros(3, dtype=np.float32) for k in state}
    result = CheckpointStore(directory, comm).restore(out)
    step = result.step if result is not None else None
    same = all(np.array_equal(out[k], state[k]) for k in state)
    print(json.dumps({"rank": rank, "step": step, "same": same}), flush=True)


if __name__ == "__main__":
    main()
