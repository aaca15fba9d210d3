"""The I/O benchmark in one command: ``make bench`` or ``.venv/bin/python benchmarks/run.py``.

For each repetition, one ``mpirun -n 2 benchmarks/bench_io.py`` per MPI-IO component
(the default, ompio, and ``OMPI_MCA_io=romio321``; the order alternates between
repetitions) runs every method once per size, in a rotated order, next to the
physical limit measured in the same invocation. The table gives medians over the
repetitions of *ratios within one invocation* (the machine is shared and noisy);
absolute GB/s are shown too, but are not comparable across runs.

PyTorch (for the torch.distributed.checkpoint peer) is installed into this venv
with ``pip install torch==2.13.0`` when it is missing, unless ``--no-torch``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _util  # noqa: E402

TORCH_PIN = "torch==2.13.0"
ALL_METHODS = _util.METHODS
H5PY_METHODS = ["limit", "hpcckpt", "h5py_collective"]  # run again under romio321
IO_COMPONENTS = {"ompio": None, "romio321": "romio321"}  # label -> OMPI_MCA_io (None: default)
WRITES = [
    "limit_write",
    "dd",
    "dd_direct",
    "hpcckpt_save",
    "hpcckpt_incr",
    "gather_npsave",
    "fpr_npsave",
]
WRITES.append("h5py_collective")
WRITES.append("torch_dcp")
READS = ["limit_read", "hpcckpt_restore"]
PEERS = ["gather_npsave", "fpr_npsave", "h5py_collective", "torch_dcp"]
# The fastest raw write seen in the same invocation: the limit, file-per-rank np.save
# (one write call per rank), which was often faster than the limit's 64 MiB writes here,
# or every rank writing zeros to its own file with dd oflag=direct (no page cache).
BEST_RAW = ["limit_write", "fpr_npsave", "dd_direct"]
DESCRIPTION = {
    "limit_write": "limit: own file per rank, 64 MiB writes + fsync",
    "limit_read": "limit: cold-cache read of those files",
    "dd": "dd bs=4M conv=fdatasync, one stream, all bytes",
    "dd_direct": "dd oflag=direct conv=fsync, own file per rank",
    "hpcckpt": "hpcckpt CheckpointStore.save + restore",
    "hpcckpt_save": "hpcckpt CheckpointStore.save (durable)",
    "hpcckpt_restore": "hpcckpt CheckpointStore.restore (cold)",
    "hpcckpt_incr": "hpcckpt incremental save, 1% of blocks dirty",
    "gather_npsave": "peer: gather to rank 0 + np.save + fsync",
    "fpr_npsave": "peer: file per rank np.save + fsync",
    "h5py_collective": "peer: h5py mpio collective + flush + fsync",
    "torch_dcp": "peer: torch.distributed.checkpoint (gloo, CPU)",
}


def mpi_env(io: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("OMPI_MCA_io", None)
    if io:
        env["OMPI_MCA_io"] = io
    return env


def mpirun_argv(nranks: int, script: Path, args: list[str]) -> list[str]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("mpirun not found: install openmpi-bin (make setup does)")
    return [mpirun, "-n", str(nranks), "--oversubscribe", sys.executable, "-m", "mpi4py"] + [
        str(script),
        *args,
    ]


def ensure_torch(allow_install: bool) -> str | None:
    """None when torch imports (installing it when missing), else why it is not available."""
    if importlib.util.find_spec("torch") is not None:
        return None
    if not allow_install:
        return "torch is not installed (--no-torch)"
    print(f"torch is missing: installing it into this venv (pip install {TORCH_PIN}) ...")
    argv = [sys.executable, "-m", "pip", "install", "--quiet", TORCH_PIN]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return f"pip install {TORCH_PIN} failed: {' / '.join(tail)}"
    importlib.invalidate_caches()
    if importlib.util.find_spec("torch") is None:
        return f"pip install {TORCH_PIN} finished but torch does not import"
    print(f"installed {TORCH_PIN}")
    return None


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""


def machine_info(directory: Path) -> dict:
    """CPU, memory, kernel, file system and library versions, for the report."""
    info: dict = {"python": platform.python_version(), "kernel": platform.release()}
    try:
        cpu = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(
            line.split(":", 1)[1].strip() for line in cpu.splitlines() if "model name" in line
        )
    except (OSError, StopIteration):
        info["cpu"] = "unknown"
    info["cores"] = os.cpu_count()
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        info["ram_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    df = _run(["df", "-hT", str(directory)]).strip().splitlines()
    info["df"] = df[-1] if df else ""
    info["findmnt"] = _run(["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "-T", str(directory)])
    info["findmnt"] = info["findmnt"].strip()
    ver = _run(["mpirun", "--version"]).strip().splitlines()
    info["open_mpi"] = ver[0] if ver else "unknown"
    code = (
        "import h5py, numpy, mpi4py, json; "
        "print(json.dumps({'h5py': h5py.version.version, 'hdf5': h5py.version.hdf5_version,"
        " 'h5py_mpi': h5py.get_config().mpi, 'numpy': numpy.__version__,"
        " 'mpi4py': mpi4py.__version__}))"
    )
    try:
        info.update(json.loads(_run([sys.executable, "-c", code])))
    except ValueError:
        pass
    torch_ver = _run([sys.executable, "-c", "import torch; print(torch.__version__)"]).strip()
    info["torch"] = torch_ver or None
    head = _run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]).strip()
    dirty = _run(["git", "-C", str(ROOT), "status", "--short", "hpcckpt"]).strip()
    info["git"] = head + (" (hpcckpt/ modified in the work tree)" if dirty else "")
    return info


def check_space(directory: Path, sizes: list[int], nranks: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    need = 2 * max(sizes) * nranks + _util.GiB  # a method's files plus the limit's, plus slack
    free = shutil.disk_usage(directory).free
    if free < need:
        sys.exit(
            f"{directory}: {free / _util.GiB:.1f} GiB free, the benchmark needs about "
            f"{need / _util.GiB:.1f} GiB: free some space or pass --dir elsewhere"
        )


# -- aggregation ---------------------------------------------------------------------------


def summarize(runs: list[dict], nranks: int) -> dict:
    """Median ratios per (io, size, method) from the invocations' records."""
    # by (label, rep) -> {(size, method): seconds}
    table: dict[tuple[str, int, str], list[dict]] = {}
    for run in runs:
        times = {
            (r["bytes_per_rank"], r["method"]): r["seconds"]
            for r in run["records"]
            if r["seconds"] is not None
        }
        for r in run["records"]:
            size, m = r["bytes_per_rank"], r["method"]
            key = (run["label"], size, m)
            entry = {"rep": run["rep"], "seconds": r["seconds"], "note": _note(r)}
            base = "limit_read" if m in READS else "limit_write"
            lim = times.get((size, base))
            if r["seconds"] is not None and lim:
                entry["ratio_to_limit"] = lim / r["seconds"]
                raw = [times.get((size, k)) for k in BEST_RAW] if m in WRITES else []
                raw = [x for x in raw if x]
                if raw:
                    entry["ratio_to_best_raw"] = min(raw) / r["seconds"]
                save = times.get((size, "hpcckpt_save"))
                if m in PEERS and save:
                    entry["hpcckpt_speedup"] = r["seconds"] / save  # > 1: hpcckpt faster
            table.setdefault(key, []).append(entry)
    rows = []
    for (label, size, m), entries in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        secs = [e["seconds"] for e in entries if e["seconds"] is not None]
        row = {
            "io": label,
            "bytes_per_rank": size,
            "method": m,
            "reps": len(secs),
            "notes": sorted({e["note"] for e in entries if e["note"]}),
        }
        if secs:
            med = _util.median(secs)
            row["seconds_median"] = med
            row["gbps_median"] = size * nranks / med / 1e9
            for k in ("ratio_to_limit", "ratio_to_best_raw", "hpcckpt_speedup"):
                vals = [e[k] for e in entries if k in e]
                if vals:
                    row[k] = {"median": _util.median(vals), "min": min(vals), "max": max(vals)}
        rows.append(row)
    return {"rows": rows, "io_comparison": _io_comparison(rows), "goals": _goals(rows)}


