"""Each communicator backend in one run: ``due()`` per call, a save and a cold restore.

    .venv/bin/python benchmarks/bench_backends.py [--size 256M] [--reps 3] [--rounds 2]
        [--calls 20000] [--backends mpi,torch] [--dir /tmp/hpcckpt-bench-backends]
        [--json FILE] [--no-drop-caches]

Each round starts one 2-rank job per backend, the order alternating between rounds: MPI
as ``mpirun -n 2 python -m mpi4py bench_backends.py --worker mpi``, torch.distributed as
``torchrun --nproc-per-node=2 bench_backends.py --worker torch`` (a gloo group; the
Checkpointer is handed the process group, as a torchrun user hands it or lets it find it).
In each job:

- ``due``: ``bench_due.measure`` (``--calls`` calls of ``Checkpointer.due`` with nothing
  due, per configuration, and the backend's bare non-blocking all-reduce);
- ``save``: ``--reps`` durable saves (``Checkpointer.save``, fsynced, committed; full, not
  incremental) of ``--size`` bytes of float64 per rank, every value changed before each;
- ``restore``: ``--reps`` restores into a state of the same shape by a new
  Checkpointer, after the page cache was dropped (as root; ``--no-drop-caches`` not);
  every restore checked bit-exact.

Every operation is timed between barriers by its slowest rank. Printed: per backend, the
median over all repetitions of every round (min-max), and torch's ratio to MPI. The JSON
(default ``benchmarks/results/backends-<time>.json``) holds every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import _util  # noqa: E402
import bench_due  # noqa: E402

import hpcckpt  # noqa: E402

DUE_ROW = "every_steps=10**9"


def timed(comm: Any, fn: Any) -> float:
    """``fn`` on every rank between barriers; the slowest rank's seconds."""
    comm.barrier()
    t0 = time.perf_counter()
    fn()
    return float(comm.allreduce(time.perf_counter() - t0, "max"))


def cold(comm: Any, skip: bool) -> str | None:
    """Rank 0 drops the page cache while the others wait; why it could not, or None."""
    comm.barrier()
    problem = None if skip or comm.rank else _util.drop_caches()
    comm.barrier()
    return problem


def worker(args: argparse.Namespace) -> None:
    """One backend's 2-rank job (see the module docstring); rank 0 writes ``--out``."""
    backend = bench_due.Backend(args.worker)
    comm = backend.comm
    try:
        due = bench_due.measure(backend, args.calls)
        words = _util.parse_size(args.size) // 8
        state = {"x": np.random.default_rng(comm.rank).standard_normal(words)}
        where = Path(args.dir) / args.worker
        if comm.rank == 0:
            shutil.rmtree(where, ignore_errors=True)
        comm.barrier()
        saves, restores, problems = [], [], set()
        ck = hpcckpt.Checkpointer(where, backend.native, every_steps=1, keep_last=2,
                                  incremental=False)  # fmt: skip
        try:
            for rep in range(args.reps):
                state["x"] += 1.0  # every value new: a full save writes them all
                problems.add(cold(comm, args.no_drop_caches))
                saves.append(timed(comm, lambda rep=rep: ck.save(rep, state)))
        finally:
            ck.close()
        for _ in range(args.reps):
            into = {"x": np.zeros_like(state["x"])}
            reader = hpcckpt.Checkpointer(where, backend.native, every_steps=1)
            try:
                problems.add(cold(comm, args.no_drop_caches))
                restores.append(timed(comm, lambda r=reader, into=into: r.restore(into)))
            finally:
                reader.close()
            if not np.array_equal(into["x"], state["x"]):
                raise SystemExit(f"rank {comm.rank}: the restored state differs from the saved")
        if comm.rank == 0:
            shutil.rmtree(where, ignore_errors=True)
            doc = {
                "backend": args.worker,
                "nranks": comm.size,
                "bytes_per_rank": words * 8,
                "due": due,
                "save_s": saves,
                "restore_s": restores,
                "cache_problem": sorted(p for p in problems if p),
            }
            Path(args.out).write_text(json.dumps(doc, indent=1))
    finally:
        backend.close()


def launch(backend: str, args: argparse.Namespace, out: Path) -> None:
    """Start one backend's 2-rank job and wait for it."""
    me = [str(Path(__file__).resolve()), "--worker", backend, "--out", str(out),
          "--size", args.size, "--reps", str(args.reps), "--calls", str(args.calls),
          "--dir", args.dir, *(["--no-drop-caches"] if args.no_drop_caches else [])]  # fmt: skip
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    bindir = Path(sys.executable).parent
    if backend == "mpi":
        argv = ["mpirun", "-n", "2", sys.executable, "-m", "mpi4py", *me]
    else:
        port = bench_due.free_port()
        argv = [str(bindir / "torchrun"), "--nproc-per-node=2", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}", *me]  # fmt: skip
        env = {k: v for k, v in env.items() if not k.startswith(("OMPI_COMM", "PMIX_"))}
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0 or not out.exists():
        raise SystemExit(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-4000:]}")


