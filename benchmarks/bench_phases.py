"""Where one save and one restore spend their time, phase by phase, per rank.

    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -n 2 \\
        .venv/bin/python benchmarks/bench_phases.py --size 64M --reps 7 [--json OUT]
        [--profile DIR]

Every rank holds ``--size`` bytes of float64. After the writer's untimed probe saves
(as ``bench_io.py``), each repetition drops the page cache, makes one full durable
save, passes the state's bytes through the page cache and drops it again (the cold
read of ``bench_io.py``), then restores. The store's steps are wrapped to record when
each call starts and ends on each rank (``time.perf_counter``; the wrappers cost
about a microsecond per call); printed per phase: the median over the repetitions of
each rank's milliseconds in it, the largest over the ranks of the whole operation,
and how many calls. Phases nest (``write_file`` holds ``create (rank 0)``), so the
rows do not add up; "other" is the operation's time outside the top-level phases.
``--profile DIR`` writes a cProfile of each rank's timed saves and restores.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import _util  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

#: (module, attribute holder, name, label, top level?): the steps timed.
SAVE = [
    ("store", "CheckpointStore", "_encode", "encode + agree", True),
    ("store", "CheckpointStore", "_chain_intact", "chain intact? (rank 0)", False),
    ("store", "CheckpointStore", "_prepare_directory", "directory ready (rank 0)", False),
    ("store", "CheckpointStore", "_prepare", "prepare (1-2)", False),
    ("checkpoint_file", None, "_create", "create the file (rank 0)", False),
    ("store", None, "write_file", "plan + create (3a)", True),
    ("safety", None, "set_mode", "set the file's mode", True),
    ("store", "CheckpointStore", "_write_data", "write + fsync (3b)", True),
    ("store", "CheckpointStore", "_agree_or_discard", "every rank wrote (4)", True),
    ("durability", None, "publish", "rename + fsync dir (rank 0)", False),
    ("store", "CheckpointStore", "_commit", "commit agreed (5)", True),
]
RESTORE = [
    ("store", "CheckpointStore", "_listing", "list + mark (rank 0) + bcast", True),
    ("store", "CheckpointStore", "_died_reading", "leave the marker (rank 0)", False),
    ("store", "CheckpointStore", "_load", "load", False),
    ("reader", "CheckpointReader", "__init__", "open + validate", True),
    ("safety", None, "check_global_heaps", "check global heaps", False),
    ("store", "CheckpointStore", "_gather", "agreements in load", True),
    ("direct_io", None, "read_hashed", "read + hash the data", True),
    ("store", "CheckpointStore", "_chain_state", "chain state (hashes)", True),
    ("reader", "CheckpointReader", "close", "close", True),
    ("store", "CheckpointStore", "_decode", "decode + agree", True),
]


class Clock:
    """Records (label, start, end) of the wrapped calls of the current operation."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, float]] = []

    def wrap(self, holder: object, name: str, label: str) -> None:
        fn = getattr(holder, name)
        calls = self.calls

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                calls.append((label, t0, time.perf_counter()))

        setattr(holder, name, timed)

    def take(self) -> list[tuple[str, float, float]]:
        out = list(self.calls)
        self.calls.clear()
        return out


def install(clock: Clock) -> None:
    import importlib

    for table in (SAVE, RESTORE):
        for module, cls, name, label, _ in table:
            mod = importlib.import_module(f"hpcckpt.store.{module}")
            holder = getattr(mod, cls) if cls else mod
            if hasattr(holder, name):  # an older store may lack a step: its row stays empty
                clock.wrap(holder, name, label)


