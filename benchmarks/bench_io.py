"""One repetition of the I/O benchmark on every rank: run under ``mpirun -n 2``.

Started by ``benchmarks/run.py`` once per repetition and MPI-IO component (the io
component is chosen by ``OMPI_MCA_io`` in the environment, which must be set before
``MPI_Init``). For every size, the methods run one after the other in a rotated
order (``--rotate``: the repetition number), each one between barriers on all
ranks and timed by its slowest rank. Before every timed operation rank 0 syncs and
drops the page cache (reads are cold; writes start from the same clean state).
Every file is deleted right after its measurement.

Methods (``--methods``, comma separated):

- ``limit``: each rank writes its own bytes to its own file (64 MiB ``write`` calls,
  then ``fsync``), all ranks at once -> ``limit_write``; then cold-cache reads of
  the same files -> ``limit_read``. The physical limit every ratio refers to.
- ``dd``: rank 0 alone runs ``dd if=/dev/zero of=F bs=4M count=N conv=fdatasync``
  for all ranks' bytes (one stream, for reference).
- ``hpcckpt``: ``CheckpointStore.save`` (encode, checksums, the HDF5 file made by
  rank 0, every rank's bytes written with ``pwrite``, fsync, rename, directory fsync)
  -> ``hpcckpt_save``; then
  ``CheckpointStore.restore`` from a cold cache (checksums verified) ->
  ``hpcckpt_restore``.
- ``gather_npsave``: ``Gatherv`` to rank 0, ``np.save`` of the global array, fsync.
- ``fpr_npsave``: every rank ``np.save`` of its own array to its own file, fsync.
- ``h5py_collective``: one dataset, each rank writes its slice inside
  ``dset.collective``, ``flush``, close, rank 0 fsyncs the file. Needs h5py built
  against a parallel HDF5 (``make setup`` builds it); with PyPI's serial wheel the
  method is reported unavailable, saying so.
- ``torch_dcp``: ``torch.distributed.checkpoint.save`` over gloo on the CPU of the
  same arrays as tensors (a DTensor sharded along dim 0 over the ranks, the way a
  sharded model is saved; the default FileSystemWriter fsyncs its files).

Writes a JSON list of records (rank 0) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import _util  # noqa: E402
from _util import fsync_path, read_raw, timed, write_raw  # noqa: E402


class Bench:
    def __init__(self, comm: MPI.Comm, root: Path, drop: bool) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.nranks = comm.Get_size()
        self.root = root
        self.drop = drop
        self.drop_problem: str | None = None
        self.torch_ready: bool | str = False  # True, or the reason it is not available

    # -- plumbing -----------------------------------------------------------------------
    def prepare(self, warm: memoryview | None = None) -> bool:
        """Sync and drop the page cache on rank 0 (outside the timing); True if dropped.

        ``warm``: first pass that many bytes per rank through the page cache and free
        them, so that the cold read after it gets memory the virtual machine has backed.
        This VM's balloon device has free page reporting: memory unused for a while is
        handed back to the host, and the next read filling it with page cache pays the
        host's page faults (2 GiB per rank read 2.4x slower, measured). The limit's read
        always followed its own write and got that memory; every cold read is warmed
        alike now.
        """
        if warm is not None:
            scratch = self.mine("warm")
            write_raw(scratch, warm, sync=False)
            scratch.unlink()  # its pages are freed at once, never written back
        ok = False
        if self.rank == 0 and self.drop:
            self.drop_problem = _util.drop_caches()
            ok = self.drop_problem is None
        elif self.rank == 0:
            os.sync()
        return bool(self.comm.bcast(ok))

    def clean(self, *paths: Path) -> None:
        self.comm.Barrier()
        if self.rank == 0:
            for p in paths:
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        self.comm.Barrier()

    def mine(self, name: str) -> Path:
        return self.root / f"{name}.rank{self.rank}"

    # -- methods: each returns {result name: (seconds, cold cache?, extra)} -----------------
    def limit(self, a: np.ndarray) -> dict:
        buf = memoryview(a).cast("B")
        path = self.mine("limit")
        self.prepare()
        w = timed(self.comm, lambda: write_raw(path, buf))
        cold = self.prepare(warm=buf)
        got = [0]
        r = timed(self.comm, lambda: got.__setitem__(0, read_raw(path, buf)))
        assert got[0] == a.nbytes, (got[0], a.nbytes)
        self.clean(*(self.root / f"limit.rank{k}" for k in range(self.nranks)))
        return {"limit_write": (w, False, {}), "limit_read": (r, cold, {})}

    def dd(self, a: np.ndarray) -> dict:
        total = a.nbytes * self.nranks
        path = self.root / "dd.out"
        bs = 4 * _util.MiB
        argv = ["dd", "if=/dev/zero", f"of={path}", "bs=4M", f"count={total // bs}"]
        argv.append("conv=fdatasync")
        err = [""]

        def run() -> None:
            if self.rank == 0:
                proc = subprocess.run(argv, capture_output=True, text=True, check=False)
                if proc.returncode:
                    err[0] = proc.stderr.strip()[-300:]

        self.prepare()
        t = timed(self.comm, run)
        self.clean(path)
        if err[0]:
            raise RuntimeError(f"dd failed: {err[0]}")
        return {"dd": (t, False, {"argv": argv, "bytes": (total // bs) * bs})}

    def dd_direct(self, a: np.ndarray) -> dict:
        """Every rank at once: its bytes (zeros) to its own file with O_DIRECT and fsync."""
        path = self.mine("dd_direct")
        bs = 64 * _util.MiB
        argv = ["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={a.nbytes // bs}"]
        argv += ["oflag=direct", "conv=fsync"]
        err = [""]

        def run() -> None:
            proc = subprocess.run(argv, capture_output=True, text=True, check=False)
            if proc.returncode:
                err[0] = proc.stderr.strip()[-300:]

        self.prepare()
        t = timed(self.comm, run)
        self.clean(*(self.root / f"dd_direct.rank{k}" for k in range(self.nranks)))
        if self.comm.allreduce(bool(err[0])):
            raise RuntimeError(f"dd oflag=direct failed: {err[0]}")
        return {"dd_direct": (t, False, {"argv": argv})}

    def hpcckpt(self, a: np.ndarray, step: int) -> dict:
        from hpcckpt.store.io import blocks, write_path
        from hpcckpt.store.store import CheckpointStore

        d = self.root / "hpcckpt"
        store = CheckpointStore(d, self.comm)
        state = {"u": a}
        # The writer measures direct and buffered writes on its first saves of a size
        # (hpcckpt/store/io/write_path.py): let it, untimed, as a long run would have.
        for k in range(write_path.PROBES):
            store.saver.remember(None)  # a full save, as the timed one
            self.prepare()
            store.save(100 + k, state)
        groups = store.saver.paths.groups if store.saver.paths else {}
        probes = {
            g: {
                "direct_mb_s": [x / 1e6 for x in grp.rates[True]],
                "buffered_mb_s": [x / 1e6 for x in grp.rates[False]],
            }
            for g, grp in groups.items()
        }
        store.saver.remember(None)
        self.prepare()
        saved: list = [None]
        w = timed(self.comm, lambda: saved.__setitem__(0, store.save(step, state)))
        first, last = a[0], a[-1]
        a[0] = a[-1] = -1.0
        cold = self.prepare(warm=memoryview(a).cast("B"))
        r = timed(self.comm, lambda: store.restore(state))
        assert a[0] == first and a[-1] == last, "restore did not bring the data back"
        # incremental: one element changed in every 100th block (1% of the blocks dirty)
        dirty = np.arange(0, a.size, 100 * blocks.block_elems(a.itemsize, store.saver.block_size))
        a[dirty] += 1.0
        self.prepare()
        got: list = [None]
        i = timed(self.comm, lambda: got.__setitem__(0, store.save(step + 1, state)))
        a[dirty] -= 1.0  # exact: the values are small integers
        res = got[0]
        extra = {"kind": res.kind, "dirty_fraction": res.dirty_fraction}
        self.clean(d)
        if res.kind != "incremental":
            raise RuntimeError(f"the 1% dirty save was {res.kind}, not incremental")
        path = {"write_path": saved[0].write_path, "probes": probes}
        return {
            "hpcckpt_save": (w, False, path),
            "hpcckpt_restore": (r, cold, {}),
            "hpcckpt_incr": (i, False, extra),
        }

    def gather_npsave(self, a: np.ndarray) -> dict:
        path = self.root / "gather.npy"

        def run() -> None:
            recv = None
            if self.rank == 0:
                recv = np.empty(a.size * self.nranks, dtype=a.dtype)
            self.comm.Gather(a, recv, root=0)
            if self.rank == 0:
                with open(path, "wb") as fh:
                    np.save(fh, recv)
                    fh.flush()
                    os.fsync(fh.fileno())

        self.prepare()
        t = timed(self.comm, run)
        self.clean(path)
        return {"gather_npsave": (t, False, {})}

    def fpr_npsave(self, a: np.ndarray) -> dict:
        path = self.mine("fpr.npy")

        def run() -> None:
            with open(path, "wb") as fh:
                np.save(fh, a)
                fh.flush()
                os.fsync(fh.fileno())

        self.prepare()
        t = timed(self.comm, run)
        self.clean(*(self.root / f"fpr.npy.rank{k}" for k in range(self.nranks)))
        return {"fpr_npsave": (t, False, {})}

    def h5py_collective(self, a: np.ndarray) -> dict:
        problem = _util.mpio_problem()
        if problem:
            return {"h5py_collective": (None, False, {"unavailable": problem})}
        import h5py

        path = self.root / "h5py_collective.h5"
        n = a.size
        lo, hi = self.rank * n, (self.rank + 1) * n

        def run() -> None:
            with h5py.File(path, "w", driver="mpio", comm=self.comm) as f:
                d = f.create_dataset("u", shape=(n * self.nranks,), dtype=a.dtype)
                with d.collective:
                    d[lo:hi] = a
                f.flush()
            if self.rank == 0:
                fsync_path(path)

        self.prepare()
        t = timed(self.comm, run)
        self.clean(path)
        return {"h5py_collective": (t, False, {})}

    def _torch_init(self) -> bool | str:
        if self.torch_ready is not False:
            return self.torch_ready
        try:
            import torch
            import torch.distributed as dist
        except ImportError as exc:
            self.torch_ready = f"torch not importable ({exc})"
            return self.torch_ready
        port = None
        if self.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = self.comm.bcast(port)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=self.rank,
            world_size=self.nranks,
        )
        torch.set_num_threads(1)
        self.torch_ready = True
        return True

    def torch_dcp(self, a: np.ndarray) -> dict:
        ready = self._torch_init()
        if ready is not True:
            return {"torch_dcp": (None, False, {"unavailable": ready})}
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        path = self.root / "torch_dcp"
        mesh = init_device_mesh("cpu", (self.nranks,))
        local = torch.from_numpy(a)
        how = "DTensor Shard(0)"
        state = {"u": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)}

        def run() -> None:
            dcp.save(state, checkpoint_id=str(path))

        self.prepare()
        t = timed(self.comm, run)
        self.clean(path)
        return {"torch_dcp": (t, False, {"how": how, "torch": torch.__version__})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", required=True, help="bytes per rank, comma separated (64M,2G)")
    p.add_argument("--methods", default=",".join(_util.METHODS))
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--rotate", type=int, default=0, help="rotate the method order by this")
    p.add_argument("--label", default="", help="recorded in every record (e.g. the io component)")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    root = args.dir.absolute()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    comm.Barrier()
    bench = Bench(comm, root, drop=not args.no_drop_caches)
    methods = _util.rotate(args.methods.split(","), args.rotate)
    records = []
    for step, size in enumerate(_util.parse_size(s) for s in args.sizes.split(",")):
        n = size // 8
        a = np.arange(n, dtype=np.float64) + rank * n
        bench.limit(a)  # warm-up, not recorded: the first large read of a process ran slower
        for order, method in enumerate(methods):
            fn = getattr(bench, method)
            try:
                out = fn(a, step) if method == "hpcckpt" else fn(a)
            except Exception as exc:  # noqa: BLE001 - reported in the table, others go on
                if rank == 0:
                    traceback.print_exc()
                out = {method: (None, False, {"error": f"{type(exc).__name__}: {exc}"})}
            for name, (seconds, cold, extra) in out.items():
                records.append(
                    {
                        "label": args.label,
                        "rotate": args.rotate,
                        "order": order,
                        "bytes_per_rank": a.nbytes,
                        "nranks": comm.Get_size(),
                        "method": name,
                        "seconds": seconds,
                        "cold_cache": cold,
                        **extra,
                    }
                )
                if rank == 0 and seconds is not None:
                    gbs = a.nbytes * comm.Get_size() / seconds / 1e9
                    print(
                        f"[{args.label}] {_util.size_label(a.nbytes)}/rank {name:18s} "
                        f"{seconds:8.3f} s {gbs:6.2f} GB/s",
                        flush=True,
                    )
        del a
    if rank == 0:
        doc = {
            "records": records,
            "drop_caches": None if bench.drop else "disabled (--no-drop-caches)",
            "drop_problem": bench.drop_problem,
            "io_env": os.environ.get("OMPI_MCA_io", ""),
            "time": time.time(),
        }
        args.out.write_text(json.dumps(doc, indent=1))
    if bench.torch_ready is True:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
