"""Blocked time of a node-local save with partner or XOR redundancy, and the rebuild time.

    .venv/bin/python benchmarks/bench_redundancy.py [--sizes 64M,256M,512M] [--reps 3]
        [--nranks 3] [--variants partner,xor] [--cache-root /dev/shm] [--dir SCRATCH]
        [--json FILE]

Started without MPI it re-launches itself under ``mpirun -n NRANKS``. Every rank gets
its own fake node name (``Checkpointer(node_name=...)``) and the cache
``CACHE_ROOT/<unique>/%n``, so each "node" has its own directory on this machine and
the redundancy data really moves between processes over MPI (shared memory here, the
network on a cluster). Every save is node-local only (``drain_every`` very large: no
drain competes with the measurement), ``incremental=False``, ``validate=None``.

Per size of float64 state per rank and per repetition, in an order shuffled per
repetition (seeded), each between barriers and timed by the slowest rank:

- ``memcpy``: copy of the state into a preallocated buffer (the yardstick);
- ``none``: ``save`` to the node-local tier without redundancy;
- ``partner``: with ``redundancy="partner"``;
- ``xorN``: with ``redundancy="xor"`` and one set of all N ranks (run with
  ``--nranks 3`` and ``--nranks 4`` for sets of 3 and 4);
- ``restore``: ``restore()`` of the last variant's copy (xor, else partner), nothing lost;
  before each restore an untimed save makes the node-local copy the newest checkpoint;
- ``rebuild-xor`` / ``rebuild-partner``: ``restore()`` after rank 1's node directory is
  deleted (its data rebuilt from the set, moved nowhere, verified by its checksums).

Ratios are taken per repetition against ``none`` of the same repetition, then the
median. The JSON (default ``benchmarks/results/redundancy-<UTC time>.json``) holds
every sample.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import _util  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="64M,256M,512M", help="state per rank, comma-separated")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--nranks", type=int, default=3, help="ranks when it launches mpirun itself")
    p.add_argument("--cache-root", default="/dev/shm")
    p.add_argument("--dir", default="/tmp", help="where the (unused) checkpoint directories go")
    p.add_argument(
        "--variants",
        default="partner,xor",
        help="redundancy variants beside 'none' (always run): partner, xor (one set of all "
        "ranks); fewer variants need less memory",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=7)
    return p.parse_args(argv)


def _under_mpi() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def main() -> None:
    args = parse_args()
    if not _under_mpi():
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            sys.exit("mpirun not found: install openmpi-bin (make setup does)")
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        cmd = [mpirun, "-n", str(args.nranks), "--oversubscribe", sys.executable, "-m",
               "mpi4py", __file__, *sys.argv[1:]]  # fmt: skip
        os.execvpe(cmd[0], cmd, env)
    run(args)


def run(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    import hpcckpt

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    tag = comm.bcast(uuid.uuid4().hex[:8] if rank == 0 else None)
    base = Path(args.cache_root) / f"hpcckpt-bench-{tag}"
    work = Path(args.dir) / f"hpcckpt-bench-{tag}"
    wanted = {v.strip() for v in args.variants.split(",") if v.strip()}
    unknown = wanted - {"partner", "xor"}
    if unknown:
        sys.exit(f"--variants: unknown {sorted(unknown)}; choose from partner, xor")
    variants = ["none", *(["partner"] if "partner" in wanted else [])]
    variants += [f"xor{n}"] if "xor" in wanted else []  # one XOR set of every rank
    t_start = time.time()
    samples: dict[str, dict[str, list[float]]] = {}

    def checkpointer(name: str, size: str) -> hpcckpt.Checkpointer:
        scheme = {"none": None, "partner": "partner"}.get(name, "xor")
        members = int(name[3:]) if name.startswith("xor") else 8
        return hpcckpt.Checkpointer(
            work / size / name,
            comm,
            every_steps=1,
            cache=f"{base}/{size}/{name}/%n",
            redundancy=scheme,
            redundancy_set=members,
            drain_every=10**9,
            node_name=f"b{rank}",
            incremental=False,
            validate=None,
            keep_last=None,
        )

    try:
        for size_text in args.sizes.split(","):
            nbytes = _util.parse_size(size_text)
            # per rank: state, memcpy target, on /dev/shm the copies of the variants
            # (none 1, partner 2, xor n/(n-1)) and one more state's worth (the copy being
            # replaced during a save, or the arrays a restore reads: never both)
            copies = {"none": 1.0, "partner": 2.0}
            need = n * nbytes * (3 + sum(copies.get(v, n / (n - 1)) for v in variants))
            if comm.bcast(need > 0.8 * _mem_available() if rank == 0 else None):
                if rank == 0:
                    print(f"skipping {size_text}: needs ~{need / 2**30:.1f} GiB of memory")
                continue
            state = {"u": np.random.default_rng(rank).random(nbytes // 8)}
            target = np.empty_like(state["u"])
            cks = {v: checkpointer(v, size_text) for v in variants}
            for ck in cks.values():  # untimed first save: the files and the layout
                ck.save(0, state)
            per: dict[str, list[float]] = {}
            order = ["memcpy", *variants, *_restores(variants)]
            rng = random.Random(args.seed)
            step = 0
            for _ in range(args.reps):
                rng.shuffle(order)
                for m in order:
                    step += 1
                    comm.Barrier()
                    if m == "memcpy":
                        t = _util.timed(comm, lambda d=target, s=state: np.copyto(d, s["u"]))
                    elif m in cks:
                        t = _util.timed(comm, lambda c=cks[m], k=step, s=state: c.save(k, s))
                    else:
                        ck = cks["partner" if m == "rebuild-partner" else variants[-1]]
                        # untimed: a node-local checkpoint newer than the directory's (an
                        # earlier restore drained its copy there)
                        ck.save(step, state)
                        comm.Barrier()
                        if m != "restore" and rank == 1:
                            shutil.rmtree(ck.cache)
                        comm.Barrier()
                        t = _util.timed(comm, lambda c=ck, s=state: c.restore(s))
                        ck.wait()  # the restored copy's drain: not timed
                    per.setdefault(m, []).append(t)
            for ck in cks.values():
                ck.close()
            samples[size_text] = per
            del state, target
            comm.Barrier()
            if rank == 0:  # free the node-local copies (memory, on /dev/shm) before the next
                shutil.rmtree(base / size_text, ignore_errors=True)
                shutil.rmtree(work / size_text, ignore_errors=True)
            comm.Barrier()
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
    if rank == 0:
        report(args, n, variants, samples, time.time() - t_start)


def _restores(variants: list[str]) -> list[str]:
    """The restores measured: of the last variant's copy, and a rebuild per scheme run."""
    out = ["restore"] if len(variants) > 1 else []
    out += ["rebuild-xor"] if variants[-1].startswith("xor") else []
    return out + (["rebuild-partner"] if "partner" in variants else [])


def _mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def report(args, n, variants, samples, seconds) -> None:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.json) if args.json else HERE / "results" / f"redundancy-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"nranks": n, "reps": args.reps, "seconds": seconds, "cache_root": args.cache_root}
    out.write_text(json.dumps({**doc, "samples": samples}, indent=1))
    print(f"{n} ranks, {args.reps} repetitions, cache on {args.cache_root}; {out.name}")
    cols = ["memcpy", *variants, *_restores(variants)]
    print("| size/rank | " + " | ".join(cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for size, per in samples.items():
        cells = []
        for c in cols:
            med = _util.median(per[c])
            ratio = _util.median([a / b for a, b in zip(per[c], per["none"], strict=True)])
            cells.append(f"{med:.3f} s ({ratio:.2f}x)")
        print(f"| {size} | " + " | ".join(cells) + " |")
    print("(x: per-repetition ratio to the node-local save without redundancy, median)")


if __name__ == "__main__":
    main()
