"""What one HDF5 file costs against one ``.npy`` file, for a small state (one process).

The goal "a save and a restore of 0.25 MiB per rank within 2x of a file per rank"
asks a checkpoint in one HDF5 file to cost about what ``np.save`` + fsync (or
``np.load``) of a rank's own bytes costs. This measures the floor under that ratio in
one run, interleaved, median of ``--reps``: the cheapest HDF5 file that holds those
bytes durably (create, one dataset, write, flush, fsync, close) and the cheapest read
of it (open, read the dataset, close), against ``np.save`` + fsync and ``np.load``.
Whatever a save adds (checksums, the state tree, agreeing, an atomic rename) comes on
top of the first; whatever a restore adds (validation, checksums) on top of the second.

    .venv/bin/python benchmarks/bench_hdf5_floor.py --kib 256 --reps 200
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import h5py
import numpy as np


def npy_save(path: Path, data: np.ndarray) -> None:
    with open(path, "wb") as f:
        np.save(f, data)
        f.flush()
        os.fsync(f.fileno())


def npy_load(path: Path) -> np.ndarray:
    return np.load(path)


def h5_save(path: Path, data: np.ndarray) -> None:
    with h5py.File(path, "w") as f:
        f.create_dataset("u", data=data)
        f.flush()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # HDF5 does not fsync; a checkpoint must be durable
        finally:
            os.close(fd)


def h5_load(path: Path) -> np.ndarray:
    with h5py.File(path, "r") as f:
        return f["u"][()]


METHODS = {"npy_save": npy_save, "h5_save": h5_save}
READS = {"npy_load": npy_load, "h5_load": h5_load}


def measure(directory: Path, nbytes: int, reps: int) -> dict[str, list[float]]:
    """Seconds per repetition of each method, in a rotated order."""
    data = np.random.default_rng(0).random(nbytes // 8)
    times: dict[str, list[float]] = {m: [] for m in [*METHODS, *READS]}
    paths = {"npy_save": directory / "x.npy", "h5_save": directory / "x.h5"}
    names = list(METHODS)
    for rep in range(reps):
        order = names[rep % 2 :] + names[: rep % 2]
        for name in order:
            t0 = time.perf_counter()
            METHODS[name](paths[name], data)
            times[name].append(time.perf_counter() - t0)
        for name, path in (("npy_load", paths["npy_save"]), ("h5_load", paths["h5_save"])):
            t0 = time.perf_counter()
            out = READS[name](path)
            times[name].append(time.perf_counter() - t0)
            assert out.nbytes == nbytes
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kib", type=int, default=256, help="bytes per file, KiB")
    ap.add_argument("--reps", type=int, default=200, help="repetitions (median over them)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/hpcckpt-bench-hdf5-floor"))
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        times = measure(args.dir, args.kib << 10, args.reps)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"{args.kib} KiB, one process, median of {args.reps} (ms)")
    print("| | HDF5 file | .npy file | HDF5 / .npy |")
    print("|---|---:|---:|---:|")
    for what, h, n in (("durable write", "h5_save", "npy_save"), ("read", "h5_load", "npy_load")):
        print(f"| {what} | {med[h] * 1e3:.2f} | {med[n] * 1e3:.2f} | {med[h] / med[n]:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"kib": args.kib, "reps": args.reps, "times": times}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
