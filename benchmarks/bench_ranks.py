"""Small states on many ranks: save and restore time against file-per-rank, per rank count.

    .venv/bin/python benchmarks/bench_ranks.py [--ranks 2,4,8,16,32,64] [--kib 256]
        [--reps 3] [--io ompio] [--dir /tmp/hpcckpt-bench-ranks] [--json OUT]

For each rank count one ``mpirun -n P --oversubscribe`` (per MPI-IO component) runs
the worker (``--worker``): every rank holds ``--kib`` KiB of float64, and each
repetition times, in an order rotated by the repetition, between barriers and by the
slowest rank:

- ``save``: ``CheckpointStore.save`` (durable: checksums, one shared HDF5 file, fsync,
  rename, directory fsync), full (``incremental=False``);
- ``restore``: ``CheckpointStore.restore`` of it (checksums verified), page cache warm;
- ``fpr_save``: every rank ``np.save`` of its array to its own file + ``fsync``;
- ``fpr_load``: every rank ``np.load`` of its file;
- ``floor_save``: the least any save into one shared HDF5 file can do, durably and
  atomically: rank 0 creates a file with one allocated dataset (no other metadata),
  one ``bcast`` of its offset, every rank ``pwrite`` + ``fsync`` of its bytes, one
  ``allreduce``, rank 0's rename and directory ``fsync`` (no checksums, no state tree);
- ``floor_load``: its read: rank 0 opens the file with HDF5 for the dataset's offset,
  one ``bcast``, every rank ``pread`` of its bytes (nothing verified).

``floor / fpr`` is what the design (one HDF5 file per checkpoint, committed by a
rename) costs against a file per rank before hpcckpt adds anything; ``save / floor``
is what hpcckpt adds on top (checksums, the state tree, its metadata, agreeing).

One untimed round comes first. The table gives, per rank count, the median seconds
and the median of the per-repetition ratios save / fpr_save and restore / fpr_load.
The ranks are oversubscribed on this machine's 2 cores: the absolute times grow with
P for every method (the cores are shared), so read the ratios, which compare methods
on the same rank count in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
METHODS = ["save", "restore", "fpr_save", "fpr_load", "floor_save", "floor_load"]


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
    a = np.random.default_rng(rank).random(args.kib * 1024 // 8)
    records: list[dict] = []

    ck = root / "ck"
    store = CheckpointStore(ck, comm, incremental=False)  # one store saves every step, as in a run

    def run(rep: int, record: bool) -> None:
        own = root / f"fpr{rep}.{rank}.npy"
        out = {"u": np.empty_like(a)}

        def fpr_save() -> None:
            with open(own, "wb") as fh:
                np.save(fh, a)
                fh.flush()
                os.fsync(fh.fileno())

        def fpr_load() -> None:
            out["u"][...] = np.load(own)

        floor = root / f"floor{rep}.h5"
        steps = {
            "save": lambda: store.save(rep + 1, {"u": a}),
            "restore": lambda: CheckpointStore(ck, comm).restore(out),
            "fpr_save": fpr_save,
            "fpr_load": fpr_load,
            "floor_save": lambda: _util.floor_save(comm, floor, a),
            "floor_load": lambda: _util.floor_load(comm, floor, out["u"]),
        }
        # each load needs its save: rotate the three pairs
        pairs = [("save", "restore"), ("fpr_save", "fpr_load"), ("floor_save", "floor_load")]
        pairs = pairs[rep % 3 :] + pairs[: rep % 3]
        got = {m: _util.timed(comm, steps[m]) for pair in pairs for m in pair}
        if record and rank == 0:
            records.append({"rep": rep, **got})
        store.prune(keep_last=1)
        if rank == 0:
            floor.unlink(missing_ok=True)
        own.unlink(missing_ok=True)
        comm.Barrier()

    # The floor must hold the bytes it claims to write: one round trip, checked.
    check = np.empty_like(a)
    _util.floor_save(comm, root / "floor-check.h5", a)
    _util.floor_load(comm, root / "floor-check.h5", check)
    if not np.array_equal(check, a):
        raise SystemExit(f"rank {rank}: the floor's file does not hold what it wrote")
    run(-1, record=False)
    for rep in range(args.reps):
        run(rep, record=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(records))


def summarize(results: dict) -> str:
    def ratio(recs: list[dict], a: str, b: str) -> str:
        rs = [r[a] / r[b] for r in recs]
        return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"

    lines = [
        "| ranks | io | save s | fpr_save s | floor_save s | save / fpr_save "
        "| floor_save / fpr_save | save / floor_save | restore s | fpr_load s "
        "| floor_load s | restore / fpr_load | floor_load / fpr_load |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, recs in results.items():
        p, io = key.split("/")
        med = {m: statistics.median(r[m] for r in recs) for m in METHODS}
        lines.append(
            f"| {p} | {io} | {med['save']:.4f} | {med['fpr_save']:.4f} | "
            f"{med['floor_save']:.4f} | {ratio(recs, 'save', 'fpr_save')} | "
            f"{ratio(recs, 'floor_save', 'fpr_save')} | {ratio(recs, 'save', 'floor_save')} | "
            f"{med['restore']:.4f} | {med['fpr_load']:.4f} | {med['floor_load']:.4f} | "
            f"{ratio(recs, 'restore', 'fpr_load')} | {ratio(recs, 'floor_load', 'fpr_load')} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", default="2,4,8,16,32,64")
    ap.add_argument("--kib", type=int, default=256, help="state per rank, KiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--io", default="ompio", help="MPI-IO components, e.g. ompio,romio321")
    ap.add_argument("--dir", default="/tmp/hpcckpt-bench-ranks")
    ap.add_argument("--json", help="write the raw records and the table here")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(HERE))
    import _util

    results: dict[str, list[dict]] = {}
    for p in [int(x) for x in args.ranks.split(",")]:
        for io in args.io.split(","):
            t0 = time.perf_counter()
            results[f"{p}/{io}"] = _util.run_worker(
                __file__,
                p,
                Path(args.dir) / f"p{p}-{io}",
                ["--kib", str(args.kib), "--reps", str(args.reps)],
                env={"OMPI_MCA_io": io},
                what=f"{p} ranks ({io})",
            )
            print(f"{p} ranks, {io}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    table = summarize(results)
    print(f"{args.kib} KiB per rank, median of {args.reps} (min-max of the ratios)")
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
