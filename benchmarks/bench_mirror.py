"""The mirror (second tier) on a real S3 server and a directory: throughput against
the plain tools (boto3's ``upload_file``, ``shutil.copyfile`` + fsync) of the same
files, a ``save()`` while the mirror copies against one with no mirror, the slowdown of
the application's compute, and what compression gives on real checkpoints.

    .venv/bin/python benchmarks/bench_mirror.py [--size 128M,1G] [--files 2] [--reps 3]
        [--json FILE] [--dir SCRATCH] [--mirror-dir DIR]
        [--skip throughput,slowdown,blocked,compression,index] [--etag-hash MD5|""]
        [--methods boto3,mirror,copy,dir_mirror,...] [--blocked-mirrors s3,dir]
        [--index-sizes 10,1000]
        [--with-parts --parts 8M,16M,32M,64M --concurrency 1,2,4,8 --parts-reps 3]

The three goals of the verified copy, at 2 x 128 MiB and at 2 x 1 GiB, in one run (the
summary at the end, ``goals`` in the JSON)::

    .venv/bin/python benchmarks/bench_mirror.py --size 128M,1G --reps 3 --etag-hash "" \
        --skip slowdown,compression,index --methods boto3,mirror,copy,dir_mirror

One process, no MPI (the mirror is one background thread of rank 0; the blocked time is
that of one rank's ``save()``). Each ``--size`` (comma list) is a run of its own:
``--files`` checkpoint files of that many bytes of random float64 each, written by
``CheckpointStore``. At the defaults (2 x 128 MiB, then 2 x 1 GiB) it needs about 7 GB
of ``--dir`` and takes 20-40 minutes on 2 cores.

The S3 server is ``rclone serve s3`` over a folder of ``--dir`` (the same server the
tests start, tests/s3_server.py), on this machine: every byte goes over loopback and
the server's CPU competes with the client's. That server hashes the whole object for its
ETag on every request, even a range read (``--etag-hash``, MD5 by default, as in the
tests), which a real S3 store does not (it keeps the ETag): ``--etag-hash ""`` turns it
off (through ``RCLONE_ETAG_HASH``) to measure without that artifact. ``--s3-dir`` puts
the server's objects elsewhere than ``--dir`` (``/dev/shm``: its writes then do not
share the checkpoints' disk, as a real store's, on another machine, do not).

Measurements, in an order shuffled per repetition (seeded); medians over ``--reps``,
ratios per repetition then the median:

- ``boto3``: ``client.upload_file`` of each file with boto3's defaults (8 MiB parts,
  10 threads, its CRC32 when it sends one): the peer;
- ``put_file``: the S3 backend's plain upload alone (its part size and concurrency);
- ``mirror``: ``mirror.upload``, the whole verified copy a job makes: the file read
  once (checked block by block against its own hashes, its xxh3 taken, sent in parts
  whose MD5 is compared with the ETag the server answers, the MD5 of what it received:
  the probe's choice for rclone, which checks a Content-MD5 too but then hashes each
  part twice), then its manifest;
- ``mirror_readback``: the same with ``verify="readback"`` (every byte read back from
  the store and compared: what stores that check no checksum get);
- ``mirror_nosource``: ``mirror`` without the check of the source file;
- ``copy``: ``shutil.copyfile`` of each file into ``--mirror-dir``, then ``fsync``: the
  peer of a directory mirror;
- ``dir_mirror``: ``mirror.upload`` to a directory backend on ``--mirror-dir``: the
  kernel copies (``sendfile``, as ``copyfile``; write-back started range by range), a
  thread reads the destination behind it from the page cache and checks it (array blocks
  against the checkpoint's hashes, other bytes against the source's, its xxh3 taken);
  then fsynced, renamed, its manifest written;
- ``dir_mirror_stream`` (only when named in ``--methods``): the same through the metered
  stream a bandwidth cap or compression takes (read once, checked, hashed, written from
  the same buffers), uncapped.

``throughput = bytes / seconds``; the goals are ``mirror / boto3 >= 0.9`` and
``dir_mirror / copy >= 0.9``. Copies are uncompressed here (``compress=None``).

``parts`` (only with ``--with-parts``): ``put_file`` at each part size x concurrency.

``slowdown``: a fixed compute kernel (a Jacobi stencil, about 1 s alone) run alone, and
while a background thread mirrors the files (as rank 0's mirror worker does, at its
lowered priority), uncapped and capped at ``--cap``: slowdown = with / alone - 1.

``blocked``: ``Checkpointer.save`` (one process) of ``--size`` per save, ``--saves``
saves ``--gap`` seconds apart, without a mirror and with each of ``--blocked-mirrors``
(``s3``, ``dir``: every save mirrored in the background, so later saves run while the
worker still copies): the seconds save() blocked, median per run, and their ratio to
no mirror (goal: at most 1.1). The copy steps aside while a save writes (it waits at
the mirror worker's gate between its chunks and S3 parts): ``mirror_paused_s`` is the seconds each
run's copies waited so (the ``mirrored`` events' ``paused``), ``mirror_rate_MBps`` the
median of the copies' own rates, pauses left out.

``compression``: the ratio (stored / original bytes) and one core's throughput of zstd
alone and of the mirror's encoder (zstd over byte-grouped floats, levels 1 and 3) on a
real checkpoint of a trained model (bf16 weights, fp32 AdamW moments: ``--train-*``)
and of examples/heat2d.py's float64 field (``--heat-*``).

``index``: the requests of one copy and its retention (which deletes one checkpoint)
onto a mirror already holding each of ``--index-sizes`` checkpoints (fabricated
objects, the mirror's index built once before): S3 requests counted with boto3's event
system (``before-send``), the directory mirror's backend calls by method; the same
counts for every size are the goal.
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
#: The throughput's methods (module docstring), in their report order.
METHODS = [
    "boto3",
    "put_file",
    "mirror",
    "mirror_readback",
    "mirror_nosource",
    "copy",
    "dir_mirror",
    "dir_mirror_stream",
]
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
        self.store_dir = (
            Path(args.s3_dir).resolve() / f"bench-mirror-{os.getpid()}"
            if getattr(args, "s3_dir", None)
            else self.root / "s3"
        )
        self.server = S3Server(self.store_dir)
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
        shutil.rmtree(self.store_dir, ignore_errors=True)
        if self.store_dir.parent != self.root:
            self.server.log.unlink(missing_ok=True)
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

        class Streaming(DirectoryBackend):
            kernel_copy = False  # the metered stream, as with a cap or compression

        self.clear()
        for old in self.mirror_dir.iterdir():
            shutil.rmtree(old)
        backend = S3Backend(f"s3://{self.bucket}/{prefix}", compress=None)
        readback = S3Backend(f"s3://{self.bucket}/{prefix}", verify="readback", compress=None)
        target = self.mirror_dir / prefix
        target.mkdir()
        t0 = time.perf_counter()
        for path in self.files:
            if method == "copy":
                shutil.copyfile(path, target / path.name)
                _util.fsync_path(target / path.name)
            elif method == "dir_mirror":
                mirror.upload(DirectoryBackend(target, compress=None), path)
            elif method == "dir_mirror_stream":
                mirror.upload(Streaming(target, compress=None), path)
            elif method == "boto3":
                self.client.upload_file(str(path), self.bucket, f"{prefix}/{path.name}")
            elif method == "put_file":
                backend.put_file(path, path.name)
            elif method == "mirror":
                mirror.upload(backend, path)
            elif method == "mirror_nosource":
                mirror.upload(backend, path, verify_source=False)
            elif method == "mirror_readback":
                mirror.upload(readback, path)
            else:
                raise ValueError(method)
        return time.perf_counter() - t0

    def throughput(self) -> dict[str, Any]:
        methods = [m for m in self.args.methods.split(",") if m]
        unknown = set(methods) - set(METHODS)
        if unknown:
            raise SystemExit(f"--methods: unknown {sorted(unknown)}; known: {METHODS}")
        rng = random.Random(7)
        per_rep: list[dict[str, float | None]] = []
        errors: list[str] = []
        for rep in range(self.args.reps):
            order = methods[:]
            rng.shuffle(order)
            times: dict[str, float | None] = {}
            for m in order:
                try:
                    times[m] = self.run_method(m, f"tp{rep}")
                except Exception as exc:  # noqa: BLE001 (one failed call: noted, the run goes on)
                    times[m] = None
                    errors.append(f"rep {rep + 1} {m}: {type(exc).__name__}: {exc}")
                    print(f"  rep {rep + 1}: {m} failed: {exc}", flush=True)
            per_rep.append(times)
            print(
                f"  rep {rep + 1}: "
                + "  ".join(
                    f"{m} " + ("failed" if t is None else f"{self.total / t / 1e6:.0f} MB/s")
                    for m in methods
                    for t in [times[m]]
                ),
                flush=True,
            )
        out: dict[str, Any] = {
            "bytes": self.total,
            "samples": per_rep,
            "errors": errors,
            "methods": {},
        }
        for m in methods:
            peer = "copy" if m.startswith(("copy", "dir_")) else "boto3"
            secs = [t for r in per_rep if (t := r[m]) is not None]
            ratios = [
                pt / t
                for r in per_rep
                if (t := r[m]) is not None and (pt := r.get(peer)) is not None
            ]
            out["methods"][m] = {
                "peer": peer,
                "median_s": median(secs),
                "median_MBps": self.total / median(secs) / 1e6 if secs else float("nan"),
                "min_s": min(secs, default=float("nan")),
                "max_s": max(secs, default=float("nan")),
                "ratio_to_peer": median(ratios) if ratios else None,
                "ratios": ratios,
                "failed": sum(r[m] is None for r in per_rep),
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
                backend = S3Backend(f"s3://{self.bucket}/slow{rep}", Throttle(cap), compress=None)
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
        mirrors = [m for m in self.args.blocked_mirrors.split(",") if m]
        if set(mirrors) - {"s3", "dir"}:
            raise SystemExit(f"--blocked-mirrors: give s3 and/or dir, not {mirrors}")
        kinds = ["none", *mirrors]
        from hpcckpt.rundir.events import read_events

        runs: dict[str, list[float]] = {k: [] for k in kinds}
        drained: dict[str, list[float]] = {k: [] for k in mirrors}
        # Per run: the seconds the copies waited while a save wrote, and their own rates.
        paused: dict[str, list[float]] = {k: [] for k in mirrors}
        rates: dict[str, list[float]] = {k: [] for k in mirrors}
        for rep in range(self.args.reps):
            for kind in kinds if rep % 2 == 0 else kinds[::-1]:
                self.clear()
                directory = self.root / f"blocked-{kind}-{rep}"
                extra: dict[str, Any] = {}
                if kind == "s3":
                    extra = {"mirror": f"s3://{self.bucket}/blocked{rep}", "mirror_compress": None}
                elif kind == "dir":
                    target = self.mirror_dir / f"blocked{rep}"
                    target.mkdir(parents=True, exist_ok=True)
                    extra = {"mirror": str(target), "mirror_compress": None}
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
                if kind != "none":
                    drained[kind].append(time.perf_counter() - t0)
                    copies = [e for e in read_events(directory) if e.get("event") == "mirrored"]
                    paused[kind].append(sum(float(e.get("paused") or 0.0) for e in copies))
                    rates[kind].extend(float(e["rate"]) for e in copies if e.get("rate"))
                    shutil.rmtree(self.mirror_dir / f"blocked{rep}", ignore_errors=True)
                runs[kind].append(median(times))
                shutil.rmtree(directory, ignore_errors=True)
        ratios = {k: [s / n_ for s, n_ in zip(runs[k], runs["none"], strict=True)] for k in mirrors}
        out: dict[str, Any] = {
            "saves_per_run": saves,
            "gap_s": self.args.gap,
            "median_blocked_s": {k: median(v) for k, v in runs.items()},
            "runs": runs,
            "ratios": ratios,
            "finish_wait_s": drained,
            "mirror_paused_s": paused,
            "mirror_rate_MBps": {k: median(v) / 1e6 for k, v in rates.items()},
        }
        for k in mirrors:
            out[f"ratio_{k}_to_none"] = median(ratios[k])
        print(
            f"  save() blocked: no mirror {median(runs['none']):.3f} s, "
            + ", ".join(
                f"{k} mirror {median(runs[k]):.3f} s (ratio {median(ratios[k]):.2f}; the copy "
                f"paused {median(paused[k]):.1f} s per run)"
                for k in mirrors
            ),
            flush=True,
        )
        return out


# -- compression ------------------------------------------------------------------------
def training_state(width: int, layers: int, steps: int) -> dict[str, Any]:
    """A small MLP trained ``steps`` AdamW steps on a teacher's outputs: its bf16 weights
    and the optimizer's fp32 moments, as a mixed-precision run checkpoints them."""
    import torch

    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*mods[:-1])
    teacher = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(128, width)
        with torch.no_grad():
            y = teacher(x)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    named = dict(model.named_parameters())
    return {
        "model": {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()},
        "exp_avg": {k: opt.state[p]["exp_avg"] for k, p in named.items()},
        "exp_avg_sq": {k: opt.state[p]["exp_avg_sq"] for k, p in named.items()},
    }


