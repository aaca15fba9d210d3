"""hpcckpt's write pattern with plain h5py, one option changed at a time; run under mpirun.

Reproduces what hpcckpt's MPI-IO writer did (``write_file`` plus the commit in
``store.py``, before the direct-I/O writer; docs/performance.md keeps its history):
one file through the mpio driver; a ``meta`` group with attributes; small
``rank_tree`` and ``checksums`` datasets; one contiguous float64 dataset per array
with ``fill_time="never"``; each rank writes its rows; ``flush`` (=
``MPI_File_sync``); close; rank 0 fsyncs the file, renames it and fsyncs the
directory. Then it varies one knob per variant. Every variant runs once per size in a
rotated order next to the raw limit (own file per rank, 64 MiB writes, fsync) and a
raw shared-file write (``pwrite`` at each rank's offset into one file, fsync on each
rank: the limit for one shared file without HDF5). Started by
``run_experiments.py``; writes a JSON list of records (rank 0) to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import h5py
import numpy as np
import xxhash
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _util  # noqa: E402
from _util import MiB, fsync_path, timed, write_raw  # noqa: E402


@dataclass(frozen=True)
class Variant:
    collective: bool = False
    alignment: tuple[int, int] | None = None
    fill_never: bool = True
    chunk: int | None = None  # bytes per write call; None = one write of the whole slice
    sync: str = "flush+rank0"  # flush+rank0 | rank0 | each | flush+each | flush
    hints: dict[str, str] = field(default_factory=dict)
    checksum: bool = False  # xxh3-64 of the array before writing, as hpcckpt does


BASE = Variant()  # what hpcckpt does on a local file system today
ROMIO = {"romio_cb_write": "disable", "romio_ds_write": "disable"}
VARIANTS: dict[str, Variant] = {
    "hpcckpt (base)": BASE,
    "base+checksum": replace(BASE, checksum=True),
    "collective": replace(BASE, collective=True),
    "align 1M": replace(BASE, alignment=(MiB, MiB)),
    "align 4M": replace(BASE, alignment=(MiB, 4 * MiB)),
    "fill default": replace(BASE, fill_never=False),
    "chunks 64M": replace(BASE, chunk=64 * MiB),
    "chunks 256M": replace(BASE, chunk=256 * MiB),
    "chunks 1G": replace(BASE, chunk=1024 * MiB),
    "sync rank0 only": replace(BASE, sync="rank0"),
    "sync each rank": replace(BASE, sync="each"),
    "sync flush only": replace(BASE, sync="flush"),
    "cb_write disable": replace(BASE, hints={"romio_cb_write": "disable"}),
    "ds_write disable": replace(BASE, hints={"romio_ds_write": "disable"}),
    "coll cb enable 64M": replace(
        BASE,
        collective=True,
        hints={"romio_cb_write": "enable", "cb_buffer_size": str(64 * MiB)},
    ),
    "coll cb disable": replace(BASE, collective=True, hints={"romio_cb_write": "disable"}),
    "align 1M+rank0+hints": replace(BASE, alignment=(MiB, MiB), sync="rank0", hints=ROMIO),
    "align 1M+rank0": replace(BASE, alignment=(MiB, MiB), sync="rank0"),
}


def h5_save(path: Path, comm: MPI.Comm, a: np.ndarray, v: Variant) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    n = a.shape[0]
    tree = json.dumps({"step": 1, "rank": rank}).encode().ljust(64)
    sums = np.zeros(2, dtype=np.uint64)
    if v.checksum:
        sums[0] = xxhash.xxh3_64_intdigest(memoryview(a).cast("B"))
    options: dict = {}
    info = MPI.INFO_NULL
    if v.hints:
        info = MPI.Info.Create()
        for k, val in v.hints.items():
            info.Set(k, val)
        options["info"] = info
    if v.alignment:
        options["alignment_threshold"], options["alignment_interval"] = v.alignment
    partial = path.with_name(path.name + ".partial")
    problem = _util.mpio_problem()
    if problem:
        raise RuntimeError(problem)
    try:
        with h5py.File(partial, "w", driver="mpio", comm=comm, **options) as f:
            meta = f.create_group("meta")
            for k in ("format", "format_version", "step", "nranks", "time", "checksum"):
                meta.attrs[k] = 1
            rt = meta.create_dataset(
                "rank_tree", shape=(64 * size,), dtype=np.uint8, fill_time="never"
            )
            cs = meta.create_dataset("checksums", shape=(size, 2), dtype=np.uint64)
            kw = {"fill_time": "never"} if v.fill_never else {}
            d = f.create_dataset("state/u", shape=(n * size,), dtype=a.dtype, **kw)
            d.attrs["rank_offsets"] = np.arange(size + 1, dtype=np.int64) * n
            d.attrs["layout"] = "rows"
            rt[rank * 64 : (rank + 1) * 64] = np.frombuffer(tree, dtype=np.uint8)
            cs[rank] = sums
            step = n if v.chunk is None else max(1, v.chunk // a.itemsize)
            ctx = d.collective if v.collective else contextlib.nullcontext()
            with ctx:
                for off in range(0, n, step):
                    end = min(n, off + step)
                    d[rank * n + off : rank * n + end] = a[off:end]
            if v.sync.startswith("flush"):
                f.flush()
    finally:
        if info != MPI.INFO_NULL:
            info.Free()
    if v.sync in ("each", "flush+each"):
        fsync_path(partial)
    comm.Barrier()
    if rank == 0:
        if v.sync in ("flush+rank0", "rank0"):
            fsync_path(partial)
        os.replace(partial, path)
        fsync_path(path.parent)


def raw_shared(path: Path, comm: MPI.Comm, a: np.ndarray) -> None:
    rank = comm.Get_rank()
    buf = memoryview(a).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        base, off = rank * len(buf), 0
        while off < len(buf):
            off += os.pwrite(fd, buf[off : off + _util.CHUNK], base + off)
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", required=True)
    p.add_argument("--variants", default="", help="'|'-separated names; default: all")
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--rotate", type=int, default=0)
    p.add_argument("--label", default="")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--raw-variants", action="store_true", help="also the limit with 1 GiB writes")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    root = args.dir.absolute()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    comm.Barrier()
    names = [x for x in args.variants.split("|") if x] or list(VARIANTS)
    extra = ["limit 1G writes"] if args.raw_variants else []
    order = _util.rotate(["limit", "raw shared", *extra, *names], args.rotate)

    def prepare() -> None:
        if rank == 0:
            if args.no_drop_caches:
                os.sync()
            else:
                _util.drop_caches()
        comm.Barrier()

    def clean(path: Path) -> None:
        comm.Barrier()
        if rank == 0:
            for q in root.iterdir():
                if q.is_file():
                    q.unlink()
                else:
                    shutil.rmtree(q, ignore_errors=True)
        comm.Barrier()

    records = []
    for size in (_util.parse_size(s) for s in args.sizes.split(",")):
        n = size // 8
        a = np.arange(n, dtype=np.float64) + rank * n
        for pos, name in enumerate(order):
            if name == "limit":
                path = root / f"limit.rank{rank}"
                fn = lambda path=path, a=a: write_raw(path, memoryview(a).cast("B"))  # noqa: E731
            elif name == "limit 1G writes":
                path = root / f"limit1g.rank{rank}"
                fn = lambda path=path, a=a: write_raw(  # noqa: E731
                    path, memoryview(a).cast("B"), chunk=_util.GiB
                )
            elif name == "raw shared":
                path = root / "shared.raw"
                fn = lambda path=path, a=a: raw_shared(path, comm, a)  # noqa: E731
            else:
                path = root / "ckpt.h5"
                v = VARIANTS[name]
                fn = lambda path=path, v=v, a=a: h5_save(path, comm, a, v)  # noqa: E731
            prepare()
            error = None
            try:
                seconds = timed(comm, fn)
            except Exception as exc:  # noqa: BLE001 - e.g. HDF5's 2 GiB limit per write
                seconds, error = None, f"{type(exc).__name__}: {exc}"
            errors = [e for e in comm.allgather(error) if e]
            clean(path)
            records.append(
                {
                    "label": args.label,
                    "variant": name,
                    "bytes_per_rank": size,
                    "seconds": None if errors else seconds,
                    "error": errors[0] if errors else None,
                    "order": pos,
                }
            )
            if rank == 0 and errors:
                print(f"[{args.label}] {_util.size_label(size)}/rank {name:22s} {errors[0]}")
            elif rank == 0:
                print(
                    f"[{args.label}] {_util.size_label(size)}/rank {name:22s} {seconds:7.3f} s "
                    f"{size * comm.Get_size() / seconds / 1e9:5.2f} GB/s",
                    flush=True,
                )
        del a
    if rank == 0:
        args.out.write_text(json.dumps({"records": records, "time": time.time()}, indent=1))


if __name__ == "__main__":
    main()
