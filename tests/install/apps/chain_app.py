"""Test app: an incremental chain of one distributed array, saved and restored under mpirun.

    chain_app.py save DIR STEPS    steps 1..STEPS: a full checkpoint, then deltas
    chain_app.py restore DIR [--no-save]
                                   restore the newest good checkpoint on any rank count,
                                   check it bit for bit, then change one row and save
                                   step + 1 (its kind is reported; not with --no-save)

The global array is a deterministic function of the step (:func:`global_u`), split over
the ranks by rows and declared distributed, so a chain saved by N ranks restores on M.
4 KiB blocks and ``min_delta_saving=0``: a small state still gets deltas. Rank 0 prints
one JSON line per rank, with the HDF5 that h5py runs.
"""

import json
import sys

import h5py
import numpy as np
from mpi4py import MPI

from hpcckpt.store.restore.resharding import even_split
from hpcckpt.store.store import CheckpointStore

ROWS, COLS = 301, 64  # float64: 512-byte rows, 8 to a 4096-byte block


def global_u(step: int) -> np.ndarray:
    u = np.sin(np.arange(ROWS * COLS, dtype=np.float64)).reshape(ROWS, COLS)
    for s in range(1, step + 1):
        u[np.random.default_rng(s).choice(ROWS, 4, replace=False)] += s * 0.5
    return u


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    mode, directory = sys.argv[1], sys.argv[2]
    store = CheckpointStore(
        directory, comm, distributed=["u"], block_size=4096, max_chain=8, min_delta_saving=0
    )
    lo, hi = even_split(ROWS, size, rank)
    report = {"rank": rank, "hdf5": h5py.version.hdf5_version}
    if mode == "save":
        steps = int(sys.argv[3])
        report["kinds"] = [
            store.save(step, {"u": global_u(step)[lo:hi], "step": step}).kind
            for step in range(1, steps + 1)
        ]
    elif mode == "restore":
        state = {"u": np.zeros((hi - lo, COLS)), "step": None}
        result = store.restore(state)
        step = result.step
        ok = state["step"] == step and state["u"].tobytes() == global_u(step)[lo:hi].tobytes()
        report.update(
            step=step,
            saved_ranks=result.saved_ranks,
            skipped=[s for s, _ in result.skipped],
            ok=bool(ok),
        )
        if sys.argv[3:] != ["--no-save"]:
            state["u"][0] += 1.0  # one row changed: the next save on as many ranks is a delta
            report["next_kind"] = store.save(step + 1, state).kind
    reports = comm.gather(report, root=0)
    if rank == 0:
        print("\n".join(json.dumps(r) for r in reports), flush=True)


if __name__ == "__main__":
    main()
