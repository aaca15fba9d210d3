"""What one save and one restore of a small state cost per rank, counted, per rank count.

    .venv/bin/python benchmarks/bench_collectives.py [--ranks 2,4,8,16] [--kib 256]
        [--no-strace] [--json OUT]

For each rank count one ``mpirun -n P --oversubscribe`` (under ``strace -f`` unless
``--no-strace``) runs the worker (``--worker``): every rank holds ``--kib`` KiB of
float64 and, through a counting communicator (the real MPI communicator, counting
each call: ``tests/mpi_counting.py``), does a first save, a second save (the steady
state: the file system is detected at the first save only) and a restore by a new
store. Printed per phase and rank count: the MPI collectives (total and by kind),
barriers and point-to-point calls of a rank (the same on every rank, checked), and
from the strace log the file opens (of them HDF5 files), fsyncs, renames and write
calls of rank 0 and the largest of the other ranks. "allreduce µs": one 8-byte
allreduce on these ranks (median of 5 x 20, slowest rank), the unit a collective costs
here (under strace: slower; ``--no-strace`` for the latency alone). "CPU ms": the CPU
time (user + system, all threads) a rank spent in the phase, over the ranks: flat in
P when a rank's own work does not grow with the rank count, whatever the wall time of
P ranks sharing the cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

PHASES = ["save1", "save2", "restore"]


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    from hpcckpt.store.store import CheckpointStore
    from tests.mpi_counting import CountingComm, mark, summarize

    comm = CountingComm(MPI.COMM_WORLD)
    rank = comm.Get_rank()
    ck = Path(args.dir) / "ck"
    a = np.random.default_rng(rank).random(args.kib * 1024 // 8)
    store = CheckpointStore(ck, comm, incremental=False)
    out: dict[str, dict] = {}
    MPI.COMM_WORLD.Barrier()  # uncounted: the phases start together

    def phase(name: str, fn) -> None:
        comm.reset()
        mark(rank, f"{name}-begin")
        cpu = time.process_time()
        fn()
        cpu = time.process_time() - cpu
        mark(rank, f"{name}-end")
        out[name] = {**summarize(comm.reset()), "cpu_ms": cpu * 1e3}
        MPI.COMM_WORLD.Barrier()

    phase("save1", lambda: store.save(1, {"u": a}))
    phase("save2", lambda: store.save(2, {"u": a}))
    b = {"u": np.empty_like(a)}
    phase("restore", lambda: CheckpointStore(ck, comm).restore(b))
    assert np.array_equal(a, b["u"])
    world = MPI.COMM_WORLD  # the latency of one small allreduce here, median of 5 x 20
    runs = []
    for _ in range(5):
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(20):
            world.allreduce(1.0, op=MPI.MAX)
        runs.append(world.allreduce((time.perf_counter() - t0) / 20, op=MPI.MAX))
    out["allreduce_us"] = statistics.median(runs) * 1e6
    everyone = MPI.COMM_WORLD.gather(out, root=0)
    if rank == 0:
        Path(args.out).write_text(json.dumps(everyone))


def table(results: dict[int, dict]) -> str:
    lines = [
        "| phase | ranks | allreduce µs | CPU ms min / median / max | collectives / rank "
        "| by kind | barriers | p2p / rank "
        "| opens r0 (h5) | opens other max (h5) | fsyncs r0 / other max "
        "| renames r0 | writes r0 / other max |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in PHASES:
        for p, res in results.items():
            mpi = res["mpi"]
            ranks = [r[name] for r in mpi]  # each rank's counts of this phase
            same = all(r["collectives"] == ranks[0]["collectives"] for r in ranks)
            r0 = ranks[0]
            kinds = ", ".join(f"{k} {n}" for k, n in r0["kinds"].items())
            sys_ = res.get("strace") or {}

            def get(rank: int, key: str, sys_=sys_, name=name) -> int:
                return sys_.get(f"{rank}/{name}", {}).get(key, 0)

            def other(key: str, p=p) -> int:
                return max((get(r, key) for r in range(1, p)), default=0)

            if sys_:
                io = (
                    f"{get(0, 'opens')} ({get(0, 'h5_opens')}) | "
                    f"{other('opens')} ({other('h5_opens')}) | "
                    f"{get(0, 'fsyncs')} / {other('fsyncs')} | {get(0, 'renames')} | "
                    f"{get(0, 'writes')} / {other('writes')}"
                )
            else:
                io = "- | - | - | - | -"
            coll = f"{r0['collectives']}{'' if same else ' (differs)'}"
            cpu = sorted(r["cpu_ms"] for r in ranks)
            lines.append(
                f"| {name} | {p} | {mpi[0]['allreduce_us']:.0f} | "
                f"{cpu[0]:.1f} / {statistics.median(cpu):.1f} / {cpu[-1]:.1f} | {coll} | "
                f"{kinds} | {r0['barriers']} | {max(r['p2p'] for r in ranks)} | {io} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", default="2,4,8,16")
    ap.add_argument("--kib", type=int, default=256, help="state per rank, KiB")
    ap.add_argument("--dir", default="/tmp/hpcckpt-bench-collectives")
    ap.add_argument("--no-strace", action="store_true", help="count MPI calls only")
    ap.add_argument("--json", help="write the counts and the table here")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from tests.mpi_counting import strace_counts
    from tests.mpi_helpers import mpi_env

    mpirun = shutil.which("mpirun")
    strace = shutil.which("strace")
    if mpirun is None:
        sys.exit("mpirun not found: install Open MPI (make setup does)")
    if strace is None and not args.no_strace:
        sys.exit("strace not found: install it (apt-get install strace) or pass --no-strace")
    results: dict[int, dict] = {}
    for p in [int(x) for x in args.ranks.split(",")]:
        scratch = Path(args.dir) / f"p{p}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        out = scratch / "counts.json"
        log = scratch / "strace.log"
        argv = [mpirun, "-n", str(p), "--oversubscribe", sys.executable, "-m", "mpi4py"]
        argv += [__file__, "--worker", "--out", str(out), "--dir", str(scratch)]
        argv += ["--kib", str(args.kib)]
        if not args.no_strace:
            argv = [strace, "-f", "-o", str(log), *argv]
        proc = subprocess.run(argv, env=mpi_env(), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"{p} ranks failed:\n{proc.stderr[-3000:]}")
        res: dict = {"mpi": json.loads(out.read_text())}
        if not args.no_strace:
            counted = strace_counts(log)
            res["strace"] = {f"{r}/{ph}": dict(c) for (r, ph), c in sorted(counted.items())}
        results[p] = res
        shutil.rmtree(scratch, ignore_errors=True)
    text = table(results)
    print(f"{args.kib} KiB per rank; per rank and phase (save1: first save, save2: the next)")
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
