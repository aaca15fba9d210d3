"""Test app: the MPI calls of two saves and a restore of a small state, counted per rank.

    counts_app.py DIR [p2p]

Every rank holds 32 KiB of float64 (different per rank) and a per-rank integer, saves
steps 1 and 2 (full), then a new store restores; rank 0 prints one JSON line per rank: its
rank and, per phase, its counts (``tests/mpi_counting.py``). With ``p2p`` each rank
also sends its step to rank 0 after every save, the way a per-rank report would (the
test must see it).
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt.store.store import CheckpointStore
from tests.mpi_counting import CountingComm, mark, summarize


def main() -> None:
    directory, extra = Path(sys.argv[1]), sys.argv[2:]
    comm = CountingComm(MPI.COMM_WORLD)
    rank, size = comm.Get_rank(), comm.Get_size()
    u = np.random.default_rng(rank).random(4096)
    store = CheckpointStore(directory, comm, incremental=False)
    out: dict = {"rank": rank}
    MPI.COMM_WORLD.Barrier()

    def phase(name, fn):
        comm.reset()
        mark(rank, f"{name}-begin")
        fn()
        mark(rank, f"{name}-end")
        out[name] = summarize(comm.reset())
        MPI.COMM_WORLD.Barrier()

    def save(step):
        store.save(step, {"u": u, "n": rank})
        if "p2p" in extra:
            if rank == 0:
                for r in range(1, size):
                    comm.recv(source=r)
            else:
                comm.send(step, dest=0)

    phase("save1", lambda: save(1))
    phase("save2", lambda: save(2))
    back = {"u": np.empty_like(u), "n": -1}
    phase("restore", lambda: CheckpointStore(directory, comm).restore(back))
    assert np.array_equal(back["u"], u) and back["n"] == rank
    everyone = MPI.COMM_WORLD.gather(out, root=0)  # uncounted: one line per rank
    if rank == 0:
        print("\n".join(json.dumps(o) for o in everyone), flush=True)


main()
