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

``--checkpointer`` times ``Checkpointer.save`` and ``Checkpointer.restore`` instead (the
run directory's events and heartbeats, the agreement on the call, retention with
``--keep-last``, the deadline's refresh around the store's own steps): its rows are the
top level, the store's rows nest inside "the store's save" and "the store's restore".
Where the prune runs in rank 0's background thread, its "scan + delete" is counted in
whichever operation is being timed when it ends (outside the top-level rows).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
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

#: (module, attribute holder, name, label, top level?): the steps timed. The store's
#: sub-packages (2026-11-27) come first; rows of older layouts (the flat store, and before
#: the split into commit/restore/load, 2026-11-26) keep their labels, so every code can be
#: timed by this file and compared row by row.
SAVE = [
    ("tree.encoding", "Encoder", "encode", "encode + agree", True),
    ("save.commit", "Saver", "chain_intact", "chain intact? (rank 0)", False),
    ("save.commit", "Saver", "_chain_intact", "chain intact? (rank 0)", False),
    ("save.commit", "Saver", "_prepare_directory", "directory ready (rank 0)", False),
    ("save.commit", "Saver", "_prepare", "prepare (1-2)", False),
    ("save.commit", None, "write_file", "plan + create (3a)", True),
    ("save.commit", "Saver", "_write_data", "write + fsync (3b)", True),
    ("save.commit", "Saver", "agree_or_discard", "every rank wrote (4)", True),
    ("save.commit", "Saver", "_agree_or_discard", "every rank wrote (4)", True),
    ("save.commit", "Saver", "_commit", "commit agreed (5)", True),
    ("file.writer", None, "_create", "create the file (rank 0)", False),
    ("io.safety", None, "set_mode", "set the file's mode", True),
    ("io.durability", None, "publish", "rename + fsync dir (rank 0)", False),
    ("encoding", "Encoder", "encode", "encode + agree", True),
    ("commit", "Saver", "_chain_intact", "chain intact? (rank 0)", False),
    ("commit", "Saver", "_prepare_directory", "directory ready (rank 0)", False),
    ("commit", "Saver", "_prepare", "prepare (1-2)", False),
    ("commit", None, "write_file", "plan + create (3a)", True),
    ("commit", "Saver", "_write_data", "write + fsync (3b)", True),
    ("commit", "Saver", "_agree_or_discard", "every rank wrote (4)", True),
    ("commit", "Saver", "_commit", "commit agreed (5)", True),
    ("store", "CheckpointStore", "_encode", "encode + agree", True),
    ("store", "CheckpointStore", "_parent", "directory + chain bcast (before 2026-11-24)", True),
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
    ("restore.fallback", "Restorer", "_listing", "list + mark (rank 0) + bcast", True),
    ("restore.fallback", "Restorer", "_died_reading", "leave the marker (rank 0)", False),
    ("restore.load", "Loader", "load", "load", False),
    ("restore.load", "Loader", "_plans", "validate + plan (rank 0) + scatter", True),
    ("restore.load", "Loader", "_chain_state", "chain state (hashes)", True),
    ("tree.encoding", "Encoder", "decode", "decode + agree", True),
    ("file.reader", "CheckpointReader", "__init__", "open + validate", False),
    ("file.heap_check", None, "check_global_heaps", "check global heaps", False),
    ("restore.read_plan", None, "plans", "every rank's plan (rank 0)", False),
    ("restore.read_plan", "PlanReader", "__init__", "open + read the hash rows", True),
    ("restore.read_plan", "PlanReader", "tree", "read + check the tree", True),
    ("restore.read_plan", "PlanReader", "read_all", "read + hash the data", True),
    ("io.direct_io", None, "read_hashed", "read + hash the data", True),  # general, or older
    ("restore.load", "Loader", "_load_planned", "planned read", False),
    ("restore.load", "Loader", "_own_piece", "DTensor: own piece? (planned)", True),
    ("restore.load", None, "read_targets", "the state's arrays to read into", True),
    ("restore.load", "Loader", "_load_general", "general read (every rank opens)", False),
    ("restore.pieces", "PieceReader", "box", "DTensor boxes (general)", True),
    ("restore", "Restorer", "_listing", "list + mark (rank 0) + bcast", True),
    ("restore", "Restorer", "_died_reading", "leave the marker (rank 0)", False),
    ("load", "Loader", "load", "load", False),
    ("load", "Loader", "_plans", "validate + plan (rank 0) + scatter", True),
    ("agreement", "Agreement", "findings", "agreements in load", True),
    ("load", "Loader", "_chain_state", "chain state (hashes)", True),
    ("encoding", "Encoder", "decode", "decode + agree", True),
    ("store", "CheckpointStore", "_listing", "list + mark (rank 0) + bcast", True),
    ("store", "CheckpointStore", "_died_reading", "leave the marker (rank 0)", False),
    ("store", "CheckpointStore", "_load", "load", False),
    ("store", "CheckpointStore", "_plans", "validate + plan (rank 0) + scatter", True),
    ("reader", "CheckpointReader", "__init__", "open + validate", False),
    ("heap_check", None, "check_global_heaps", "check global heaps", False),
    ("safety", None, "check_global_heaps", "check global heaps", False),  # an older store
    ("read_plan", None, "plans", "every rank's plan (rank 0)", False),
    ("read_plan", "PlanReader", "__init__", "open + read the hash rows", True),
    ("read_plan", "PlanReader", "tree", "read + check the tree", True),
    ("store", "CheckpointStore", "_gather", "agreements in load", True),
    ("direct_io", None, "read_hashed", "read + hash the data", True),
    ("store", "CheckpointStore", "_chain_state", "chain state (hashes)", True),
    ("store", "CheckpointStore", "_decode", "decode + agree", True),
]

