"""Helpers shared by the benchmark scripts: timing, durable raw I/O, cache dropping.

Everything here is plain Python; the MPI parts take a communicator as argument so
that ``run.py`` (no MPI) can import the module too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 64 * MiB  # one os.write / readinto call of the raw reference
#: The methods of ``bench_io.py``, in their default order (``run.py`` starts them).
METHODS = [
    "limit",
    "dd",
    "dd_direct",
    "hpcckpt",
    "gather_npsave",
    "fpr_npsave",
    "h5py_collective",
    "torch_dcp",
]


def mpio_problem() -> str | None:
    """Why h5py's ``mpio`` driver cannot run here (None: it can).

    hpcckpt itself does no MPI-IO and runs on PyPI's serial h5py wheel; only the peers that
    write through HDF5's MPI-IO driver (the ``h5py_collective`` method, the writer matrix
    of ``experiments/``) need an h5py built against a parallel HDF5.
    """
    import h5py

    if h5py.get_config().mpi:
        return None
    return (
        f"h5py {h5py.__version__} (HDF5 {h5py.version.hdf5_version}) was built without MPI, "
        "so its mpio driver is missing (PyPI's h5py wheel is serial; hpcckpt does not need "
        "MPI-IO, this peer does). Fix: `make setup` builds h5py against Debian's parallel "
        "HDF5; elsewhere HDF5_MPI=ON CC=mpicc pip install --no-build-isolation "
        "--no-binary=h5py h5py with a parallel HDF5 loaded (docs/troubleshooting.md, "
        '"h5py was built without MPI")'
    )


def parse_size(text: str) -> int:
    """Bytes from "64M", "512MiB", "2G", "4096" (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": MiB, "G": GiB, "T": 1 << 40}
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def size_label(nbytes: int) -> str:
    for unit, scale in (("G", GiB), ("M", MiB), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def drop_caches() -> str | None:
    """sync, then ask the kernel to drop the page cache; None on success, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    except OSError as exc:
        return f"cannot write /proc/sys/vm/drop_caches ({exc.strerror or exc})"
    return None


class ColdCache:
    """Called between timed phases of an MPI benchmark: every rank waits while rank 0
    drops the page cache (unless ``skip``); ``problem`` says why it could not."""

    def __init__(self, comm, skip: bool = False) -> None:
        self.comm = comm
        self.skip = skip
        self.problem: str | None = None

    def __call__(self) -> None:
        self.comm.Barrier()
        if self.comm.Get_rank() == 0 and not self.skip:
            self.problem = drop_caches()
        self.comm.Barrier()


def fsync_path(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_raw(path: Path, buf: memoryview, chunk: int = CHUNK, sync: bool = True) -> None:
    """Large sequential writes of ``buf`` into a new file, then fsync (the physical limit)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        off = 0
        while off < len(buf):
            off += os.write(fd, buf[off : off + chunk])
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_raw(path: Path, buf: memoryview, chunk: int = CHUNK) -> int:
    """Read a file into ``buf`` with large sequential reads; the number of bytes read."""
    with open(path, "rb", buffering=0) as fh:
        off = 0
        while off < len(buf):
            got = fh.readinto(buf[off : off + chunk])
            if not got:
                break
            off += got
    return off


def timed(comm, fn) -> float:
    """Run ``fn`` on every rank between barriers; the slowest rank's seconds."""
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return comm.allreduce(dt, op=_max(comm))


def _max(comm):
    from mpi4py import MPI

    return MPI.MAX


def median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    if n == 0:
        return float("nan")
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def rotate(items: list, k: int) -> list:
    """``items`` rotated left by ``k`` (round-robin: no method always runs first)."""
    if not items:
        return items
    k %= len(items)
    return items[k:] + items[:k]


def floor_save(comm, path: Path, data) -> None:
    """The least a save into one shared HDF5 file can do, durably and atomically.

    Rank 0 creates ``path`` with one allocated dataset of every rank's bytes (no other
    metadata), one ``bcast`` of its offset, every rank ``pwrite`` + ``fsync`` of its own
    ``data`` (the same size on every rank), one ``allreduce``, rank 0's rename into place
    and directory ``fsync``. No checksums, no state tree: what the design costs before
    hpcckpt adds anything.
    """
    import h5py

    from hpcckpt.store.file.writer import _allocated
    from hpcckpt.store.io.durability import publish

    partial = path.with_name(path.name + ".partial")
    offset = None
    if comm.rank == 0:
        with h5py.File(partial, "w") as f:
            offset = _allocated(f, "u", (data.nbytes * comm.size,), "u1").get_offset()
    offset = comm.bcast(offset)
    fd = os.open(partial, os.O_WRONLY)
    try:
        if data.nbytes:
            os.pwrite(fd, data, offset + comm.rank * data.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    comm.allreduce(1)
    if comm.rank == 0:
        publish(partial, path)


def floor_load(comm, path: Path, out) -> None:
    """The least read of a :func:`floor_save` file: rank 0 opens it with HDF5 for the
    dataset's offset, one ``bcast``, every rank ``pread`` of its bytes (nothing verified)."""
    import h5py

    offset = None
    if comm.rank == 0:
        with h5py.File(path, "r") as f:
            offset = f["u"].id.get_offset()
    offset = comm.bcast(offset)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [out], offset + comm.rank * out.nbytes)
    finally:
        os.close(fd)


def run_worker(
    script: str | os.PathLike[str],
    nranks: int,
    scratch: Path,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    what: str = "",
) -> Any:
    """Run ``script --worker --out OUT --dir SCRATCH ARGS`` on ``nranks`` oversubscribed
    ranks in a fresh, then removed, ``scratch``; the JSON the worker wrote to OUT. Exits
    with the worker's stderr if it fails (``what`` names the run, else the rank count).
    ``env``: variables added to this process's environment."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("mpirun not found: install Open MPI (make setup does)")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    out = scratch / "worker.json"
    full_env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    full_env.update(env or {})
    argv = [mpirun, "-n", str(nranks), "--oversubscribe", sys.executable, "-m", "mpi4py"]
    argv += [str(script), "--worker", "--out", str(out), "--dir", str(scratch), *args]
    proc = subprocess.run(argv, env=full_env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"{what or f'{nranks} ranks'} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def gloo_over_mpi(comm) -> None:
    """Start torch.distributed's gloo group over the ranks of the MPI communicator
    ``comm`` (one machine): rank 0 picks a free port and tells the others."""
    import socket

    import torch.distributed as dist

    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{comm.bcast(port)}",
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
    )
