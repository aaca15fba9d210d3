"""Many arrays and many ranks: what each array and each rank costs a save and a restore.

    .venv/bin/python benchmarks/bench_arrays.py [--arrays 30,300,3000] [--ranks 2]
        [--reps 3] [--chain] [--rank0 64,1000,10000] [--rank0-arrays 3,30] [--dir DIR]
        [--json OUT]

Two parts:

- **Arrays per rank** (one ``mpirun -n RANKS --oversubscribe`` per count): every rank
  holds ``COUNT`` float32 arrays, as a model's parameters and optimizer state are (one
  in three of 1024 elements, the rest of 64). Each repetition times, between barriers
  and by the slowest rank, ``save`` (``CheckpointStore.save``, full, one store for
  every step, as in a run), ``restore`` (a new store's restore, checksums verified),
  ``npz_save`` (every rank ``np.savez`` of its arrays to its own file + ``fsync``) and
  ``npz_load`` (every rank ``np.load`` of all of them). The table gives medians, the
  ratios to ``npz`` and the milliseconds per array of the slowest rank.
- **Saves of 1 % changed** (``--chain``, in the same workers): a full save, then 3
  saves each changing one element of every 100th array, then a new store's restore,
  twice: with ``min_delta_saving=0`` (every save a delta: a 4-file chain) and with the
  default policy (which writes these saves full). ``delta_save``/``policy_save`` are
  the median of the 3 saves, ``delta_restore``/``policy_restore`` the restore.
- **Rank 0 at P ranks** (one process, no MPI): the O(P) share of a save and a restore
  that only rank 0 does, for P writing ranks that cannot run here. It hands rank 0's
  file creation what the gather of P ranks would give it (each rank ``--rank0-arrays``
  float64[4, 8] arrays and a 200-byte state tree), then opens and validates the file
  with the reader, plans every rank's read and pickles the plans as the restore's
  scatter does. Medians of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
METHODS = ["save", "restore", "npz_save", "npz_load"]
CHAIN = ["delta_save", "delta_restore", "policy_save", "policy_restore"]


def state_of(count: int, rank: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(rank)
    return {f"layer{i}": rng.random(64 if i % 3 else 1024).astype(np.float32) for i in range(count)}


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    import _util

    from hpcckpt.store.store import CheckpointStore

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    root = Path(args.dir)
    state = state_of(args.count, rank)
    ck = root / "ck"
    store = CheckpointStore(ck, comm, incremental=False)
    records: list[dict] = []

    def run(rep: int, record: bool) -> None:
        own = root / f"npz{rep}.{rank}.npz"
        out = {k: np.empty_like(v) for k, v in state.items()}

        def npz_save() -> None:
            with open(own, "wb") as fh:
                np.savez(fh, **state)
                fh.flush()
                os.fsync(fh.fileno())

        def npz_load() -> None:
            with np.load(own) as z:
                for k in out:
                    out[k][...] = z[k]

        steps = {
            "save": lambda: store.save(rep + 1, state),
            "restore": lambda: CheckpointStore(ck, comm).restore(out),
            "npz_save": npz_save,
            "npz_load": npz_load,
        }
        pairs = _util.rotate([("save", "restore"), ("npz_save", "npz_load")], rep)
        got = {m: _util.timed(comm, steps[m]) for pair in pairs for m in pair}
        if not all(np.array_equal(out[k], state[k]) for k in state):
            raise SystemExit(f"rank {rank}: a restore gave other values than were saved")
        if args.chain:
            for name, saving in _util.rotate([("delta", 0), ("policy", None)], rep):
                got.update(chain(name, saving, rep))
        if record and rank == 0:
            records.append({"rep": rep, **got})
        store.prune(keep_last=1)
        own.unlink(missing_ok=True)
        comm.Barrier()

    def chain(name: str, saving: int | None, rep: int) -> dict:
        """A full save, 3 saves of 1 % changed, a restore; seconds and kinds."""
        d = root / f"{name}{rep}"
        kw = {} if saving is None else {"min_delta_saving": saving}
        chained = CheckpointStore(d, comm, **kw)
        chained.save(1, state)
        saves, kinds = [], []
        for step in (2, 3, 4):
            for i in range(step % 100, len(state), 100):
                state[f"layer{i}"][0] += 1.0

            def save(step: int = step) -> None:
                kinds.append(chained.save(step, state).kind)

            saves.append(_util.timed(comm, save))
        out = {k: np.empty_like(v) for k, v in state.items()}
        restore = _util.timed(comm, lambda: CheckpointStore(d, comm).restore(out))
        if not all(np.array_equal(out[k], state[k]) for k in state):
            raise SystemExit(f"rank {rank}: the {name} chain restored other values")
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(d)
        return {
            f"{name}_save": statistics.median(saves),
            f"{name}_restore": restore,
            f"{name}_kinds": kinds,
        }

    run(-1, record=False)
    for rep in range(args.reps):
        run(rep, record=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(records))


def rank0(nranks: int, narrays: int, reps: int, scratch: Path) -> dict[str, float]:
    """Rank 0's seconds (medians) to create, validate and plan a file of ``nranks``."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from hpcckpt.store.file import writer as checkpoint_file
    from hpcckpt.store.file.plan import ArraySpec
    from hpcckpt.store.file.reader import CheckpointReader
    from hpcckpt.store.io import blocks
    from hpcckpt.store.restore import read_plan

    bs = blocks.DEFAULT_BLOCK_SIZE
    arrays = {f"a{i}": np.zeros((4, 8)) for i in range(narrays)}
    specs = [ArraySpec(p, a.dtype.str, a.shape) for p, a in arrays.items()]
    counts = {}
    for p, a in arrays.items():
        nb = blocks.nblocks(a.size, blocks.block_elems(a.itemsize, bs))
        counts[p] = (nb, nb, a.size)
    gathered = [(specs, 200, False, counts)] * nranks
    times: dict[str, list[float]] = {"create": [], "validate": [], "plans": [], "pickle": []}
    for rep in range(reps):
        path = scratch / f"rank0-{nranks}-{narrays}-{rep}.h5"
        t0 = time.perf_counter()
        checkpoint_file._create(
            path,
            gathered,
            1,
            nranks,
            {"reason": "interval"},
            {"a0"},
            None,
            bs,
            None,
            blocks.ChainPolicy(),
            None,
            (),
        )
        t1 = time.perf_counter()
        with CheckpointReader(path) as reader:
            t2 = time.perf_counter()
            plans = read_plan.plans(reader)
            t3 = time.perf_counter()
        assert plans is not None and len(plans) == nranks
        for plan in plans:  # the scatter pickles each rank's item on its own
            pickle.dumps(plan)
        t4 = time.perf_counter()
        for key, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[key].append(dt)
        path.unlink()
    return {key: statistics.median(ts) for key, ts in times.items()}