#: Checkpointer.save and Checkpointer.restore around the store (``--checkpointer``); a
#: module named in full. Their top-level rows replace the store's, which nest inside.
CHECKPOINTER = [
    ("hpcckpt.coord.calls", "Calls", "enter", "agree on the call", True),
    ("hpcckpt.coord.calls", "Calls", "drain", "the call's agreement drained", True),
    ("hpcckpt.coord.record", "RunRecord", "event", "events (rank 0)", True),
    ("hpcckpt.rundir.heartbeat", "HeartbeatWriter", "beat", "heartbeats", True),
    ("hpcckpt.coord.checkpointer", None, "guard", "poisoned-state guard", True),
    ("hpcckpt.store.store", "CheckpointStore", "checkpoint", "the store's save", True),
    ("hpcckpt.store.store", "CheckpointStore", "prune", "retention: prune()", True),
    ("hpcckpt.store.retention", None, "prune_directory", "scan + delete (rank 0)", False),
    ("hpcckpt.store.store", "CheckpointStore", "restore", "the store's restore", True),
    ("hpcckpt.store.store", "CheckpointStore", "mirror_wait", "mirror wait (rank 0)", True),
    ("hpcckpt.coord.endtime", "JobEnd", "refresh", "deadline refresh", True),
    ("hpcckpt.store.agreement", "Agreement", "anyone", "signal agreed", True),
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


def install(clock: Clock, checkpointer: bool = False) -> None:
    import importlib

    for table in (SAVE, RESTORE, CHECKPOINTER if checkpointer else []):
        for module, cls, name, label, _ in table:
            full = module if module.startswith("hpcckpt.") else f"hpcckpt.store.{module}"
            try:
                mod = importlib.import_module(full)
            except ModuleNotFoundError:  # an older store: its rows stay empty
                continue
            holder = getattr(mod, cls, None) if cls else mod
            # an older store may lack a step, a newer one a module: its row stays empty
            if holder is not None and hasattr(holder, name):
                clock.wrap(holder, name, label)


def summarize(calls: list[tuple[str, float, float]], t0: float, t1: float, table) -> dict:
    """ms per label (sum over calls), call counts, and the time outside top-level phases."""
    ms: dict[str, float] = defaultdict(float)
    n: dict[str, int] = defaultdict(int)
    for label, a, b in calls:
        ms[label] += (b - a) * 1e3
        n[label] += 1
    top = {label for *_, label, is_top in table if is_top}
    if any(row in CHECKPOINTER for row in table):  # the store's rows nest in the Checkpointer's
        top = {label for *_, label, is_top in CHECKPOINTER if is_top}
    covered = sum(b - a for label, a, b in calls if label in top)
    ms["other"] = ((t1 - t0) - covered) * 1e3
    ms["total"] = (t1 - t0) * 1e3
    return {"ms": dict(ms), "n": dict(n)}


def full_next(store) -> None:
    """Make the store's next save a full one (an older store kept its chain as ``last``)."""
    if hasattr(store, "saver"):
        store.saver.remember(None)
    else:
        store.last = None


def worker(args: argparse.Namespace) -> None:
    try:
        from hpcckpt.store.io import write_path
    except ImportError:  # the flat store, before its sub-packages: time it too
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
        if rank == 0 and not args.no_drop_caches:
            why = _util.drop_caches()
            if why:
                raise SystemExit(f"{why}; run as root, or pass --no-drop-caches (warm reads)")
        comm.Barrier()

    state = {"u": a}
    ck = None
    if args.checkpointer:
        import hpcckpt

        keep = None if args.keep_last == 0 else args.keep_last
        ck = hpcckpt.Checkpointer(d, comm, every_steps=1, keep_last=keep, incremental=False)
        store = ck.store
        save, restore = ck.save, ck.restore
        tables = {"save": SAVE + CHECKPOINTER, "restore": RESTORE + CHECKPOINTER}
    else:
        store = CheckpointStore(d, comm)
        save, restore = store.save, store.restore
        tables = {"save": SAVE, "restore": RESTORE}
    for k in range(write_path.PROBES):  # untimed, as bench_io.py
        full_next(store)
        drop()
        save(100 + k, state)
    clock = Clock()
    install(clock, checkpointer=args.checkpointer)
    prof = cProfile.Profile() if args.profile else None
    out: dict[str, list] = {"save": [], "restore": [], "raw": []}
    raw = root / f"raw.rank{rank}"

    def slowest(fn) -> float:
        comm.Barrier()
        t = time.perf_counter()
        fn()
        return comm.allreduce(time.perf_counter() - t, op=MPI.MAX) * 1e3

    for rep in range(args.reps):
        # The references of bench_io.py in the same repetition: the limit's write and
        # its cold read, and np.save per rank (all with fsync), the slowest rank's ms.
        drop()
        limit_w = slowest(lambda: _util.write_raw(raw, buf))
        drop(warm=True)
        limit_r = slowest(lambda: _util.read_raw(raw, buf))
        raw.unlink()
        drop()
        npsave = slowest(lambda: _npsave(raw, a))
        raw.unlink()
        out["raw"].append({"limit_write": limit_w, "limit_read": limit_r, "np_save": npsave})
        full_next(store)  # a full save, as bench_io.py's timed one
        drop()
        comm.Barrier()
        clock.take()
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        save(200 + rep, state)
        if prof:
            prof.disable()
        t1 = time.perf_counter()
        out["save"].append(summarize(clock.take(), t0, t1, tables["save"]))
        drop(warm=True)
        comm.Barrier()
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        got = restore(state)
        if prof:
            prof.disable()
        t1 = time.perf_counter()
        assert got is not None and getattr(got, "step", got) == 200 + rep
        out["restore"].append(summarize(clock.take(), t0, t1, tables["restore"]))
    if prof:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(Path(args.profile) / f"rank{rank}.prof"))
    if ck is not None:
        ck.close()
    everyone = comm.gather(out, root=0)
    if rank == 0:
        report(everyone, args)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "ranks": everyone}))
    comm.Barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def _npsave(path: Path, a: np.ndarray) -> None:
    with open(path, "wb") as fh:
        np.save(fh, a)
        fh.flush()
        os.fsync(fh.fileno())


