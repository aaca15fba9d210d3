"""Test app: a restore on the rank count that saved, read as rank 0 planned it.

    plan_app.py save DIR              3 checkpoints (full, 2 incremental) of a distributed
                                      u (uneven split), a replicated w, a per-rank p, scalars
    plan_app.py restore DIR HOW       restore; HOW says how the application asks for u:
        held      an array of the rows it saved     none   None (the saved split)
        split     a split that gives the saved rows  even   an even split (reshard)
        mixed     rank 0 holds an array, the others None (refused, nothing overwritten)

Rank 0 prints one JSON line per rank: the step restored (or the error), whether the
values are bitwise what was saved, and how many times the rank opened a checkpoint
with the full reader (HDF5).
"""

import json
import sys

import numpy as np
from mpi4py import MPI

import hpcckpt.store.restore.load as load_module
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.restore.resharding import even_split
from hpcckpt.store.store import CheckpointStore

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
mode, directory = sys.argv[1], sys.argv[2]
ROWS = 20_000


def saved_rows(r: int) -> tuple[int, int]:
    """Rank 0 takes the most rows: a split no restore would guess."""
    weights = np.arange(size, 0, -1, dtype=float)
    cuts = np.round(np.concatenate([[0], np.cumsum(weights)]) / weights.sum() * ROWS).astype(int)
    return int(cuts[r]), int(cuts[r + 1])


def values(step: int) -> dict:
    lo, hi = saved_rows(rank)
    u = np.arange(ROWS * 3, dtype=np.float64).reshape(ROWS, 3)[lo:hi] * 1.5
    u[(step * 37) % (hi - lo)] = -step  # a changed block per step: incremental saves
    w = np.linspace(0.0, 1.0, 5000)  # replicated: rank 0's copy is stored
    w[step] = step
    p = np.full(7000, 10.0 * rank)
    p[-1] = step
    return {"u": np.ascontiguousarray(u), "w": w, "p": p, "k": step}


def report(**fields) -> None:
    reports = comm.gather({"rank": rank, **fields}, root=0)
    if rank == 0:
        print("\n".join(json.dumps(r) for r in reports), flush=True)


opened = 0
Reader = load_module.CheckpointReader


def counting_reader(*args, **kwargs):
    global opened
    opened += 1
    return Reader(*args, **kwargs)


load_module.CheckpointReader = counting_reader

if mode == "save":
    store = CheckpointStore(
        directory, comm, distributed=["u"], replicated=["w"], block_size=4096, min_delta_saving=0
    )
    kinds = [store.save(step, values(step)).kind for step in (1, 2, 3)]
    report(kinds=kinds)
elif mode == "restore":
    how = sys.argv[3]
    lo, hi = saved_rows(rank)
    distributed: dict = {"u": None}
    sentinel = np.full((hi - lo, 3), -7.0)
    u = None
    if how == "held" or (how == "mixed" and rank == 0):
        u = sentinel
    elif how == "split":
        distributed = {"u": lambda n, p, r: saved_rows(r)}
    elif how == "even":
        distributed = {"u": even_split}
    state = {"u": u, "w": None, "p": None, "k": None}
    store = CheckpointStore(directory, comm, distributed=distributed, replicated=["w"])
    try:
        result = store.restore(state)
    except CheckpointError as exc:
        report(error=str(exc), untouched=bool(np.all(sentinel == -7.0)), opened=opened)
        sys.exit(0)
    step = result.step
    want = values(step)
    if how == "even":
        glo, ghi = even_split(ROWS, size, rank)
        parts = comm.allgather(values(step)["u"])
        want["u"] = np.concatenate(parts)[glo:ghi]
    exact = all(
        np.array_equal(state[k], want[k]) and np.asarray(state[k]).dtype == want[k].dtype
        for k in ("u", "w", "p")
    )
    report(
        step=step,
        exact=exact and state["k"] == step,
        in_place=state["u"] is sentinel,
        opened=opened,
        chain=[c[1] for c in store.saver.last.chain] if store.saver.last else None,
    )