def summarize(results: dict, ranks: int) -> str:
    lines = [
        f"arrays per rank, {ranks} ranks:",
        "| arrays | save s | npz_save s | save / npz_save | save ms per array "
        "| restore s | npz_load s | restore / npz_load | restore ms per array |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for count, recs in results.items():
        med = {m: statistics.median(r[m] for r in recs) for m in METHODS}
        n = int(count)
        lines.append(
            f"| {n} | {med['save']:.4f} | {med['npz_save']:.4f} | "
            f"{statistics.median(r['save'] / r['npz_save'] for r in recs):.2f} | "
            f"{1e3 * med['save'] / n:.3f} | {med['restore']:.4f} | {med['npz_load']:.4f} | "
            f"{statistics.median(r['restore'] / r['npz_load'] for r in recs):.2f} | "
            f"{1e3 * med['restore'] / n:.3f} |"
        )
    return "\n".join(lines)


def summarize_chain(results: dict, ranks: int) -> str:
    lines = [
        f"saves of 1 % changed, {ranks} ranks (every save a delta / the default policy):",
        "| arrays | kinds | save s | restore s of the chain | default kinds | save s | restore s |",
        "|---:|---|---:|---:|---|---:|---:|",
    ]
    for count, recs in results.items():
        med = {m: statistics.median(r[m] for r in recs) for m in CHAIN}
        kinds = [",".join(k[0] for k in recs[0][f"{n}_kinds"]) for n in ("delta", "policy")]
        lines.append(
            f"| {count} | {kinds[0]} | {med['delta_save']:.4f} | {med['delta_restore']:.4f} "
            f"| {kinds[1]} | {med['policy_save']:.4f} | {med['policy_restore']:.4f} |"
        )
    return "\n".join(lines)


def summarize_rank0(rows: list[dict]) -> str:
    lines = [
        "rank 0 alone, for P writing ranks (one process):",
        "| P | arrays | create ms | validate ms | plans ms | pickle ms | total us per rank |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = r["seconds"]
        total = sum(t.values())
        lines.append(
            f"| {r['nranks']} | {r['narrays']} | {1e3 * t['create']:.1f} | "
            f"{1e3 * t['validate']:.1f} | {1e3 * t['plans']:.1f} | {1e3 * t['pickle']:.1f} | "
            f"{1e6 * total / r['nranks']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--arrays", default="30,300,3000", help="arrays per rank, comma-separated")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the arrays-per-rank part")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rank0", default="64,1000,10000", help="P of the rank-0 part ('' skips)")
    ap.add_argument("--rank0-arrays", default="3,30", help="arrays per rank in the rank-0 part")
    ap.add_argument("--chain", action="store_true", help="also time saves of 1 %% changed")
    ap.add_argument("--dir", default="/tmp/hpcckpt-bench-arrays")
    ap.add_argument("--json", help="write the raw records and the tables here")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(HERE))
    import _util

    results: dict[str, list[dict]] = {}
    for count in [int(x) for x in args.arrays.split(",") if x]:
        results[str(count)] = _util.run_worker(
            __file__,
            args.ranks,
            Path(args.dir) / f"a{count}",
            ["--count", str(count), "--reps", str(args.reps)] + ["--chain"] * args.chain,
            what=f"{count} arrays on {args.ranks} ranks",
        )
    rows = []
    scratch = Path(args.dir) / "rank0"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for nranks in [int(x) for x in args.rank0.split(",") if x]:
        for narrays in [int(x) for x in args.rank0_arrays.split(",") if x]:
            seconds = rank0(nranks, narrays, args.reps, scratch)
            rows.append({"nranks": nranks, "narrays": narrays, "seconds": seconds})
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"median of {args.reps}")
    if results:
        print(summarize(results, args.ranks))
        if args.chain:
            print(summarize_chain(results, args.ranks))
    if rows:
        print(summarize_rank0(rows))
    if args.json:
        doc = {"args": vars(args), "results": results, "rank0": rows}
        Path(args.json).write_text(json.dumps(doc))


if __name__ == "__main__":
    main()