def report(everyone: list[dict], args: argparse.Namespace) -> None:
    nr = len(everyone)
    raw = everyone[0]["raw"]
    save = [max(everyone[r]["save"][k]["ms"]["total"] for r in range(nr)) for k in range(args.reps)]
    rest = [
        max(everyone[r]["restore"][k]["ms"]["total"] for r in range(nr)) for k in range(args.reps)
    ]
    best = [min(x["limit_write"], x["np_save"]) for x in raw]
    med = statistics.median
    refs = {k: med([x[k] for x in raw]) for k in ("limit_write", "np_save", "limit_read")}
    print(
        f"references, ms (median of {args.reps}): limit write {refs['limit_write']:.1f}, "
        f"np.save per rank {refs['np_save']:.1f}, limit cold read {refs['limit_read']:.1f}"
    )
    ratio_s = [b / s for b, s in zip(best, save, strict=True)]
    ratio_r = [x["limit_read"] / r for x, r in zip(raw, rest, strict=True)]
    print(
        f"save x best raw: median {med(ratio_s):.2f} ({min(ratio_s):.2f}-{max(ratio_s):.2f}); "
        f"restore x cold read: median {med(ratio_r):.2f} ({min(ratio_r):.2f}-{max(ratio_r):.2f})"
    )
    extra = CHECKPOINTER if args.checkpointer else []
    for op, table in (("save", extra + SAVE), ("restore", extra + RESTORE)):
        labels = [*dict.fromkeys(label for *_, label, _ in table), "other", "total"]
        head = " | ".join(f"rank {r} ms" for r in range(nr))
        what = f"Checkpointer.{op} (keep_last={args.keep_last or None})" if extra else op
        print(f"\n{what}, {args.size} per rank, {nr} ranks, median of {args.reps}")
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
    ap.add_argument("--no-drop-caches", action="store_true", help="warm reads (no root needed)")
    ap.add_argument("--profile", help="write a cProfile per rank (rankN.prof) into this directory")
    ap.add_argument(
        "--checkpointer",
        action="store_true",
        help="time Checkpointer.save/restore (events, heartbeats, retention) around the store",
    )
    ap.add_argument(
        "--keep-last", type=int, default=3, help="with --checkpointer: retention (0: keep all)"
    )
    worker(ap.parse_args())


if __name__ == "__main__":
    main()
