"""Test app: incremental saves under mpirun whose arrays are also written by MPI.

    tracked_app.py DIR DETECTION STEPS

Each rank holds ``u`` (2 MiB of float64) and ``v`` (a view of the second half of
``u``'s buffer, so the two share pages). Every step changes a few elements, and each
rank receives 256 KiB from the other straight into a slice of ``u`` (large enough for
Open MPI's single-copy path where it has one: then the sender's side writes into this
process's memory), then saves with ``change_detection=DETECTION``. The state is a
deterministic function of the step, whatever the detection. Rank 0 prints one JSON
line per rank: the kind and detection of every save.
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt.store.store import CheckpointStore

BLOCK = 64 << 10
N = 2 << 17  # float64 elements


def main() -> None:
    directory, detection, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    store = CheckpointStore(
        directory, comm, block_size=BLOCK, change_detection=detection, min_delta_saving=0
    )
    u = np.random.default_rng(rank).random(N)
    state = {"u": u, "v": u[N // 2 :], "step": 0}
    report = []
    for step in range(1, steps + 1):
        rng = np.random.default_rng(1000 * step + rank)
        u[rng.integers(0, N, 5)] += step
        state["v"][rng.integers(0, N // 2)] = -step
        send = np.full(32768, float(step * 10 + rank))
        at = int(rng.integers(0, N - 32768))
        peer = (rank + 1) % size
        comm.Sendrecv(send, dest=peer, recvbuf=u[at : at + 32768], source=(rank - 1) % size)
        state["step"] = step
        res = store.save(step, state)
        report.append([res.kind, res.change_detection, res.dirty_blocks])
    everything = comm.gather({"rank": rank, "saves": report}, root=0)
    if rank == 0:
        for line in everything:
            print(json.dumps(line))


if __name__ == "__main__":
    main()
