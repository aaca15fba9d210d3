"""Test app: save distributed arrays on N ranks, restore them on M ranks.

    reshard_app.py save DIR ROWS           global u[ROWS, 5] split unevenly, plus scalars
    reshard_app.py restore DIR ROWS HOW OUT  HOW: array | none | callable; OUT: global u (.npy)
    reshard_app.py perrank DIR             save a scalar that differs between ranks
    reshard_app.py tryrestore DIR ROWS     restore, print the error as JSON (expected to fail)
    reshard_app.py checkpointer DIR        Checkpointer(distributed=, keep_last=2) over 6 saves
    reshard_app.py failsave DIR type|names the last rank cannot save; all must raise

Rank 0 prints one JSON line per rank.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.restore.resharding import even_split
from hpcckpt.store.store import CheckpointStore

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
mode, directory = sys.argv[1], sys.argv[2]


def global_u(rows: int) -> np.ndarray:
    return (np.arange(rows * 5, dtype=np.float64).reshape(rows, 5) * 1.000001) ** 1.5


def uneven(rows: int) -> tuple[int, int]:
    """A lopsided split (rank 0 takes more) so that restore cannot rely on the saved one."""
    weights = np.arange(size, 0, -1, dtype=float)
    cuts = np.round(np.concatenate([[0], np.cumsum(weights)]) / weights.sum() * rows).astype(int)
    return int(cuts[rank]), int(cuts[rank + 1])


def report(**fields) -> None:
    """Rank 0 prints every rank's report, one JSON line each (no interleaved output)."""
    reports = comm.gather({"rank": rank, **fields}, root=0)
    if rank == 0:
        print("\n".join(json.dumps(r) for r in reports), flush=True)


if mode == "save":
    rows = int(sys.argv[3])
    lo, hi = uneven(rows)
    state = {
        "fields": {"u": global_u(rows)[lo:hi], "w": np.arange(lo, hi, dtype=np.int32)},
        "t": 1.25,
        "params": np.array([0.5, 2.0]),  # replicated: same on every rank
        "name": "run",
    }
    store = CheckpointStore(directory, comm, distributed=["fields/u", "fields/w"])
    store.save(7, state)
    report(lo=lo, hi=hi)
elif mode == "restore":
    rows, how, out = int(sys.argv[3]), sys.argv[4], sys.argv[5]
    lo, hi = even_split(rows, size, rank)
    distributed: dict = {"fields/u": None, "fields/w": None}
    if how == "array":
        state = {"fields": {"u": np.zeros((hi - lo, 5)), "w": np.zeros(hi - lo, np.int32)}}
    elif how == "none":
        state = {"fields": {"u": None, "w": None}}
    else:  # callable: the last rank takes everything
        state = {"fields": {}}

        def split(n: int, nranks: int, r: int) -> tuple[int, int]:
            return (0, 0) if r < nranks - 1 else (0, n)

        distributed = {"fields/u": split, "fields/w": split}
    state.update(t=None, params=None, name=None)  # the saved scalars: replaced
    buffer = state["fields"].get("u")
    store = CheckpointStore(directory, comm, distributed=distributed)
    result = store.restore(state)
    u = state["fields"]["u"]
    parts = comm.gather(u, root=0)
    ws = comm.gather(state["fields"]["w"], root=0)
    if rank == 0:
        np.save(out, np.concatenate(parts))
        np.save(out + ".w.npy", np.concatenate(ws))
    report(
        step=result.step,
        saved_ranks=result.saved_ranks,
        rows=int(u.shape[0]),
        in_place=buffer is not None and u is buffer,
        t=state["t"],
        params=state["params"].tolist(),
        name=state["name"],
    )
elif mode == "perrank":
    state = {"u": np.full((2, 3), float(rank)), "seed": 100 + rank, "cfg": {"n": 4}}
    CheckpointStore(directory, comm, distributed=["u"]).save(1, state)
    report(ok=True)
elif mode == "tryrestore":
    rows = int(sys.argv[3])
    lo, hi = even_split(rows, size, rank)
    state = {"u": np.full((hi - lo, 3), -1.0), "seed": None, "cfg": {}}
    try:
        CheckpointStore(directory, comm, distributed=["u"]).restore(state)
        report(error=None)
    except CheckpointError as exc:
        untouched = bool(np.all(state["u"] == -1.0)) and state["seed"] is None
        report(error=str(exc), untouched=untouched)
elif mode == "checkpointer":
    import hpcckpt

    lo, hi = even_split(12, size, rank)
    state = {"u": global_u(12)[lo:hi], "k": 0}
    ck = hpcckpt.Checkpointer(  # a small state: deltas however little they leave out
        directory, comm=comm, distributed=["u"], keep_last=2, keep_every=20, min_delta_saving=0
    )
    for step in (5, 10, 15, 20, 25, 30):
        state["k"] = step
        ck.save(step, state)
    ck.finish()
    report(ok=True)
elif mode == "failsave":
    # One rank cannot save: every rank must raise, none may hang, no file may remain.
    what = sys.argv[3]
    state = {"u": np.zeros(4)}
    if rank == size - 1:
        state = {"u": object()} if what == "type" else {"v": np.zeros(4)}
    try:
        CheckpointStore(directory, comm).save(3, state)
        report(error=None)
    except (TypeError, CheckpointError) as exc:
        report(error=f"{type(exc).__name__}: {exc}")
else:
    raise SystemExit(f"unknown mode {mode}")
