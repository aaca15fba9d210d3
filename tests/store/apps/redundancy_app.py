"""A rank's state on the node-local tier with partner/XOR redundancy, under real mpirun.

Usage: ``redundancy_app.py SPEC.json`` where SPEC holds:

- ``mode``: ``save`` (save ``steps``, commit the pending drain, exit *without* finish(),
  as a job killed after its last save), ``restore`` (restore, check the state against
  the one saved at the restored step, commit the drain of it, exit without finish),
  ``finish`` or ``close`` (save ``steps``, then finish() or close(): the scavenge);
- ``dir``, ``cache`` (may hold ``%n``), ``nodes`` (rank -> fake node name), ``redundancy``,
  ``set``, ``drain_every``, ``steps``, ``big`` (rows of the large array),
  ``empty_ranks`` (ranks whose arrays are all empty), ``out``.

The state of rank r at step s is a pure function of (r, s) with arrays of odd byte
sizes, an empty array, a non-contiguous one and per-rank sizes that differ, so a
restored state can be checked bit for bit. Rank 0 writes ``out`` (JSON) with every
rank's result.
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np
from mpi4py import MPI

import hpcckpt


def state_of(rank: int, step: int, big: int, empty: bool = False) -> dict:
    """``empty``: every array of this rank has no element (a rank with no share of the data)."""
    rng = np.random.default_rng(1000 * rank + step)
    k = 0 if empty else 1
    wide = rng.random(((big + 7 * rank) * k, 3))
    return {
        "u": rng.random((1001 + 337 * rank) * k),  # odd element counts, differ per rank
        "bytes": rng.integers(0, 255, (4093 + rank) * k, dtype=np.uint8),  # odd byte size
        "empty": np.zeros((0, 4)),
        "strided": wide[:, 1],  # not contiguous
        "ints": np.arange(17 * (rank + 1) * k, dtype=np.int32) * step,
        "t": float(step) / 7.0,
        "step": step,
    }


def blank(rank: int, big: int, empty: bool = False) -> dict:
    s = state_of(rank, 0, big, empty)
    return {k: (np.zeros_like(v) if isinstance(v, np.ndarray) else None) for k, v in s.items()}


def same(a: dict, b: dict) -> bool:
    for k, v in b.items():
        w = a[k]
        if isinstance(v, np.ndarray):
            if not (
                isinstance(w, np.ndarray) and w.shape == v.shape and w.tobytes() == v.tobytes()
            ):
                return False
        elif w != v:
            return False
    return True


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    big = int(spec.get("big", 100))
    empty = rank in spec.get("empty_ranks", [])
    result: dict = {"rank": rank, "error": None}
    try:
        ck = hpcckpt.Checkpointer(
            spec["dir"],
            comm,
            every_steps=1,
            cache=spec["cache"],
            redundancy=spec.get("redundancy"),
            redundancy_set=int(spec.get("set", 8)),
            drain_every=int(spec.get("drain_every", 1)),
            node_name=spec["nodes"][rank],
            keep_last=None,
        )
        result["cache"] = str(ck.cache)
        if spec["mode"] in ("save", "finish", "close"):
            for step in spec["steps"]:
                ck.save(step, state_of(rank, step, big, empty))
            if spec["mode"] == "finish":
                ck.finish()
            elif spec["mode"] == "close":
                ck.close()
            else:
                ck.wait()
        else:
            state = blank(rank, big, empty)
            step = ck.restore(state)
            result["step"] = step
            result["same"] = step is not None and same(state, state_of(rank, step, big, empty))
            ck.wait()
    except Exception:
        result["error"] = traceback.format_exc()
    results = comm.gather(result)
    if rank == 0:
        with open(spec["out"], "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    main()
