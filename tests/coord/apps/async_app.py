"""Test app: a run whose saves are synchronous, asynchronous or staged through a cache.

    async_app.py MODE DIR --out RESULT.json [--cache PATH] [--steps N] [--every K]
                 [--rows R] [--block B] [--wait-at S,S,...] [--on-save-error raise|warn]
                 [--reshardable] [--settle] [--keep-last N] [--sleep SECONDS]

MODE is ``sync`` (plain saves), ``async`` (``async_save=True``) or ``cache``
(``cache=PATH``). The state evolves deterministically, step by step, whatever the
mode and wherever the run resumed:

- ``u``: float64 (R, 512), declared distributed (each rank holds its rows); a few
  global rows change per step (chosen by the shared generator), so most saves are
  incremental;
- ``t`` (float), ``step`` (int), ``rng`` (a numpy Generator, the same on every rank);
- unless ``--reshardable``: ``p`` (int64, per rank), ``rng_rank`` (a Generator seeded
  per rank) and ``name`` (a str per rank): state that ties the run to its rank count.

At the end rank 0 writes RESULT.json: per rank the sha256 of its whole state
(``ranks``), the sha256 of the global ``u`` and the shared scalars (``global``: the
same on any rank count with ``--reshardable``), the restored step, and what every save
looked like right after it returned (``saves``: kind, whether it was staged, whether
``ckpt-<step>.h5`` or its ``.partial`` existed), and the files of the cache right after
the restore (``cache_after_restore``). ``--settle`` makes every rank wait for
its own background write before the next ``due()``, so the commit is decided by the
``due()`` after that (recorded in ``committed_in_due``). A CheckpointError ends the run
(exit 3) after rank 0 wrote RESULT.json with every rank's ``errors`` entry.
"""

import argparse
import faulthandler
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

COLS = 512


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["async", "cache", "sync"])
    ap.add_argument("directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--rows", type=int, default=1024)  # 4 MiB of u over all ranks
    ap.add_argument("--block", type=int, default=16384)  # 4 rows of u
    ap.add_argument("--wait-at", default="")
    ap.add_argument("--on-save-error", default="raise")
    ap.add_argument("--reshardable", action="store_true")
    ap.add_argument("--settle", action="store_true")
    ap.add_argument("--keep-last", type=int, default=0)  # 0: keep every checkpoint
    ap.add_argument("--sleep", type=float, default=0.0)
    return ap.parse_args()


def even_split(rows: int, nranks: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(rows, nranks)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def initial_state(rows: int, lo: int, hi: int, rank: int, reshardable: bool) -> dict:
    g = np.arange(lo, hi, dtype=np.float64)[:, None]
    c = np.arange(COLS, dtype=np.float64)[None, :]
    state = {
        "u": np.sin(g * 0.01 + c * 0.001),
        "t": 0.0,
        "step": -1,
        "rng": np.random.default_rng(2024),
    }
    if not reshardable:
        state["p"] = np.arange(8192, dtype=np.int64) * (rank + 1)
        state["rng_rank"] = np.random.default_rng(1000 + rank)
        state["name"] = f"rank {rank}"
    return state


def advance(state: dict, step: int, rows: int, lo: int, hi: int, rank: int) -> None:
    """One step: three global rows of u change (the same rows on any rank count)."""
    rng = state["rng"]
    touched = rng.choice(rows, size=3, replace=False)
    noise = rng.standard_normal(COLS)
    u = state["u"]
    for r in touched:
        if lo <= r < hi:
            u[r - lo] = u[r - lo] * 0.5 + noise * (step + 1)
    state["t"] += 0.25
    state["step"] = step
    if "p" in state:
        k = int(state["rng_rank"].integers(0, state["p"].size))
        state["p"][k] += step + rank
        state["name"] = f"rank {rank} at step {step}"


def shared_part(state: dict) -> bytes:
    doc = {"t": state["t"], "step": state["step"], "rng": state["rng"].bit_generator.state}
    return json.dumps(doc, sort_keys=True, default=str).encode()


def rank_digest(state: dict) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(state["u"]).tobytes())
    h.update(shared_part(state))
    if "p" in state:
        h.update(state["p"].tobytes())
        h.update(json.dumps(state["rng_rank"].bit_generator.state, sort_keys=True).encode())
        h.update(state["name"].encode())
    return h.hexdigest()


def main() -> None:
    faulthandler.dump_traceback_later(150, exit=True)  # never outlive a test's timeout
    import hpcckpt
    from hpcckpt.store.errors import CheckpointError
    from hpcckpt.store.file import layout

    args = parse()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    lo, hi = even_split(args.rows, size, rank)
    directory = Path(args.directory)
    kwargs = {}
    if args.mode == "async":
        kwargs["async_save"] = True
    elif args.mode == "cache":
        kwargs["cache"] = args.cache
    wait_at = {int(s) for s in args.wait_at.split(",") if s}

    state = initial_state(args.rows, lo, hi, rank, args.reshardable)
    ck = hpcckpt.Checkpointer(
        directory,
        comm=comm,
        every_steps=args.every,
        distributed=["u"],
        block_size=args.block,
        min_delta_saving=0,  # a small state: deltas however little they leave out
        keep_last=args.keep_last or None,
        on_save_error=args.on_save_error,
        **kwargs,
    )
    result: dict = {"nranks": size, "mode": args.mode, "saves": [], "waited": []}
    result["committed_in_due"] = []
    step = None
    where = "restore"
    try:
        restored = ck.restore(state)
        result["restored"] = restored
        if args.cache and rank == 0:  # what restore left in the cache (one host: all ranks')
            cache = Path(args.cache)
            result["cache_after_restore"] = sorted(os.listdir(cache)) if cache.is_dir() else None
        start = 0 if restored is None else restored + 1
        for step in range(start, args.steps):
            advance(state, step, args.rows, lo, hi, rank)
            if args.sleep:
                time.sleep(args.sleep)
            pending = ck._pending  # white box: --settle lets this rank's write finish first
            if args.settle and pending is not None:
                pending.writer.wait()
            before = ck.last_save
            where = "due"
            due = ck.due(step)
            if ck.last_save is not before:  # a staged save committed by this due()
                result["committed_in_due"].append(ck.last_save.step)
            if due:
                where = "save"
                saved = ck.save(step, state)
                final = directory / layout.checkpoint_name(step)
                result["saves"].append(
                    {
                        "step": step,
                        "ok": saved is not None,
                        "kind": None if saved is None else saved.kind,
                        "staged": saved is not None and saved.blocked_seconds is not None,
                        "visible": final.exists(),
                        "partial": final.with_name(final.name + layout.PARTIAL).exists(),
                    }
                )
            if step in wait_at:
                where = "wait"
                done = ck.wait()
                result["waited"].append(
                    {
                        "step": step,
                        "committed": None if done is None else done.step,
                        "visible": None if done is None else done.path.exists(),
                    }
                )
        where = "finish"
        ck.finish()
        error = None
    except CheckpointError as exc:
        error = {"rank": rank, "step": step, "where": where, "error": str(exc)[:1000]}
    errors = comm.allgather(error)
    digests = comm.gather(rank_digest(state), root=0)
    u_all = comm.gather(state["u"], root=0)
    if rank == 0:
        h = hashlib.sha256(np.concatenate(u_all).tobytes())
        h.update(shared_part(state))
        result.update(ranks=digests, errors=errors, last_step=state["step"])
        result["global"] = h.hexdigest()
        out = Path(args.out)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out)
    comm.Barrier()
    if any(errors):
        sys.exit(3)


if __name__ == "__main__":
    main()