def _note(record: dict) -> str:
    for k in ("unavailable", "error"):
        if record.get(k):
            return f"{k}: {record[k]}"
    return ""


def _ratio(rows: list[dict], io: str, size: int, method: str) -> float | None:
    for r in rows:
        if (r["io"], r["bytes_per_rank"], r["method"]) == (io, size, method):
            return r.get("ratio_to_limit", {}).get("median")
    return None


def _io_comparison(rows: list[dict]) -> list[dict]:
    out = []
    sizes = sorted({r["bytes_per_rank"] for r in rows})
    for size in sizes:
        for m in ("hpcckpt_save", "hpcckpt_restore", "h5py_collective"):
            a, b = _ratio(rows, "ompio", size, m), _ratio(rows, "romio321", size, m)
            if a is None or b is None:
                continue
            out.append(
                {
                    "bytes_per_rank": size,
                    "method": m,
                    "ompio": a,
                    "romio321": b,
                    "faster": "ompio" if a > b else "romio321",
                    "factor": max(a, b) / min(a, b),
                }
            )
    return out


def _goals(rows: list[dict]) -> list[dict]:
    goals = []
    for r in rows:
        if r["io"] != "ompio":
            continue
        size, m = r["bytes_per_rank"], r["method"]
        ratio = r.get("ratio_to_limit", {}).get("median")
        if m == "hpcckpt_save" and size >= 512 * _util.MiB and ratio is not None:
            goals.append(_goal(f"save >= 90% of limit at {_util.size_label(size)}", ratio, 0.9))
            best = r.get("ratio_to_best_raw", {}).get("median")
            if best is not None:
                what = f"save >= 90% of best raw write at {_util.size_label(size)}"
                goals.append(_goal(what, best, 0.9))
        if m == "hpcckpt_restore" and ratio is not None:
            what = f"restore >= 90% of cold read at {_util.size_label(size)}"
            goals.append(_goal(what, ratio, 0.9))
        speed = r.get("hpcckpt_speedup", {}).get("median")
        if m in PEERS and speed is not None:
            goals.append(_goal(f"save faster than {m} at {_util.size_label(size)}", speed, 1.0))
    return goals