def summary(runs: list[dict]) -> dict[str, dict]:
    """Per backend: medians (min, max) over every job's samples."""
    out: dict[str, dict] = {}
    for name in sorted({r["backend"] for r in runs}):
        mine = [r for r in runs if r["backend"] == name]
        row: dict[str, Any] = {"bytes_per_rank": mine[0]["bytes_per_rank"]}
        floor = next(k for k in mine[0]["due"] if k.startswith("bare"))
        samples = {
            "due_us": [r["due"][DUE_ROW]["median_us"] for r in mine],
            "bare_us": [r["due"][floor]["median_us"] for r in mine],
            "save_s": [s for r in mine for s in r["save_s"]],
            "restore_s": [s for r in mine for s in r["restore_s"]],
        }
        for key, values in samples.items():
            row[key] = {"median": _util.median(values), "min": min(values), "max": max(values)}
        row["floor"] = floor
        out[name] = row
    return out


def table(rows: dict[str, dict]) -> list[str]:
    def cell(v: dict, fmt: str) -> str:
        return f"{v['median']:{fmt}} ({v['min']:{fmt}}-{v['max']:{fmt}})"

    lines = [
        f"{'backend':8} {'due() us':>22} {'bare all-reduce us':>24} {'save s':>22} "
        f"{'GB/s':>6} {'restore s':>22} {'GB/s':>6}"
    ]
    for name, r in rows.items():
        total = 2 * r["bytes_per_rank"] / 1e9
        lines.append(
            f"{name:8} {cell(r['due_us'], '.1f'):>22} {cell(r['bare_us'], '.1f'):>24} "
            f"{cell(r['save_s'], '.3f'):>22} {total / r['save_s']['median']:6.2f} "
            f"{cell(r['restore_s'], '.3f'):>22} {total / r['restore_s']['median']:6.2f}"
        )
    if {"mpi", "torch"} <= set(rows):
        m, t = rows["mpi"], rows["torch"]
        ratios = ", ".join(
            f"{k} {t[k]['median'] / m[k]['median']:.2f}x" for k in ("due_us", "save_s", "restore_s")
        )
        lines.append(f"torch / mpi (medians): {ratios}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="256M", help="bytes per rank (64M, 256M, 1G...)")
    p.add_argument("--reps", type=int, default=3, help="saves and restores per job")
    p.add_argument("--rounds", type=int, default=2, help="jobs per backend, alternated")
    p.add_argument("--calls", type=int, default=20_000, help="due() calls per configuration")
    p.add_argument("--backends", default="mpi,torch")
    p.add_argument("--dir", default="/tmp/hpcckpt-bench-backends", help="scratch directory")
    p.add_argument("--json", type=Path, help="default: benchmarks/results/backends-<time>.json")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--worker", choices=bench_due.BACKENDS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in bench_due.BACKENDS:
            p.error(f"--backends: {b!r} is not one of {', '.join(bench_due.BACKENDS)}")
    runs: list[dict] = []
    tmp = Path(tempfile.mkdtemp(prefix="hpcckpt-backends-"))
    started, load_start = time.time(), os.getloadavg()
    try:
        for rnd in range(args.rounds):
            for b in _util.rotate(backends, rnd):
                out = tmp / f"{b}-{rnd}.json"
                t0 = time.monotonic()
                launch(b, args, out)
                runs.append(dict(json.loads(out.read_text()), round=rnd))
                print(f"round {rnd + 1}/{args.rounds}: {b} done in {time.monotonic() - t0:.0f} s",
                      flush=True)  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(args.dir, ignore_errors=True)
    rows = summary(runs)
    print(f"2 ranks, {args.size} per rank, {args.reps} reps x {args.rounds} rounds; "
          f"due(): median per call ({DUE_ROW}), {args.calls} calls")  # fmt: skip
    print("\n".join(table(rows)))
    problems = sorted({p for r in runs for p in r["cache_problem"]})
    if problems:
        print(f"note: the page cache was not dropped: {problems[0]}")
    path = args.json or HERE / "results" / time.strftime(
        "backends-%Y%m%dT%H%MZ.json", time.gmtime(started)
    )
    doc = {
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "json")},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "summary": rows,
        "runs": runs,
    }
    Path(path).write_text(json.dumps(doc, indent=1))
    print(f"written {path}")


if __name__ == "__main__":
    main()
