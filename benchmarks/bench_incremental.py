"""Incremental against full saves of the same state, with dirty blocks spread at random.

Run under MPI (2 ranks x 512 MiB of float64 by default)::

    mpirun -n 2 python benchmarks/bench_incremental.py --dir /tmp/bench-incr \\
        --mib 512 --repeat 3

For each dirty fraction, every repetition changes that fraction of each rank's blocks
(chosen at random), then saves the state twice, in alternating order: once with an
incremental store whose previous checkpoint is the unchanged base, once with a full
store (``incremental=False``), and times one pass of the block hash over the state
on its own: an incremental save that finds its changes by their content cannot cost
less than that pass, so *hashing alone / full save* is the floor of the ratio. Prints
the medians as a Markdown table, plus the hash throughput of one core per block size.
Files are deleted as it goes (at most about two full checkpoints on disk).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt.store import blocks, layout
from hpcckpt.store.store import CheckpointStore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/hpcckpt-bench-incr"))
    ap.add_argument("--mib", type=int, default=512, help="state per rank (MiB of float64)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=blocks.DEFAULT_BLOCK_SIZE)
    ap.add_argument("--fractions", default="0,0.01,0.1,0.5,1")
    ap.add_argument("--json", type=Path, help="also write the results here (rank 0)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    bs = args.block_size
    u = np.random.default_rng(rank).random(args.mib * 2**20 // 8)
    nblk = blocks.nblocks(u.size, bs // 8)
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    comm.Barrier()
    inc = CheckpointStore(args.dir / "inc", comm, block_size=bs)
    full = CheckpointStore(args.dir / "full", comm, block_size=bs, incremental=False)

    # Hash throughput on one core (every rank hashes its own state at once).
    t = time.perf_counter()
    blocks.block_hashes(u, bs)
    hash_s = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
    rates = {}
    for b in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
        rates[b] = blocks.throughput(b, mib=128, repeat=3) if rank == 0 else None

    inc.save(0, {"u": u})  # the base every measured delta is compared with
    base = inc.last
    rng = np.random.default_rng(100 + rank)
    rows = []
    step = 1
    for frac in [float(x) for x in args.fractions.split(",")]:
        samples: dict[str, list[float]] = {"inc": [], "full": [], "hash": []}
        nbytes: dict[str, int] = {}
        kind = None
        for rep in range(args.repeat):
            chosen = rng.choice(nblk, int(round(frac * nblk)), replace=False)
            saved = [(j, u[j * (bs // 8) : (j + 1) * (bs // 8)].copy()) for j in chosen]
            for j, _ in saved:
                u[j * (bs // 8)] += 1.0  # one element per chosen block: the block is dirty
            # The floor of any incremental save that finds its changes by content: one
            # pass over the state (the same hash the save runs), every rank at once.
            comm.Barrier()
            t = time.perf_counter()
            blocks.block_hashes(u, bs)
            samples["hash"].append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
            order = ("inc", "full") if rep % 2 == 0 else ("full", "inc")
            for which in order:
                store = inc if which == "inc" else full
                if which == "inc":
                    inc.last = base
                comm.Barrier()
                res = store.save(step, {"u": u})
                samples[which].append(res.seconds)
                nbytes[which] = res.bytes_written
                if which == "inc":
                    kind = res.kind
                if rank == 0:
                    (store.directory / layout.checkpoint_name(step)).unlink()
                step += 1
            for j, block in saved:
                u[j * (bs // 8) : (j + 1) * (bs // 8)] = block
        ti, tf = statistics.median(samples["inc"]), statistics.median(samples["full"])
        rows.append(
            {
                "dirty": frac,
                "kind": kind,
                "inc_s": ti,
                "full_s": tf,
                "ratio": ti / tf,
                "hash_s": statistics.median(samples["hash"]),
                "floor": statistics.median(samples["hash"]) / tf,
                "inc_bytes": nbytes["inc"],
                "full_bytes": nbytes["full"],
            }
        )
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        state_mib = size * args.mib
        print(
            f"{size} ranks x {args.mib} MiB float64 ({state_mib} MiB), block {bs >> 10} KiB, "
            f"median of {args.repeat}; hashing the state: {hash_s:.3f} s "
            f"({args.mib / hash_s:.0f} MiB/s per rank)"
        )
        print(
            "\n| dirty blocks | incremental save | full save | ratio | hashing alone / full "
            "save (the floor) | written (incr.) | written (full) | kind written |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {100 * r['dirty']:g} % | {r['inc_s']:.3f} s | {r['full_s']:.3f} s | "
                f"{100 * r['ratio']:.1f} % | {100 * r['floor']:.1f} % | "
                f"{r['inc_bytes'] / 2**20:.1f} MiB | "
                f"{r['full_bytes'] / 2**20:.1f} MiB | {r['kind']} |"
            )
        print("\n| block size | xxh3-64 one core |")
        print("|---|---|")
        for b, rate in rates.items():
            print(f"| {b >> 10} KiB | {rate / 2**20:.0f} MiB/s |")
        if args.json:
            args.json.write_text(
                json.dumps({"rows": rows, "hash_s": hash_s, "rates": rates}, indent=2)
            )


if __name__ == "__main__":
    main()
