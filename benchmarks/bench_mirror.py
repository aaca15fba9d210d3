"""The mirror (second tier) on a real S3 server: throughput against boto3's plain
``upload_file`` of the same files, the ranks' blocked time with and without a mirror,
and the slowdown of the application's compute while the mirror copies.

    .venv/bin/python benchmarks/bench_mirror.py [--size 128M] [--files 2] [--reps 3]
        [--json FILE] [--dir SCRATCH] [--mirror-dir DIR] [--skip throughput,slowdown,blocked]
        [--etag-hash MD5|""]
        [--with-parts --parts 8M,16M,32M,64M --concurrency 1,2,4,8 --parts-reps 3]

One process, no MPI (the mirror is one background thread of rank 0; the blocked time is
that of one rank's ``save()``). About 6 minutes at the defaults on 2 busy cores
(``--size 64M`` about halves it).

The S3 server is ``rclone serve s3`` over a folder of ``--dir`` (the same server the
tests start, tests/s3_server.py), on this machine: every byte goes over loopback and
the server's CPU competes with the client's. That server hashes the whole object for its
ETag on every request, even a range read (``--etag-hash``, MD5 by default, as in the
tests), which a real S3 store does not (it keeps the ETag): ``--etag-hash ""`` turns it
off (through ``RCLONE_ETAG_HASH``) to measure without that artifact. Checkpoint files
are real checkpoints written by ``CheckpointStore`` (``--files`` of ``--size`` random
float64 each).

Measurements, in an order shuffled per repetition (seeded); medians over ``--reps``,
ratios per repetition then the median:

- ``boto3``: ``client.upload_file`` of each file with boto3's defaults (8 MiB parts,
  10 threads): the peer;
- ``put_file``: the S3 backend's upload alone (its part size and concurrency, every
  byte spent through the throttle, uncapped here);
- ``mirror``: ``mirror.upload``, the whole verified copy a job makes: the file checked
  against its own checksums, its xxh3 taken, sent, read back from the store and
  compared, then its manifest written;
- ``mirror_nosource``: the same without the check of the source file
  (``verify_source=False``), to split where the time goes;
- ``copy``: ``shutil.copyfile`` of each file into ``--mirror-dir``, then ``fsync``: the
  peer of a directory mirror;
- ``dir_mirror``: ``mirror.upload`` to a directory backend on ``--mirror-dir`` (the same
  verified copy: checked, written to a temporary name, fsynced, renamed, read back).

``throughput = bytes / seconds``; the goals are ``mirror / boto3 >= 0.9`` and
``dir_mirror / copy >= 0.9``.

``parts`` (only with ``--with-parts``): ``put_file`` at each part size x concurrency
(one file, ``--parts-reps``), against ``boto3`` in the same repetition: how the
backend's defaults were chosen.

``slowdown``: a fixed compute kernel (a Jacobi stencil over two arrays, about 1 s alone)
run alone, and run while a background thread mirrors the files (as rank 0's mirror
worker does, in the same process), uncapped and capped at ``--cap``; the pairs are
adjacent, order alternating: slowdown = with / alone - 1.

``blocked``: ``Checkpointer.save`` (one process) of ``--size`` per save, ``--saves``
saves ``--gap`` seconds apart (a sleep stands for the application's compute), without a
mirror and with the S3 mirror (every save mirrored in the background, so later saves
run while the worker still copies): the seconds save() blocked, median per run; and the
seconds ``finish()`` then waited for the newest checkpoint to reach the mirror.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import _util  # noqa: E402

MiB = _util.MiB
NOTES = [
    "S3 server: rclone serve s3 over a local folder, on this machine (loopback); its CPU "
    "competes with the client's on 2 cores shared by other work: figures are noisy",
    "throughput = file bytes / wall seconds of the whole call; ratio per repetition, then "
    "the median",
    "rclone serve s3 hashes the whole object per request for its ETag unless --etag-hash "
    "is empty (a real S3 store keeps the ETag): see args.etag_hash",
]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from tests.s3_server import S3Server

        self.args = args
        self.root = Path(args.dir).resolve() / f"bench-mirror-{os.getpid()}"
        self.root.mkdir(parents=True)
        os.environ["RCLONE_ETAG_HASH"] = args.etag_hash  # rclone reads its flags from here
        self.mirror_dir = (
            Path(args.mirror_dir).resolve() / f"bench-mirror-{os.getpid()}"
            if args.mirror_dir
            else self.root / "mirror-dir"
        )
        self.mirror_dir.mkdir(parents=True)
        self.server = S3Server(self.root / "s3")
        self.server.start()
        os.environ.update(self.server.env())
        self.bucket = "bench"
        self.server.bucket(self.bucket)
        import boto3

        self.client = boto3.client("s3")
        self.files = self._checkpoints()
        self.total = sum(p.stat().st_size for p in self.files)
        self.samples: dict[str, list[float]] = {}

    def close(self) -> None:
        self.server.stop()
        shutil.rmtree(self.mirror_dir, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def _checkpoints(self) -> list[Path]:
        import numpy as np
        from mpi4py import MPI

        from hpcckpt.store.store import CheckpointStore

        store = CheckpointStore(self.root / "ckpt", MPI.COMM_SELF, incremental=False)
        rng = np.random.default_rng(1)
        n = _util.parse_size(self.args.size) // 8
        for k in range(self.args.files):
            store.save(k + 1, {"u": rng.random(n)})
        return sorted(store.directory.glob("ckpt-*.h5"))

    def clear(self) -> None:
        """Delete every object of the bucket (each measurement starts from an empty one)."""
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket):
            for obj in page.get("Contents", ()):
                self.client.delete_object(Bucket=self.bucket, Key=obj["Key"])

    def record(self, name: str, seconds: float) -> None:
        self.samples.setdefault(name, []).append(seconds)

    # -- throughput ---------------------------------------------------------------------
    def run_method(self, method: str, prefix: str) -> float:
        from hpcckpt.store.mirror import copy as mirror
        from hpcckpt.store.mirror.backend import DirectoryBackend
        from hpcckpt.store.mirror.s3 import S3Backend

        self.clear()
        for old in self.mirror_dir.iterdir():
            shutil.rmtree(old)
        backend = S3Backend(f"s3://{self.bucket}/{prefix}")
        target = self.mirror_dir / prefix
        target.mkdir()
        t0 = time.perf_counter()
        for path in self.files:
            if method == "copy":
                shutil.copyfile(path, target / path.name)
                _util.fsync_path(target / path.name)
            elif method == "dir_mirror":
                mirror.upload(DirectoryBackend(target), path)
            elif method == "boto3":
                self.client.upload_file(str(path), self.bucket, f"{prefix}/{path.name}")
            elif method == "put_file":
                backend.put_file(path, path.name)
            elif method == "mirror":
                mirror.upload(backend, path)
            elif method == "mirror_nosource":
                mirror.upload(backend, path, verify_source=False)
            else:
                raise ValueError(method)
        return time.perf_counter() - t0

    def throughput(self) -> dict[str, Any]:
        methods = ["boto3", "put_file", "mirror", "mirror_nosource", "copy", "dir_mirror"]
        rng = random.Random(7)
        per_rep: list[dict[str, float]] = []
        for rep in range(self.args.reps):
            order = methods[:]
            rng.shuffle(order)
            times = {m: self.run_method(m, f"tp{rep}") for m in order}
            per_rep.append(times)
            print(
                f"  rep {rep + 1}: "
                + "  ".join(f"{m} {self.total / times[m] / 1e6:.0f} MB/s" for m in methods),
                flush=True,
            )
        out: dict[str, Any] = {"bytes": self.total, "samples": per_rep, "methods": {}}
        for m in methods:
            peer = "copy" if m in ("copy", "dir_mirror") else "boto3"
            secs = [r[m] for r in per_rep]
            ratios = [r[peer] / r[m] for r in per_rep]
            out["methods"][m] = {
                "peer": peer,
                "median_s": median(secs),
                "median_MBps": self.total / median(secs) / 1e6,
                "min_s": min(secs),
                "max_s": max(secs),
                "ratio_to_peer": median(ratios),
                "ratios": ratios,
            }
        return out

    # -- part size and concurrency ----------------------------------------------------
    def parts(self) -> dict[str, Any]:
        from hpcckpt.store.mirror.s3 import S3Backend

        path = self.files[0]
        size = path.stat().st_size
        rng = random.Random(11)
        configs = [
            (_util.parse_size(p), int(c))
            for p in self.args.parts.split(",")
            for c in self.args.concurrency.split(",")
        ]
        rows: dict[str, dict[str, list[float]]] = {}
        for _rep in range(self.args.parts_reps):
            order = configs[:]
            rng.shuffle(order)
            for part, conc in order:
                base = self._timed_plain(path)
                self.clear()
                backend = S3Backend(f"s3://{self.bucket}/parts", part_size=part, concurrency=conc)
                t0 = time.perf_counter()
                backend.put_file(path, path.name)
                secs = time.perf_counter() - t0
                row = rows.setdefault(f"{part // MiB}M x{conc}", {"s": [], "ratio": []})
                row["s"].append(secs)
                row["ratio"].append(base / secs)
        out = {}
        for key, row in rows.items():
            out[key] = {
                "median_MBps": size / median(row["s"]) / 1e6,
                "ratio_to_boto3": median(row["ratio"]),
                "samples_s": row["s"],
            }
            print(
                f"  {key:>8}: {out[key]['median_MBps']:.0f} MB/s, "
                f"{out[key]['ratio_to_boto3']:.2f} x boto3",
                flush=True,
            )
        return {"file_bytes": size, "configs": out}

    def _timed_plain(self, path: Path) -> float:
        self.clear()
        t0 = time.perf_counter()
        self.client.upload_file(str(path), self.bucket, f"plain/{path.name}")
        return time.perf_counter() - t0

    # -- slowdown ---------------------------------------------------------------------
    def slowdown(self) -> dict[str, Any]:
        import numpy as np

        from hpcckpt.store.mirror.backend import Throttle, parse_bandwidth
        from hpcckpt.store.mirror.s3 import S3Backend

        a = np.random.default_rng(0).random((1024, 2048))
        b = np.empty_like(a)

        def kernel(sweeps: int) -> float:
            t0 = time.perf_counter()
            for _ in range(sweeps):
                b[1:-1, 1:-1] = 0.25 * (a[:-2, 1:-1] + a[2:, 1:-1] + a[1:-1, :-2] + a[1:-1, 2:])
                a[1:-1, 1:-1] = b[1:-1, 1:-1]
            return time.perf_counter() - t0

        sweeps = 1
        while kernel(sweeps) < 1.0:
            sweeps *= 2
        cases = {"uncapped": None, f"cap {self.args.cap}": parse_bandwidth(self.args.cap)}
        out: dict[str, Any] = {"kernel_sweeps": sweeps, "cases": {}}
        for label, cap in cases.items():
            alone: list[float] = []
            during: list[float] = []
            copy_s: list[float] = []
            ended_early = 0
            for rep in range(self.args.reps):
                self.clear()
                backend = S3Backend(f"s3://{self.bucket}/slow{rep}", Throttle(cap))
                if rep % 2 == 0:
                    alone.append(kernel(sweeps))
                    secs, spent, copying = self._kernel_during_copy(backend, kernel, sweeps)
                else:
                    secs, spent, copying = self._kernel_during_copy(backend, kernel, sweeps)
                    alone.append(kernel(sweeps))
                during.append(secs)
                copy_s.append(spent)
                ended_early += not copying
            slow = [d / a_ - 1 for d, a_ in zip(during, alone, strict=True)]
            out["cases"][label] = {
                "alone_s": alone,
                "during_s": during,
                "copy_s": copy_s,
                "median_slowdown": median(slow),
                "slowdowns": slow,
                "median_copy_MBps": self.total / median(copy_s) / 1e6,
                "copy_ended_before_kernel": ended_early,
            }
            print(
                f"  {label}: kernel alone {median(alone):.2f} s, during the copy "
                f"{median(during):.2f} s (slowdown {100 * median(slow):+.0f} %), copy "
                f"{self.total / median(copy_s) / 1e6:.0f} MB/s",
                flush=True,
            )
        return out

    def _kernel_during_copy(
        self, backend: Any, kernel: Any, sweeps: int
    ) -> tuple[float, float, bool]:
        """The kernel's seconds while a thread mirrors every file (as rank 0's worker does),
        the copy's seconds, and whether the copy still ran when the kernel ended."""
        from hpcckpt.store.mirror import copy as mirror

        spent: list[float] = []

        def copy() -> None:
            t0 = time.perf_counter()
            for path in self.files:
                mirror.upload(backend, path)
            spent.append(time.perf_counter() - t0)

        worker = threading.Thread(target=copy)
        worker.start()
        secs = kernel(sweeps)
        copying = worker.is_alive()
        worker.join()
        if not spent:
            raise RuntimeError("the background copy failed (see its traceback above)")
        return secs, spent[0], copying

    # -- blocked time -----------------------------------------------------------------
    def blocked(self) -> dict[str, Any]:
        import numpy as np

        from hpcckpt.coord.checkpointer import Checkpointer

        n = _util.parse_size(self.args.size) // 8
        state = {"u": np.random.default_rng(3).random(n)}
        saves = self.args.saves
        runs: dict[str, list[float]] = {"none": [], "s3": []}
        drained: list[float] = []
        for rep in range(self.args.reps):
            for kind in ["none", "s3"] if rep % 2 == 0 else ["s3", "none"]:
                self.clear()
                directory = self.root / f"blocked-{kind}-{rep}"
                extra = {"mirror": f"s3://{self.bucket}/blocked{rep}"} if kind == "s3" else {}
                ck = Checkpointer(directory, incremental=False, validate=None, keep_last=2, **extra)
                times = []
                for step in range(1, saves + 1):
                    state["u"][:1000] += 1.0
                    t0 = time.perf_counter()
                    ck.save(step, state)
                    times.append(time.perf_counter() - t0)
                    time.sleep(self.args.gap)  # the application computes
                t0 = time.perf_counter()
                ck.finish()
                if kind == "s3":
                    drained.append(time.perf_counter() - t0)
                runs[kind].append(median(times))
                shutil.rmtree(directory, ignore_errors=True)
        ratio = [s / n_ for s, n_ in zip(runs["s3"], runs["none"], strict=True)]
        out = {
            "saves_per_run": saves,
            "gap_s": self.args.gap,
            "median_blocked_s": {k: median(v) for k, v in runs.items()},
            "runs": runs,
            "ratio_s3_to_none": median(ratio),
            "finish_wait_s": drained,
        }
        print(
            f"  save() blocked: no mirror {median(runs['none']):.3f} s, S3 mirror "
            f"{median(runs['s3']):.3f} s (ratio {median(ratio):.2f})",
            flush=True,
        )
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="128M", help="bytes of float64 per checkpoint file")
    ap.add_argument("--files", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", default="8M,16M,32M,64M")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--parts-reps", type=int, default=3)
    ap.add_argument("--cap", default="25M", help="the bandwidth cap of the slowdown case")
    ap.add_argument("--saves", type=int, default=4, help="saves per blocked-time run")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between saves")
    ap.add_argument("--skip", default="", help="comma list of: throughput,slowdown,blocked")
    ap.add_argument("--with-parts", action="store_true", help="also the part-size matrix")
    ap.add_argument("--dir", default="/tmp", help="where the checkpoints and the S3 data go")
    ap.add_argument("--mirror-dir", default=None, help="the directory mirror (default: in --dir)")
    ap.add_argument(
        "--etag-hash",
        default="MD5",
        help='the S3 server\'s ETag hash, computed per request ("": none, as a real store)',
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if not args.with_parts:
        skip.add("parts")
    started = dt.datetime.now(dt.timezone.utc)
    bench = Bench(args)
    result: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count()},
        "args": vars(args),
        "notes": NOTES,
    }
    try:
        print(f"{len(bench.files)} checkpoint files, {bench.total / 1e6:.0f} MB in all", flush=True)
        for part in ("throughput", "parts", "slowdown", "blocked"):
            if part in skip:
                continue
            print(f"{part}:", flush=True)
            result[part] = getattr(bench, part)()
    finally:
        bench.close()
    result["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    if "throughput" in result:
        print(f"\nthroughput (median of {args.reps}):")
        for m, row in result["throughput"]["methods"].items():
            print(
                f"  {m:16} {row['median_MBps']:7.0f} MB/s   "
                f"{row['ratio_to_peer']:.2f} x {row['peer']}"
            )
    out = (
        Path(args.json)
        if args.json
        else (HERE / "results" / f"mirror-{started.strftime('%Y%m%dT%H%MZ')}.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