def heat_state(n: int, steps: int) -> dict[str, Any]:
    """examples/heat2d.py's float64 field on an n x n grid after ``steps`` steps (one rank)."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "examples"))
    from heat2d import initial_field

    up = initial_field(n, n, 0, n)
    for _ in range(steps):
        lap = np.zeros_like(up[1:-1])
        lap[:, 1:-1] = (
            up[:-2, 1:-1] + up[2:, 1:-1] + up[1:-1, :-2] + up[1:-1, 2:] - 4.0 * up[1:-1, 1:-1]
        )
        up[1:-1] += 0.2 * lap
    return {"u": up[1:-1].copy()}


def compression_figures(args: argparse.Namespace) -> dict[str, Any]:
    """Ratio (stored / original) and one-core throughput of each way to compress a real
    checkpoint file: zstd alone, and zstd over byte-grouped floats (the mirror's
    encoder) at levels 1 and 3; best of ``--reps``."""
    import io

    from mpi4py import MPI

    from hpcckpt.store.mirror import compression
    from hpcckpt.store.mirror.source import SourceCheck
    from hpcckpt.store.store import CheckpointStore

    root = Path(args.dir).resolve() / f"bench-compress-{os.getpid()}"
    states = {
        "training (bf16 weights, fp32 AdamW moments)": lambda: training_state(
            args.train_width, args.train_layers, args.train_steps
        ),
        "heat2d (float64 field)": lambda: heat_state(args.heat_n, args.heat_steps),
    }
    out: dict[str, Any] = {"level_default": compression.LEVEL, "states": {}}
    level = compression.LEVEL
    try:
        for label, make in states.items():
            store = CheckpointStore(root / str(len(out["states"])), MPI.COMM_SELF)
            store.save(1, make())
            path = sorted(store.directory.glob("ckpt-*.h5"))[0]
            data = path.read_bytes()
            pieces = [data[i : i + (16 << 20)] for i in range(0, len(data), 16 << 20)]
            width_at = SourceCheck(path).width_at
            rows: dict[str, Any] = {}
            for name, widths, lvl in (
                ("zstd-1", None, 1),
                ("zstd-1 + byte-grouping", width_at, 1),
                ("zstd-3 + byte-grouping", width_at, 3),
            ):
                compression.LEVEL = lvl
                best_c = best_d = float("inf")
                blob = b""
                for _ in range(args.reps):
                    enc = compression.Encoder(widths)
                    t0 = time.perf_counter()
                    blob = b"".join(enc.encode(pieces))
                    best_c = min(best_c, time.perf_counter() - t0)
                    back: list[bytes] = []
                    t0 = time.perf_counter()
                    compression.decode(io.BytesIO(blob), back.append)
                    best_d = min(best_d, time.perf_counter() - t0)
                    if b"".join(back) != data:
                        raise RuntimeError(f"{name} did not give the bytes back")
                rows[name] = {
                    "ratio": len(blob) / len(data),
                    "compress_MBps": len(data) / best_c / 1e6,
                    "decompress_MBps": len(data) / best_d / 1e6,
                }
                print(
                    f"  {label[:30]:30} {len(data) / 2**20:5.0f} MiB  {name:23} ratio "
                    f"{rows[name]['ratio']:.3f}  compress {rows[name]['compress_MBps']:5.0f} "
                    f"MB/s  decompress {rows[name]['decompress_MBps']:5.0f} MB/s",
                    flush=True,
                )
            out["states"][label] = {"file_bytes": len(data), "methods": rows}
    finally:
        compression.LEVEL = level
        shutil.rmtree(root, ignore_errors=True)
    return out


# -- the mirror's index: requests per copy -----------------------------------------------
def index_figures(args: argparse.Namespace) -> dict[str, Any]:
    """Requests of one copy and its retention (which deletes one checkpoint) onto a
    mirror already holding each of ``--index-sizes`` checkpoints, once its index is
    built: on the S3 server, counted by boto3's event system (one ``before-send`` per
    HTTP request), and on a directory mirror, its backend's calls by method."""
    import collections
    import json as json_
    import tempfile

    import numpy as np
    import xxhash
    from mpi4py import MPI

    from hpcckpt.store.file import layout
    from hpcckpt.store.mirror import copy as mirror
    from hpcckpt.store.mirror import index as mirror_index
    from hpcckpt.store.mirror.backend import DirectoryBackend
    from hpcckpt.store.mirror.s3 import S3Backend
    from hpcckpt.store.mirror.worker import prune_mirror
    from hpcckpt.store.options import MirrorOptions
    from hpcckpt.store.store import CheckpointStore
    from tests.s3_server import S3Server

    spacing = 10

    def fabricate(root: Path, n: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        for step in range(spacing, spacing * (n + 1), spacing):
            name = layout.checkpoint_name(step)
            data = step.to_bytes(8, "little") * 64
            (root / name).write_bytes(data)
            manifest = {
                "version": mirror.MANIFEST_VERSION, "step": step, "file": name,
                "size": len(data), "checksum": xxhash.xxh3_64_hexdigest(data),
                "algorithm": mirror.ALGORITHM, "uid": f"uid-{step}", "chain": [],
                "time": 1e9 + step, "mirrored_at": 1e9 + step,
            }  # fmt: skip
            (root / mirror.manifest_key(name)).write_text(json_.dumps(manifest) + "\n")

    class Counting(DirectoryBackend):
        def __init__(self, root: Path) -> None:
            super().__init__(root)
            self.calls: collections.Counter[str] = collections.Counter()

        def __getattribute__(self, name: str) -> Any:
            attr = super().__getattribute__(name)
            if name.startswith("_") or name == "calls" or not callable(attr):
                return attr
            calls = super().__getattribute__("calls")

            def counted(*a: Any, **k: Any) -> Any:
                calls[name] += 1
                return attr(*a, **k)

            return counted

    def one_copy(backend: Any, path: Path, options: MirrorOptions) -> list[str]:
        copied = mirror_index.upload(backend, path)
        return prune_mirror(backend, options, time.time(), index=copied.index)

    def measure(backend: Any, root: Path, n: int, start: Any, work: Path) -> dict[str, Any]:
        fabricate(root, n)
        t0 = time.perf_counter()
        mirror_index.load(DirectoryBackend(root))  # the index, built once from the manifests
        built = time.perf_counter() - t0
        store = CheckpointStore(work / f"ck-{n}", MPI.COMM_SELF, incremental=False)
        options = MirrorOptions(str(root), mirror_keep_last=1, mirror_keep_every=spacing)
        rng = np.random.default_rng(1)
        first = store.save(spacing * n + 1, {"u": rng.random(1 << 17)}).path
        second = store.save(spacing * n + 2, {"u": rng.random(1 << 17)}).path
        one_copy(backend, first, options)  # a warm-up: the client's connections, probes
        seen = start(backend)
        t0 = time.perf_counter()
        deleted = one_copy(backend, second, options)
        seconds = time.perf_counter() - t0
        return {
            "requests": dict(sorted(seen.items())),
            "total": sum(seen.values()),
            "seconds": seconds,
            "deleted": deleted,
            "index_build_s": built,
        }

    def s3_start(backend: Any) -> collections.Counter[str]:
        seen: collections.Counter[str] = collections.Counter()

        def count(event_name: str, **_kw: Any) -> None:
            seen[event_name.rsplit(".", 1)[-1]] += 1

        backend.client.meta.events.register("before-send.s3.*", count)
        return seen

    def dir_start(backend: Any) -> collections.Counter[str]:
        backend.calls.clear()
        return backend.calls

    sizes = [int(x) for x in str(args.index_sizes).split(",") if x]
    out: dict[str, Any] = {"checkpoints_on_mirror": sizes, "s3": {}, "directory": {}}
    work = Path(tempfile.mkdtemp(prefix="bench-index-", dir=args.dir))
    os.environ["RCLONE_ETAG_HASH"] = args.etag_hash
    server = S3Server(work / "s3")
    server.start()
    os.environ.update(server.env())
    try:
        for n in sizes:
            server.bucket(f"index{n}")
            s3 = S3Backend(f"s3://index{n}/run")
            out["s3"][n] = measure(s3, work / "s3" / f"index{n}" / "run", n, s3_start, work)
            d = Counting(work / f"dir{n}")
            out["directory"][n] = measure(d, work / f"dir{n}", n, dir_start, work)
            for kind in ("s3", "directory"):
                row = out[kind][n]
                print(
                    f"  {kind:9} {n:6} checkpoints on the mirror: {row['total']} requests "
                    f"per copy {row['requests']} ({row['seconds']:.2f} s)",
                    flush=True,
                )
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    for kind in ("s3", "directory"):
        counts = {n: out[kind][n]["requests"] for n in sizes}
        out[kind + "_same_for_every_size"] = len({json.dumps(c) for c in counts.values()}) == 1
    return out


def goals(result: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Item by item, each size: the verified copy against its plain tool (>= 0.9) and a
    save() while the mirror copies against one with no mirror (<= 1.1)."""
    rows = []
    for size, here in result["sizes"].items():
        methods = here.get("throughput", {}).get("methods", {})
        blocked = here.get("blocked", {})
        for what, value, goal in (
            ("directory mirror / copyfile + fsync", methods.get("dir_mirror"), ">= 0.9"),
            ("S3 mirror / boto3 upload_file", methods.get("mirror"), ">= 0.9"),
            ("save() with the S3 mirror copying / none", blocked.get("ratio_s3_to_none"), "<= 1.1"),
            (
                "save() with the dir mirror copying / none",
                blocked.get("ratio_dir_to_none"),
                "<= 1.1",
            ),
        ):
            if isinstance(value, dict):
                value = value.get("ratio_to_peer")
            met = None
            if value is not None:
                met = value >= 0.9 if goal.startswith(">=") else value <= 1.1
            rows.append({"size": size, "what": what, "value": value, "goal": goal, "met": met})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--size", default="128M,1G", help="bytes of float64 per checkpoint file (comma list)"
    )
    ap.add_argument("--files", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--parts", default="8M,16M,32M,64M")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--parts-reps", type=int, default=3)
    ap.add_argument("--cap", default="25M", help="the bandwidth cap of the slowdown case")
    ap.add_argument(
        "--methods",
        default=",".join(m for m in METHODS if m != "dir_mirror_stream"),
        help=f"throughput: comma list of {','.join(METHODS)}",
    )
    ap.add_argument(
        "--blocked-mirrors", default="s3,dir", help="blocked: the mirrors a save runs beside"
    )
    ap.add_argument("--saves", type=int, default=8, help="saves per blocked-time run")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between saves")
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of: throughput,slowdown,blocked,compression,index",
    )
    ap.add_argument("--train-width", type=int, default=1024)
    ap.add_argument("--train-layers", type=int, default=6)
    ap.add_argument("--train-steps", type=int, default=100)
    ap.add_argument("--heat-n", type=int, default=2048)
    ap.add_argument("--heat-steps", type=int, default=300)
    ap.add_argument("--with-parts", action="store_true", help="also the part-size matrix")
    ap.add_argument("--dir", default="/tmp", help="where the checkpoints and the S3 data go")
    ap.add_argument("--mirror-dir", default=None, help="the directory mirror (default: in --dir)")
    ap.add_argument(
        "--s3-dir",
        default=None,
        help="where the S3 server keeps its objects (default: in --dir, the checkpoints' "
        "disk; a real store's writes do not compete with the node's: /dev/shm stands for "
        "another machine's disk)",
    )
    ap.add_argument(
        "--etag-hash",
        default="MD5",
        help='the S3 server\'s ETag hash, computed per request ("": none, as a real store)',
    )
    ap.add_argument(
        "--index-sizes",
        default="10,1000",
        help="index: checkpoints already on the mirror when the requests of a copy are counted",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    if not args.with_parts:
        skip.add("parts")
    started = dt.datetime.now(dt.timezone.utc)
    result: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count()},
        "args": vars(args),
        "notes": NOTES,
        "sizes": {},
    }
    sizes = [x for x in args.size.split(",") if x]
    for size in sizes:
        if {"throughput", "parts", "slowdown", "blocked"} <= skip:
            break
        args.size = size
        bench = Bench(args)
        here: dict[str, Any] = {}
        try:
            print(
                f"{len(bench.files)} checkpoint files of {size}, {bench.total / 1e6:.0f} MB in all",
                flush=True,
            )
            for part in ("throughput", "parts", "slowdown", "blocked"):
                if part in skip:
                    continue
                print(f"{part} ({size}):", flush=True)
                here[part] = getattr(bench, part)()
        finally:
            bench.close()
        result["sizes"][size] = here
    args.size = ",".join(sizes)
    if "compression" not in skip:
        print("compression (one core, best of --reps):", flush=True)
        result["compression"] = compression_figures(args)
    if "index" not in skip:
        print("index (requests of one copy and its retention):", flush=True)
        result["index"] = index_figures(args)
    result["finished"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    for size, here in result["sizes"].items():
        if "throughput" in here:
            print(f"\nthroughput at {args.files} x {size} (median of {args.reps}):")
            for m, row in here["throughput"]["methods"].items():
                ratio = row["ratio_to_peer"]
                print(
                    f"  {m:17} {row['median_MBps']:7.0f} MB/s   "
                    + ("-" if ratio is None else f"{ratio:.2f}")
                    + f" x {row['peer']}"
                )
        if "blocked" in here:
            b = here["blocked"]
            for k in ("s3", "dir"):
                if f"ratio_{k}_to_none" in b:
                    print(
                        f"  save() while the {k} mirror copies: {b[f'ratio_{k}_to_none']:.2f} x "
                        "the save() with no mirror"
                    )
    result["goals"] = goals(result, args)
    print(f"\ngoals ({args.files} files per size, median of {args.reps}):")
    for row in result["goals"]:
        met = {True: "met", False: "NOT met", None: "not measured"}[row["met"]]
        value = "-" if row["value"] is None else f"{row['value']:.2f}"
        print(f"  {row['size']:>5}  {row['what']:44} {value:>5}  (goal {row['goal']}) {met}")
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
