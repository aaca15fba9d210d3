"""FSDP2 model + AdamW: hpcckpt against torch.distributed.checkpoint (DCP), same run.

    python benchmarks/bench_fsdp.py [--size 256M] [--repeat 3] [--root DIR] [--json FILE]
        [--no-drop-caches] [--profile DIR] [--phases]

An MLP of 4 square layers, each sharded with ``fully_shard`` (FSDP2, gloo on the CPU),
and its AdamW state after a step: about ``--size`` bytes of parameters and moments per
rank on 2 ranks (DTensors ``Shard(0)``). Started without MPI, the script runs itself
under ``mpirun`` three times:

1. ``main``, 2 ranks, ``--repeat`` times, methods interleaved in a rotated order, the
   optimizer stepping before every save:
   - ``save``: ``Checkpointer.save(step, {"model": model, "optim": optim})`` (durable,
     committed) against ``dcp.save`` of ``get_state_dict(model, optim)`` (fsynced); each
     into a new file, neither deleting an older one in the timed call (``keep_last=None``;
     each tool's checkpoint is removed untimed once measured): unlinking a 512 MiB file
     costs up to 0.5 s here, which a ``keep_last`` save paid inside ``save()`` until the
     Checkpointer's prune went to a background thread on rank 0;
   - ``restore``: ``Checkpointer.restore`` of that state against ``dcp.load`` +
     ``set_state_dict``, after the page cache was dropped (cold; see ``--no-drop-caches``);
   - ``async``: the time the ranks are blocked in ``Checkpointer(async_save=True).save``
     against ``dcp.async_save`` (each then waited for, untimed);
   each Checkpointer first calls ``restore()`` untimed, as a training job does when it
   starts (nothing to restore: it reserves the first save's staging memory there);
   then writes one checkpoint of each tool, the sources of the reshard runs;
2. ``one``, 1 rank: restores the 2-rank checkpoints (2 -> 1), each tool, ``--repeat``
   times, cold; then writes 1-rank checkpoints of each tool;
3. ``two``, 2 ranks: restores the 1-rank checkpoints (1 -> 2), each tool, cold.

Every restore is checked: an exact, order-free fingerprint of every parameter and
optimizer tensor (the sum of their bits) equals the saved state's. Times are the slowest
rank's, medians over the repetitions; ratios hpcckpt / DCP are of those medians, same
run. Writes ``benchmarks/results/fsdp-<UTC time>.json`` (or ``--json``) and prints a
table. The run removes everything it wrote under ``--root`` when it ends, fails or is
stopped (Ctrl-C, SIGTERM), and refuses to start without about 10x ``--size`` free there
(``--size 2G``: 20 GiB). ``--profile DIR`` writes a cProfile of each rank's timed
hpcckpt restores, per phase (``DIR/restore-<phase>-rank<r>.prof``; the profiler slows
them: times are then not the figures to report). ``--phases`` prints where each rank's
hpcckpt restores spent their time, phase by phase (the steps of ``bench_phases.py
--checkpointer``: medians of each rank's milliseconds; the phases nest, so the rows do
not add up). Each rank's peak resident memory is printed too: check it against the
machine before a larger ``--size`` (``--size 2G --repeat 1``, 2026-11-27, 24 GB machine:
``main`` 2.7 and 3.0 GiB, ``one`` 5.0, ``two`` 3.3 per rank; an async save that stages a
whole copy adds its size in ``main``).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _util  # noqa: E402

TOOLS = ("hpcckpt", "dcp")
PHASES = {"main": 2, "one": 1, "two": 2}
#: Disk the run needs at its peak, in units of ``--size``: the reshard sources of both
#: tools at 2 and at 1 rank (8), and a measured checkpoint beside them (2).
DISK_FACTOR = 10


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256M", help="model + AdamW bytes per rank on 2 ranks")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--root", default=os.environ.get("HPCCKPT_BENCH_DIR", "/var/tmp/hpcckpt-bench"))
    ap.add_argument("--json", help="where to write the results (default benchmarks/results/)")
    ap.add_argument("--no-drop-caches", action="store_true", help="restores read warm")
    ap.add_argument("--profile", help="cProfile each rank's hpcckpt restores into this folder")
    ap.add_argument("--phases", action="store_true", help="time the restores' phases per rank")
    ap.add_argument("--worker", choices=sorted(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args()


# -- the driver: three mpirun phases ---------------------------------------------------------
def drive(args: argparse.Namespace) -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("mpirun not found: install Open MPI (make setup does)")
    root = Path(args.root) / "fsdp"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    need = DISK_FACTOR * _util.parse_size(args.size)
    free = shutil.disk_usage(root).free
    if free < need:
        shutil.rmtree(root, ignore_errors=True)
        sys.exit(
            f"{root} has {free / _util.GiB:.1f} GiB free; --size {args.size} needs about "
            f"{need / _util.GiB:.1f} GiB at its peak: free some or pass another --root"
        )

    def stopped(signum: int, frame: Any) -> None:
        raise SystemExit(f"stopped by signal {signum}")  # the finally below cleans up

    signal.signal(signal.SIGTERM, stopped)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    results: dict[str, Any] = {}
    try:
        for phase, n in PHASES.items():
            out = root / f"{phase}.json"
            argv = [mpirun, "-n", str(n), "--oversubscribe", sys.executable, "-m", "mpi4py"]
            argv += [__file__, "--worker", phase, "--out", str(out), "--root", str(args.root)]
            argv += ["--size", args.size, "--repeat", str(args.repeat)]
            argv += ["--no-drop-caches"] if args.no_drop_caches else []
            argv += ["--profile", str(Path(args.profile).resolve())] if args.profile else []
            argv += ["--phases"] if args.phases else []
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            try:
                stdout, stderr = proc.communicate()
            except BaseException:
                proc.terminate()  # mpirun ends its ranks before it exits (SIGKILL would not)
                try:
                    proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate()
                raise
            if proc.returncode != 0:
                sys.exit(f"phase {phase} ({n} ranks) failed:\n{stdout[-2000:]}{stderr[-4000:]}")
            results[phase] = json.loads(out.read_text())
            results[phase]["wall_s"] = time.perf_counter() - t0
    finally:  # every checkpoint the run wrote, whatever ended it
        shutil.rmtree(root, ignore_errors=True)
        print(f"removed {root}", file=sys.stderr)
    summary = summarize(results)
    doc = {
        "size_per_rank": _util.parse_size(args.size),
        "repeat": args.repeat,
        "root": str(args.root),
        "machine": {"cores": os.cpu_count(), "host": socket.gethostname()},
        "phases": results,
        "summary": summary,
    }
    stamp = time.strftime("fsdp-%Y%m%dT%H%MZ.json", time.gmtime())
    out = Path(args.json) if args.json else HERE / "results" / stamp
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print_table(doc)
    if args.phases:
        print_phases(doc)
    print(f"written {out}")
    failed = [k for p in results.values() for k, ok in p["checks"].items() if not ok]
    if failed:
        sys.exit(f"restored values differ from the saved ones: {failed}")


def summarize(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, phase, op in (
        ("save (durable), 2 ranks", "main", "save"),
        ("restore (cold), 2 ranks", "main", "restore"),
        ("async save: blocked, 2 ranks", "main", "async_blocked"),
        ("restore 2 -> 1 rank", "one", "restore"),
        ("restore 1 -> 2 ranks", "two", "restore"),
    ):
        runs = results[phase]["runs"]
        med = {t: statistics.median(runs[t][op]) for t in TOOLS}
        rows.append(
            {
                "what": label,
                "phase": phase,
                "op": op,
                "hpcckpt_s": med["hpcckpt"],
                "dcp_s": med["dcp"],
                "hpcckpt_vs_dcp": med["hpcckpt"] / med["dcp"] if med["dcp"] else None,
            }
        )
    return rows


def print_table(doc: dict[str, Any]) -> None:
    per_rank = doc["phases"]["main"]["bytes_per_rank"]
    print(
        f"FSDP2 MLP + AdamW, {per_rank / _util.MiB:.0f} MiB per rank on 2 ranks, "
        f"median of {doc['repeat']} (slowest rank)"
    )
    print(f"{'':32s} {'hpcckpt':>9s} {'DCP':>9s} {'hpcckpt/DCP':>12s}")
    for r in doc["summary"]:
        ratio = f"{r['hpcckpt_vs_dcp']:.2f}x" if r["hpcckpt_vs_dcp"] else "-"
        print(f"{r['what']:32s} {r['hpcckpt_s']:8.3f}s {r['dcp_s']:8.3f}s {ratio:>12s}")
    peaks = {p: v.get("peak_rss_per_rank") for p, v in doc["phases"].items()}
    if all(peaks.values()):  # how much memory a run at this size needs (--size 2G: check)
        shown = ", ".join(
            f"{p} {'+'.join(f'{x / _util.GiB:.1f}' for x in v)}" for p, v in peaks.items()
        )
        print(f"peak resident memory per rank, GiB: {shown}")


def print_phases(doc: dict[str, Any]) -> None:
    """Each restore row's phases: the median over the repetitions of each rank's ms."""
    import bench_phases

    table = bench_phases.CHECKPOINTER + bench_phases.RESTORE
    labels = [*dict.fromkeys(label for *_, label, _ in table), "other", "total"]
    for phase, what in (("main", "same ranks"), ("one", "2 -> 1"), ("two", "1 -> 2")):
        ranks = doc["phases"][phase].get("restore_phases") or []
        print(f"\nhpcckpt restore, {what}: ms per phase, median over the repetitions")
        print("| phase | " + " | ".join(f"rank {r}" for r in range(len(ranks))) + " |")
        for label in labels:
            cells = [[rep["ms"][label] for rep in reps if label in rep["ms"]] for reps in ranks]
            if any(cells):
                shown = " | ".join(f"{statistics.median(c):.1f}" if c else "" for c in cells)
                print(f"| {label} | {shown} |")


# -- the workers ---------------------------------------------------------------------------
def work(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from mpi4py import MPI
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import hpcckpt

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    _util.gloo_over_mpi(comm)
    root = Path(args.root) / "fsdp"
    total = 2 * _util.parse_size(args.size)  # the model is the same whatever the rank count
    width = max(8, int((total / 12 / 4) ** 0.5))

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def train() -> None:
        x = torch.randn(4, width)
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    def held() -> list[Any]:
        out = [p for p in model.parameters()]
        for st in optim.state.values():
            out += [v for k, v in sorted(st.items()) if torch.is_tensor(v)]
        return out

    def fingerprint() -> list[int]:
        """The sum of each tensor's bits, over every rank: equal iff restored (whp)."""
        sums = []
        for t in held():
            local = t.to_local() if hasattr(t, "to_local") else t
            if local.dim() and hasattr(t, "to_local"):
                bits = local.detach().reshape(-1).view(torch.int32).to(torch.int64).sum()
                sums.append(comm.allreduce(int(bits), op=MPI.SUM))
            else:  # a replicated value (the step count): every rank's copy, once
                sums.append(int(local.detach().reshape(-1).view(torch.int32).to(torch.int64).sum()))
        return sums

    def scramble() -> None:
        with torch.no_grad():
            for t in held():
                (t.to_local() if hasattr(t, "to_local") else t).zero_()

    train()
    nbytes = sum(
        (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in held()
    )
    cold = _util.ColdCache(comm, skip=args.no_drop_caches)

    state = {"model": model, "optim": optim}

    def dcp_save(path: Path) -> None:
        msd, osd = get_state_dict(model, optim)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))

    def dcp_load(path: Path) -> None:
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=str(path))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def checkpointer(where: Path, **kw: Any) -> Any:
        return hpcckpt.Checkpointer(
            where, comm, every_steps=1, keep_last=None, incremental=False, validate=None, **kw
        )

    def drop_saved(ck: Any) -> None:
        """Untimed: remove the checkpoint just measured (at 2 GiB per rank, five
        repetitions of every method would otherwise fill the disk)."""
        comm.Barrier()
        if rank == 0 and ck.last_save is not None:
            Path(ck.last_save.path).unlink(missing_ok=True)
        comm.Barrier()

    runs: dict[str, dict[str, list[float]]] = {t: {} for t in TOOLS}
    checks: dict[str, bool] = {}

    def record(tool: str, op: str, seconds: float) -> None:
        runs[tool].setdefault(op, []).append(seconds)

    profile = cProfile.Profile() if args.profile and args.worker else None
    clock = None
    timings: list[dict[str, Any]] = []  # this rank's phases of each hpcckpt restore
    if args.phases:
        import bench_phases

        clock = bench_phases.Clock()
        bench_phases.install(clock, checkpointer=True)

    def restore_check(tool: str, load: Any, expected: list[int], label: str) -> None:
        scramble()
        cold()
        if profile is not None and tool == "hpcckpt":
            inner = load

            def load() -> None:
                profile.enable()
                try:
                    inner()
                finally:
                    profile.disable()

        if clock is not None and tool == "hpcckpt":
            untimed, span = load, []

            def load() -> None:
                clock.take()
                span.append(time.perf_counter())
                try:
                    untimed()
                finally:
                    span.append(time.perf_counter())

            seconds = _util.timed(comm, load)
            table = bench_phases.RESTORE + bench_phases.CHECKPOINTER
            timings.append(bench_phases.summarize(clock.take(), *span, table))
        else:
            seconds = _util.timed(comm, load)
        record(tool, "restore", seconds)
        ok = fingerprint() == expected
        checks[f"{label} {tool}"] = checks.get(f"{label} {tool}", True) and ok

    if args.worker == "main":
        ck = checkpointer(root / "hpcckpt")
        ck_async = checkpointer(root / "hpcckpt_async", async_save=True)
        for fresh in (ck, ck_async):  # as a training job starts: nothing to restore yet,
            assert fresh.restore(state) is None  # but the first save's memory is reserved
        methods = ["hpcckpt", "dcp", "hpcckpt_async", "dcp_async"]
        for rep in range(args.repeat):
            for method in _util.rotate(methods, rep):
                train()
                if method == "hpcckpt":
                    record("hpcckpt", "save", _util.timed(comm, lambda r=rep: ck.save(r, state)))
                    want = fingerprint()
                    restore_check("hpcckpt", lambda: ck.restore(state), want, "restore")
                    drop_saved(ck)
                elif method == "dcp":
                    path = root / "dcp" / f"rep{rep}"
                    record("dcp", "save", _util.timed(comm, lambda p=path: dcp_save(p)))
                    want = fingerprint()
                    restore_check("dcp", lambda p=path: dcp_load(p), want, "restore")
                    comm.Barrier()
                    if rank == 0:
                        shutil.rmtree(path, ignore_errors=True)
                elif method == "hpcckpt_async":
                    record(
                        "hpcckpt",
                        "async_blocked",
                        _util.timed(comm, lambda r=rep: ck_async.save(r, state)),
                    )
                    ck_async.wait()
                    drop_saved(ck_async)
                else:
                    path = root / "dcp_async" / f"rep{rep}"
                    box: list[Any] = []

                    def start(p: Path = path, b: list[Any] = box) -> None:
                        msd, osd = get_state_dict(model, optim)
                        b.append(dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(p)))

                    record("dcp", "async_blocked", _util.timed(comm, start))
                    box[0].result()
                    comm.Barrier()
                    if rank == 0:
                        shutil.rmtree(path, ignore_errors=True)
                comm.Barrier()
        ck.close()
        ck_async.close()
    else:  # a reshard: restore what the other rank count wrote
        source = root / ("src2" if args.worker == "one" else "src1")
        expected = json.loads((source / "expected.json").read_text())
        ck = checkpointer(source / "hpcckpt")
        for rep in range(args.repeat):
            for tool in _util.rotate(list(TOOLS), rep):
                if tool == "hpcckpt":
                    restore_check(tool, lambda: ck.restore(state), expected, "reshard")
                else:
                    restore_check(tool, lambda: dcp_load(source / "dcp"), expected, "reshard")
        ck.close()
    if args.worker in ("main", "one"):  # the sources of the next reshard
        train()
        target = root / ("src2" if args.worker == "main" else "src1")
        ck = checkpointer(target / "hpcckpt")
        ck.save(10_000, state)
        ck.close()
        dcp_save(target / "dcp")
        want = fingerprint()
        if rank == 0:
            (target / "expected.json").write_text(json.dumps(want))
        comm.Barrier()
    if profile is not None:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        profile.dump_stats(Path(args.profile) / f"restore-{args.worker}-rank{rank}.prof")
    timings_all = comm.gather(timings, root=0)
    peaks = comm.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, root=0)
    if rank == 0:
        doc = {
            "phase": args.worker,
            "ranks": size,
            "bytes_per_rank": comm.allreduce(nbytes, op=MPI.MAX),
            "width": width,
            "drop_problem": cold.problem,
            "runs": runs,
            "checks": checks,
            "torch": torch.__version__,
            "restore_phases": timings_all if args.phases else None,
            "peak_rss_per_rank": peaks,
        }
        Path(args.out).write_text(json.dumps(doc, indent=1))
    else:
        comm.allreduce(nbytes, op=MPI.MAX)
    dist.destroy_process_group()


if __name__ == "__main__":
    arguments = parse()
    if arguments.worker:
        work(arguments)
    else:
        drive(arguments)