def summarize(calls: list[tuple[str, float, float]], t0: float, t1: float, table) -> dict:
    """ms per label (sum over calls), call counts, and the time outside top-level phases."""
    ms: dict[str, float] = defaultdict(float)
    n: dict[str, int] = defaultdict(int)
    for label, a, b in calls:
        ms[label] += (b - a) * 1e3
        n[label] += 1
    top = {label for *_, label, is_top in table if is_top}
    covered = sum(b - a for label, a, b in calls if label in top)
    ms["other"] = ((t1 - t0) - covered) * 1e3
    ms["total"] = (t1 - t0) * 1e3
    return {"ms": dict(ms), "n": dict(n)}


def worker(args: argparse.Namespace) -> None:
    from hpcckpt.store import write_path
    from hpcckpt.store.store import CheckpointStore

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    root = Path(args.dir).absolute()
    d = root / "ck"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    comm.Barrier()
    nbytes = _util.parse_size(args.size)
    a = np.arange(nbytes // 8, dtype=np.float64) + rank * (nbytes // 8)
    buf = memoryview(a).cast("B")

    def drop(warm: bool = False) -> None:
        if warm:  # as bench_io.prepare: the VM backs the memory the cold read fills
            scratch = root / f"warm.rank{rank}"
            _util.write_raw(scratch, buf, sync=False)
            scratch.unlink()
        if rank == 0:
            why = _util.drop_caches()
            if why:
                raise SystemExit(why)
        comm.Barrier()

    store = CheckpointStore(d, comm)
    state = {"u": a}
    for k in range(write_path.PROBES):  # untimed, as bench_io.py
        store.last = None
        drop()
        store.save(100 + k, state)
    clock = Clock()
    install(clock)
    prof = cProfile.Profile() if args.profile else None
    out: dict[str, list] = {"save": [], "restore": []}
    for rep in range(args.reps):
        store.last = None  # a full save, as bench_io.py's timed one
        drop()
        comm.Barrier()
        clock.take()
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        store.save(200 + rep, state)
        if prof:
            prof.disable()
        t1 = time.perf_counter()
        out["save"].append(summarize(clock.take(), t0, t1, SAVE))
        drop(warm=True)
        comm.Barrier()
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        got = store.restore(state)
        if prof:
            prof.disable()
        t1 = time.perf_counter()
        assert got is not None and got.step == 200 + rep
        out["restore"].append(summarize(clock.take(), t0, t1, RESTORE))
    if prof:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(Path(args.profile) / f"rank{rank}.prof"))
    everyone = comm.gather(out, root=0)
    if rank == 0:
        report(everyone, args)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": everyone}))
    comm.Barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def report(everyone: list[dict], args: argparse.Namespace) -> None:
    nr = len(everyone)
    for op, table in (("save", SAVE), ("restore", RESTORE)):
        labels = [label for *_, label, _ in table] + ["other", "total"]
        head = " | ".join(f"rank {r} ms" for r in range(nr))
        print(f"\n{op}, {args.size} per rank, {nr} ranks, median of {args.reps}")
        print(f"| phase | {head} | calls r0 / r1 |")
        print("|---|" + "---:|" * (nr + 1))
        for label in labels:
            cells = []
            for r in range(nr):
                vals = [rep["ms"].get(label, 0.0) for rep in everyone[r][op]]
                cells.append(f"{statistics.median(vals):.2f}")
            calls = " / ".join(
                str(everyone[r][op][0]["n"].get(label, "")) for r in range(min(nr, 2))
            )
            print(f"| {label} | {' | '.join(cells)} | {calls} |")
        slowest = [
            max(everyone[r][op][k]["ms"]["total"] for r in range(nr)) for k in range(args.reps)
        ]
        print(
            f"slowest rank's total: median {statistics.median(slowest):.1f} ms, "
            f"range {min(slowest):.1f}-{max(slowest):.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="64M", help="bytes per rank (64M, 512M)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default="/tmp/hpcckpt-bench-phases")
    ap.add_argument("--json", help="write every rank's phases of every repetition here")
    ap.add_argument("--profile", help="write a cProfile per rank (rankN.prof) into this directory")
    worker(ap.parse_args())


if __name__ == "__main__":
    main()