def _goal(what: str, value: float, target: float) -> dict:
    return {"goal": what, "value": value, "target": target, "met": value >= target}


def format_table(summary: dict) -> str:
    lines = []
    head = (
        f"{'size/rank':>9} {'io':8} {'method':48} {'median s':>9} {'GB/s*':>6} "
        f"{'x limit (min-max)':>20} {'x best raw':>10} {'save vs':>8}"
    )
    lines += [head, "-" * len(head)]
    last = None
    for r in summary["rows"]:
        size = _util.size_label(r["bytes_per_rank"])
        if last is not None and size != last:
            lines.append("")
        last = size
        desc = DESCRIPTION.get(r["method"], r["method"])
        if "seconds_median" not in r:
            why = "; ".join(r["notes"]) or "no result"
            lines.append(f"{size:>9} {r['io']:8} {desc:48} not available: {why[:90]}")
            continue
        rl = r.get("ratio_to_limit")
        rls = f"{rl['median']:.2f} ({rl['min']:.2f}-{rl['max']:.2f})" if rl else ""
        br = r.get("ratio_to_best_raw")
        brs = f"{br['median']:.2f}" if br else ""
        sp = r.get("hpcckpt_speedup")
        sps = f"{sp['median']:.2f}x" if sp else ""
        lines.append(
            f"{size:>9} {r['io']:8} {desc:48} {r['seconds_median']:9.3f} "
            f"{r['gbps_median']:6.2f} {rls:>20} {brs:>10} {sps:>8}"
        )
    lines.append("")
    lines.append(
        "x limit: the limit's time / this method's time in the same invocation (1.00 = at the "
        "limit; reads vs the cold read), median over repetitions. save vs: this peer's time / "
        "hpcckpt save's time (>1: hpcckpt faster). x best raw: the fastest of the limit, "
        "file-per-rank np.save and dd oflag=direct in the same invocation / this time. "
        "*GB/s: all ranks' bytes / median time; not comparable across runs."
    )
    if summary["io_comparison"]:
        lines.append("")
        lines.append("MPI-IO component (median x limit, each vs its own invocation's limit):")
        for c in summary["io_comparison"]:
            lines.append(
                f"  {_util.size_label(c['bytes_per_rank']):>5} {c['method']:16} "
                f"ompio {c['ompio']:.2f}  romio321 {c['romio321']:.2f}  -> {c['faster']} "
                f"({c['factor']:.2f}x)"
            )
    if summary["goals"]:
        lines.append("")
        lines.append("Goals:")
        for g in summary["goals"]:
            mark = "met" if g["met"] else "NOT met"
            lines.append(f"  {g['goal']:44} {g['value']:.2f} (target {g['target']}) {mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64M,512M,2G", help="float64 state per rank")
    p.add_argument("--reps", type=int, default=3, help="repetitions (median over them)")
    p.add_argument("--json", type=Path, default=HERE / "results" / "latest.json")
    p.add_argument("--dir", type=Path, default=None, help="scratch directory (deleted after)")
    p.add_argument("--nranks", type=int, default=2)
    p.add_argument("--io", default="ompio,romio321", help="MPI-IO components to compare")
    p.add_argument("--methods", default=",".join(ALL_METHODS))
    p.add_argument("--no-torch", action="store_true", help="do not install PyTorch if missing")
    p.add_argument(
        "--no-drop-caches", action="store_true", help="never drop the page cache (reads warm)"
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per mpirun")
    p.add_argument("--summarize", type=Path, help="re-summarize the runs of an earlier JSON")
    args = p.parse_args(argv)
    if args.summarize:
        doc = json.loads(args.summarize.read_text())
        doc["summary"] = summarize(doc["runs"], doc["nranks"])
        print(format_table(doc["summary"]))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"\nwrote {args.json}")
        return 0

    sizes = [_util.parse_size(s) for s in args.sizes.split(",")]
    if any(s % 8 or s <= 0 for s in sizes):
        sys.exit("--sizes: every size must be a positive multiple of 8 bytes")
    labels = [x.strip() for x in args.io.split(",") if x.strip()]
    for lab in labels:
        if lab not in IO_COMPONENTS:
            sys.exit(f"--io: unknown component {lab!r} (choose from {', '.join(IO_COMPONENTS)})")
    methods = [m for m in args.methods.split(",") if m]
    torch_problem = None
    if "torch_dcp" in methods:
        torch_problem = ensure_torch(not args.no_torch)
        if torch_problem:
            print(f"torch_dcp: not available ({torch_problem})")

    scratch = args.dir or Path(tempfile.gettempdir()) / "hpcckpt-bench"
    scratch = scratch.absolute()
    check_space(scratch, sizes, args.nranks)
    info = machine_info(scratch)
    drop_note = None
    if args.no_drop_caches:
        drop_note = "page cache not dropped (--no-drop-caches): reads are warm"
    elif _util.drop_caches() is not None:
        drop_note = "cannot drop the page cache here (not root?): reads may be warm"
    if drop_note:
        print(drop_note)

    runs = []
    t0 = time.time()
    try:
        for rep in range(args.reps):
            order = labels if rep % 2 == 0 else labels[::-1]
            for label in order:
                use = methods if label == "ompio" else [m for m in methods if m in H5PY_METHODS]
                if "torch_dcp" in use and torch_problem:
                    use = [m for m in use if m != "torch_dcp"]
                out = scratch / f"rep{rep}-{label}.json"
                cmd = mpirun_argv(
                    args.nranks,
                    HERE / "bench_io.py",
                    [
                        "--sizes",
                        ",".join(str(s) for s in sizes),
                        "--methods",
                        ",".join(use),
                        "--dir",
                        str(scratch / "data"),
                        "--rotate",
                        str(rep),
                        "--label",
                        label,
                        "--out",
                        str(out),
                        *(["--no-drop-caches"] if args.no_drop_caches else []),
                    ],
                )
                print(f"== repetition {rep + 1}/{args.reps}, io {label}", flush=True)
                proc = subprocess.run(
                    cmd, env=mpi_env(IO_COMPONENTS[label]), timeout=args.timeout, check=False
                )
                if proc.returncode != 0 or not out.exists():
                    print(f"mpirun failed (exit {proc.returncode}) for rep {rep}, io {label}")
                    return 1
                doc = json.loads(out.read_text())
                doc.update(rep=rep, label=label)
                if torch_problem and "torch_dcp" in methods and label == "ompio":
                    for size in sizes:
                        doc["records"].append(
                            {
                                "bytes_per_rank": size,
                                "method": "torch_dcp",
                                "seconds": None,
                                "unavailable": torch_problem,
                            }
                        )
                runs.append(doc)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    summary = summarize(runs, args.nranks)
    print()
    print(format_table(summary))
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv] if argv is None else ["run.py", *argv],
        "sizes": sizes,
        "reps": args.reps,
        "nranks": args.nranks,
        "wall_seconds": round(time.time() - t0, 1),
        "machine": info,
        "cache": drop_note or "page cache dropped (sync; echo 3 > /proc/sys/vm/drop_caches)",
        "torch": torch_problem or "available",
        "summary": summary,
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
