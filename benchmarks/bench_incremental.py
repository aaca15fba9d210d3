"""Incremental against full saves of the same state, with dirty blocks spread at random.

Run under MPI (2 ranks x 512 MiB of float64 by default)::

    mpirun -n 2 python benchmarks/bench_incremental.py --dir /tmp/bench-incr \\
        --mib 512 --repeat 3 --detection kernel,hashes

For each dirty fraction, every repetition changes that fraction of each rank's blocks
(chosen at random), then saves the state with each store, in rotating order: one
incremental store per change detection (``--detection``: ``kernel``, the pages the
kernel saw written; ``hashes``, every block hashed), each saving a delta of its own
previous checkpoint (the chain never restarts during the run), and a full store
(``incremental=False``). It also times one pass of the block hash over the state on
its own: an incremental save that finds its changes by their content cannot cost less
than that pass, so *hashing alone / full save* is the floor of the ratio with hashes.
Prints the medians (and ranges) as a Markdown table, plus the hash throughput of one
core per block size. Full files are deleted as they are written; the deltas stay until
the end (their chain must stay intact).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import time
from pathlib import Path

import _util  # the script's own directory is on sys.path
import numpy as np
from mpi4py import MPI

from hpcckpt.store.file import layout
from hpcckpt.store.io import blocks
from hpcckpt.store.store import CheckpointStore

#: The steps of a synchronous save, timed on each incremental store (``--phases``).
PHASES = ("_prepare", "hashes", "create", "_write_data", "agree_or_discard", "_commit")


class Phases:
    """Seconds a store spends in each step of its saves (this rank), by wrapping them."""

    def __init__(self, store: CheckpointStore) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        for name in PHASES:
            owner = store.saver.changes if name == "hashes" else store.saver
            setattr(owner, name, self._timed(name, getattr(owner, name)))

    def _timed(self, name, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t

        return run

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return out


#: What each incremental save reports on how it found its changes (SaveResult fields).
STATS = ("bytes_hashed", "pages_written", "scan_seconds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/hpcckpt-bench-incr"))
    ap.add_argument("--mib", type=int, default=512, help="state per rank (MiB of float64)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=blocks.DEFAULT_BLOCK_SIZE)
    ap.add_argument("--fractions", default="0,0.01,0.1,0.5,1")
    ap.add_argument(
        "--detection",
        default="hashes",
        help="how the incremental stores find changes, comma-separated: kernel, hashes",
    )
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
    detections = args.detection.split(",")
    unbounded = {"max_chain": 10**6, "max_chain_fraction": 1e9}  # the chain never restarts
    incs = {
        d: CheckpointStore(
            args.dir / f"inc-{d}", comm, block_size=bs, change_detection=d, **unbounded
        )
        for d in detections
    }
    full = CheckpointStore(args.dir / "full", comm, block_size=bs, incremental=False)
    phases = {d: Phases(store) for d, store in incs.items()}

    # Hash throughput on one core (every rank hashes its own state at once).
    t = time.perf_counter()
    blocks.block_hashes(u, bs)
    hash_s = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
    rates = {}
    for b in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
        rates[b] = blocks.throughput(b, mib=128, repeat=3) if rank == 0 else None

    for store in incs.values():
        store.save(0, {"u": u})  # the base of each store's chain
    rng = np.random.default_rng(100 + rank)
    rows = []
    step = 1
    names = [*detections, "full"]
    for frac in [float(x) for x in args.fractions.split(",")]:
        samples: dict[str, list[float]] = {k: [] for k in [*names, "hash", "write_floor"]}
        extra: dict[str, list[float]] = {f"{d}_{k}": [] for d in detections for k in STATS}
        steps: dict[str, list[dict[str, float]]] = {d: [] for d in detections}
        nbytes: dict[str, int] = {}
        kinds: dict[str, str] = {}
        for rep in range(args.repeat):
            chosen = rng.choice(nblk, int(round(frac * nblk)), replace=False)
            u[chosen * (bs // 8)] += 1.0  # one element per chosen block: the block is dirty
            # The floor of any incremental save that finds its changes by content: one
            # pass over the state (the same hash the save runs), every rank at once.
            comm.Barrier()
            t = time.perf_counter()
            blocks.block_hashes(u, bs)
            samples["hash"].append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
            # The floor of any save of these changes into a new HDF5 file: the changed
            # blocks' bytes, durably, by the least protocol (benchmarks/_util.floor_save).
            changed = np.ones(len(chosen) * bs, dtype=np.uint8)
            floor = functools.partial(_util.floor_save, comm, args.dir / "floor.h5", changed)
            samples["write_floor"].append(_util.timed(comm, floor))
            shift = rep % len(names)
            for which in names[shift:] + names[:shift]:
                store = full if which == "full" else incs[which]
                comm.Barrier()
                if which != "full":
                    phases[which].take()
                res = store.save(step, {"u": u})
                if which != "full":
                    took = phases[which].take()  # the slowest rank's time in each step
                    steps[which].append({k: comm.allreduce(v, op=MPI.MAX) for k, v in took.items()})
                samples[which].append(res.seconds)
                nbytes[which], kinds[which] = res.bytes_written, res.kind
                if which != "full":
                    for k in STATS:
                        extra[f"{which}_{k}"].append(float(getattr(res, k)))
                    if res.change_detection != which:
                        raise SystemExit(f"{which} store found changes by {res.change_detection}")
                if rank == 0 and which == "full":
                    (store.directory / layout.checkpoint_name(step)).unlink()
                step += 1
        tf = statistics.median(samples["full"])
        row = {
            "dirty": frac,
            "full_s": tf,
            "full_range": [min(samples["full"]), max(samples["full"])],
            "hash_s": statistics.median(samples["hash"]),
            "floor": statistics.median(samples["hash"]) / tf,
            "write_floor": statistics.median(samples["write_floor"]) / tf,
            "full_bytes": nbytes["full"],
            "samples": samples,
        }
        for d in detections:
            ti = statistics.median(samples[d])
            row[d] = {
                "kind": kinds[d],
                "inc_s": ti,
                "range": [min(samples[d]), max(samples[d])],
                "ratio": ti / tf,
                "ratio_range": [
                    min(samples[d]) / max(samples["full"]),
                    max(samples[d]) / min(samples["full"]),
                ],
                "inc_bytes": nbytes[d],
                **{k: statistics.median(extra[f"{d}_{k}"]) for k in STATS},
                "phases": {k: statistics.median(x[k] for x in steps[d]) for k in PHASES},
            }
        rows.append(row)
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
        state_mib = size * args.mib
        print(
            f"{size} ranks x {args.mib} MiB float64 ({state_mib} MiB), block {bs >> 10} KiB, "
            f"median of {args.repeat}; hashing the state: {hash_s:.3f} s "
            f"({args.mib / hash_s:.0f} MiB/s per rank)"
        )
        print(
            "\n| dirty blocks | detection | incremental save (range) | full save (range) | "
            "ratio (range) | bytes hashed / rank | pages written / rank | scan | "
            "hashing alone / full save | least file of the changes / full save | "
            "written (incr.) | kind |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            for d in detections:
                x = r[d]
                print(
                    f"| {100 * r['dirty']:g} % | {d} | {x['inc_s']:.3f} s "
                    f"({x['range'][0]:.3f}-{x['range'][1]:.3f}) | {r['full_s']:.3f} s "
                    f"({r['full_range'][0]:.3f}-{r['full_range'][1]:.3f}) | "
                    f"{100 * x['ratio']:.1f} % ({100 * x['ratio_range'][0]:.1f}-"
                    f"{100 * x['ratio_range'][1]:.1f}) | {x['bytes_hashed'] / 2**20:.1f} MiB | "
                    f"{x['pages_written']:.0f} | {1e3 * x['scan_seconds']:.2f} ms | "
                    f"{100 * r['floor']:.1f} % | {100 * r['write_floor']:.1f} % | "
                    f"{x['inc_bytes'] / 2**20:.1f} MiB | "
                    f"{x['kind']} |"
                )
        print(
            "\nWhere an incremental save's time goes (median seconds of the slowest rank "
            "per step): " + ", ".join(PHASES)
        )
        print("\n| dirty | detection | " + " | ".join(PHASES) + " |")
        print("|---|---|" + "---|" * len(PHASES))
        for r in rows:
            for d in detections:
                cells = " | ".join(f"{1e3 * r[d]['phases'][k]:.1f} ms" for k in PHASES)
                print(f"| {100 * r['dirty']:g} % | {d} | {cells} |")
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
