"""I/O-path experiments for hpcckpt's writer: which h5py/MPI-IO settings get nearest the limit.

    .venv/bin/python benchmarks/experiments/run_experiments.py [--sizes 512M] [--reps 3]
        [--variants 'hpcckpt (base)|align 1M'] [--json out.json]

Runs ``writer_matrix.py`` under ``mpirun -n 2`` once per repetition and MPI-IO
component (default ompio, then ``OMPI_MCA_io=romio321``; the order alternates), and
prints, per size, each variant's median ratio to the raw limit of the same
invocation (limit time / variant time; 1.00 = at the limit) and to hpcckpt's
current writer ("base"). Absolute GB/s are shown but not comparable across runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import _util  # noqa: E402
import run as bench_run  # noqa: E402

BASE = "hpcckpt (base)"


def summarize(runs: list[dict], nranks: int) -> list[dict]:
    cells: dict[tuple[int, str, str], list[tuple[float, float | None]]] = {}
    errors: dict[tuple[int, str, str], str] = {}
    for run in runs:
        t = {(r["bytes_per_rank"], r["variant"]): r["seconds"] for r in run["records"]}
        for r in run["records"]:
            if r.get("error"):
                errors[(r["bytes_per_rank"], run["label"], r["variant"])] = r["error"]
        for (size, name), secs in t.items():
            lim = t.get((size, "limit"))
            base = t.get((size, BASE))
            if secs is None or lim is None:
                continue
            cells.setdefault((size, run["label"], name), []).append(
                (lim / secs, base / secs if base else None)
            )
    rows = []
    for (size, label, name), vals in cells.items():
        secs = [
            r["seconds"]
            for run in runs
            if run["label"] == label
            for r in run["records"]
            if (r["bytes_per_rank"], r["variant"]) == (size, name) and r["seconds"] is not None
        ]
        lim = [v[0] for v in vals]
        vb = [v[1] for v in vals if v[1] is not None]
        med = _util.median(secs)
        rows.append(
            {
                "bytes_per_rank": size,
                "io": label,
                "variant": name,
                "reps": len(vals),
                "seconds_median": med,
                "gbps_median": size * nranks / med / 1e9,
                "ratio_to_limit": {"median": _util.median(lim), "min": min(lim), "max": max(lim)},
                "ratio_to_base": _util.median(vb) if vb else None,
            }
        )
    for (size, label, name), err in errors.items():
        if (size, label, name) not in cells:
            rows.append(
                {"bytes_per_rank": size, "io": label, "variant": name, "reps": 0, "error": err}
            )
    rows.sort(key=lambda r: (r["bytes_per_rank"], -r.get("ratio_to_limit", {}).get("median", 0)))
    return rows


def format_rows(rows: list[dict]) -> str:
    head = (
        f"{'size':>5} {'io':8} {'variant':24} {'med s':>7} {'GB/s*':>6} {'x limit (min-max)':>19}"
    )
    head += f" {'x base':>7}"
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and r["bytes_per_rank"] != last:
            lines.append("")
        last = r["bytes_per_rank"]
        if r.get("error"):
            lines.append(
                f"{_util.size_label(r['bytes_per_rank']):>5} {r['io']:8} {r['variant']:24} "
                f"failed: {r['error'][:80]}"
            )
            continue
        rl = r["ratio_to_limit"]
        rb = f"{r['ratio_to_base']:.2f}" if r["ratio_to_base"] else ""
        lines.append(
            f"{_util.size_label(r['bytes_per_rank']):>5} {r['io']:8} {r['variant']:24} "
            f"{r['seconds_median']:7.3f} {r['gbps_median']:6.2f} "
            f"{rl['median']:.2f} ({rl['min']:.2f}-{rl['max']:.2f}) {rb:>7}"
        )
    lines.append(
        "x limit: raw-limit time / variant time in the same invocation, median over repetitions;"
        " x base: hpcckpt's current writer (same io component) time / variant time."
    )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="512M")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default="", help="'|'-separated variant names; default: all")
    p.add_argument("--io", default="ompio,romio321")
    p.add_argument("--nranks", type=int, default=2)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "hpcckpt-exp")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--raw-variants", action="store_true", help="also the limit with 1 GiB writes")
    p.add_argument("--json", type=Path, default=HERE / "results" / "latest.json")
    args = p.parse_args()
    sizes = [_util.parse_size(s) for s in args.sizes.split(",")]
    bench_run.check_space(args.dir, sizes, args.nranks)
    labels = [x for x in args.io.split(",") if x]
    runs = []
    try:
        for rep in range(args.reps):
            for label in labels if rep % 2 == 0 else labels[::-1]:
                out = args.dir / f"rep{rep}-{label}.json"
                cmd = bench_run.mpirun_argv(
                    args.nranks,
                    HERE / "writer_matrix.py",
                    [
                        "--sizes",
                        ",".join(map(str, sizes)),
                        "--variants",
                        args.variants,
                        "--dir",
                        str(args.dir / "data"),
                        "--rotate",
                        str(rep),
                        "--label",
                        label,
                        "--out",
                        str(out),
                        *(["--no-drop-caches"] if args.no_drop_caches else []),
                        *(["--raw-variants"] if args.raw_variants else []),
                    ],
                )
                print(f"== repetition {rep + 1}/{args.reps}, io {label}", flush=True)
                env = bench_run.mpi_env(bench_run.IO_COMPONENTS[label])
                proc = subprocess.run(cmd, env=env, check=False)
                if proc.returncode or not out.exists():
                    print(f"mpirun failed (exit {proc.returncode})")
                    return 1
                doc = json.loads(out.read_text())
                doc.update(rep=rep, label=label)
                runs.append(doc)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    rows = summarize(runs, args.nranks)
    print()
    print(format_rows(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"sizes": sizes, "reps": args.reps, "rows": rows}, indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
