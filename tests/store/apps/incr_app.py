"""Test app: incremental checkpoints under mpirun.

    incr_app.py save DIR STEPS [u]     save steps 1..STEPS (a full one, then deltas);
                                       with "u", only the distributed array (reshardable)
    incr_app.py crash DIR STEPS        the same, but rank 1 dies (os._exit) in the middle
                                       of writing the data of step STEPS
    incr_app.py restore DIR [u]        restore the newest good checkpoint, report it, then
                                       change one row and save step + 1 (report its kind);
                                       with "u", of a state saved with "u"

The state is a deterministic function of the step (:func:`global_u`, :func:`per_rank`),
so the test computes what every checkpoint must hold. "u" is distributed (restorable on
any rank count); "p" is per rank. Rank 0 prints one JSON line per rank.
"""

import json
import os
import sys

import numpy as np

ROWS, COLS = 301, 64  # float64: 512-byte rows; 4096-byte blocks hold 8 rows
BLOCK = 4096


def global_u(step: int) -> np.ndarray:
    u = np.sin(np.arange(ROWS * COLS, dtype=np.float64)).reshape(ROWS, COLS)
    for s in range(1, step + 1):
        rows = np.random.default_rng(s).choice(ROWS, 4, replace=False)
        u[rows] += s * 0.5
    return u


def per_rank(rank: int, step: int) -> np.ndarray:
    p = np.arange(5000, dtype=np.int64) * (rank + 1)
    for s in range(1, step + 1):
        p[(s * 997 + rank * 13) % 5000] = s
    return p


def main() -> None:
    from mpi4py import MPI

    import hpcckpt.store.io.faults as faults
    from hpcckpt.store.restore.resharding import even_split
    from hpcckpt.store.store import CheckpointStore

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    mode, directory = sys.argv[1], sys.argv[2]
    store = CheckpointStore(
        directory,
        comm,
        distributed=["u"],
        block_size=BLOCK,
        max_chain=8,
        max_chain_fraction=0.9,
        min_delta_saving=0,  # a small state: deltas however little they leave out
    )
    lo, hi = even_split(ROWS, size, rank)

    def report(**fields) -> None:
        reports = comm.gather({"rank": rank, **fields}, root=0)
        if rank == 0:
            print("\n".join(json.dumps(r) for r in reports), flush=True)

    if mode in ("save", "crash"):
        steps = int(sys.argv[3])
        kinds = []
        for step in range(1, steps + 1):
            if mode == "crash" and step == steps:

                def die(phase: str, *args: object) -> None:
                    if phase == "write.data" and rank == 1:
                        os._exit(3)  # a node dies with the delta half written

                faults.fault_point = die
            state = {"u": global_u(step)[lo:hi], "step": step}
            if sys.argv[4:] != ["u"]:
                state["p"] = per_rank(rank, step)
            kinds.append(store.save(step, state).kind)
        report(kinds=kinds)
    elif mode == "restore":
        state = {"u": np.zeros((hi - lo, COLS)), "p": None, "step": None}
        if sys.argv[3:] == ["u"]:
            del state["p"]  # the keys it was saved with
        result = store.restore(state)
        step = result.step
        ok_u = state["u"].tobytes() == global_u(step)[lo:hi].tobytes()
        p = state.get("p")
        ok_p = p is None or p.tobytes() == per_rank(rank, step).tobytes()
        state["u"][0] += 1.0  # one row changed: the next save is a small delta
        saved = store.save(step + 1, state)
        report(
            step=step,
            saved_ranks=result.saved_ranks,
            skipped=[s for s, _ in result.skipped],
            ok=bool(ok_u and ok_p and state["step"] == step),
            next_kind=saved.kind,
            next_dirty=saved.dirty_blocks,
        )


if __name__ == "__main__":
    main()
