"""Blocked time of asynchronous and node-local (cache) saves against a direct save.

    .venv/bin/python benchmarks/bench_async.py [--sizes 64M,512M,2G] [--reps 3] [--json FILE]
        [--dir SCRATCH] [--cache-root /dev/shm] [--nranks 2] [--no-drop-caches]

Started without MPI it re-launches itself under ``mpirun -n NRANKS`` (as ``run.py``
does for its workers); it can also be started under ``mpirun`` directly
(``mpirun -n 2 .venv/bin/python -m mpi4py benchmarks/bench_async.py ...``).

For every size of float64 state per rank, each repetition runs these measurements in
an order shuffled per repetition (seeded, the same on every rank; rank 0 runs ``sync``
and drops the page cache before each one when it may), every one between barriers and
timed by its slowest rank:

- ``memcpy``: ``np.copyto`` of the state into the ``async`` Checkpointer's own host
  buffer, between its saves (the yardstick: the copy a staged save cannot go below,
  into the same memory); then, after the same cache drop, ``memcpy_fresh``: into a
  buffer allocated and filled right before (part of it still in the CPU's caches, and
  on this VM faster or slower than memory copied into many times: reported, not a
  yardstick; the yardstick of the measurements before 2026-11-28 12:00 UTC);
- ``hash``: xxh3 of the state's blocks on its own;
- ``sync``: ``Checkpointer.save`` (direct: returns after the durable commit);
- ``async``: ``Checkpointer(async_save=True).save`` (the ranks are blocked until it
  returns), then ``wait()`` (its ``seconds``: staging to durable commit);
- ``cache``: the same with ``Checkpointer(cache=CACHE_ROOT/<unique dir>)``;
- ``async+kernel``, ``cache+kernel``: a fixed compute kernel (a 5-point Jacobi stencil
  over two separate arrays of ``--kernel-mib``, about ``--kernel-seconds`` alone) run
  alone, and started right after an ``async`` / ``cache`` save returns, while its
  background write runs (``wait()`` is called after the kernel); the two runs are
  adjacent, in alternating order: slowdown = with / alone - 1.

Inside the staged saves, the copy (and hash), the removal of the previous node-local
copy and the collective file creation are timed by wrapping those library functions
with timers (``Bench.instrument``), which splits the blocked time.

Every save writes the whole state: ``incremental=False`` and ``validate=None`` (the
poisoned-state check is not timed) for all three Checkpointers. Each Checkpointer
starts as a job does: ``restore(state)`` with nothing to restore (the async one reserves
its staging there, populated in the background), then one untimed save (its file
layout), reported as the first save, and as a ratio to the later saves' median (goal: at
most 2x). The goals of the blocked time: at most 1.2x one ``np.copyto`` of the same bytes
for ``async`` and ``cache``. The async staging's memory is measured at every save, two
ways, against the budget a save plans with (``HostBuffers.plan``: ``staging_budget=``,
or the default: a fraction of the memory available at the first plan, then fixed): the
bytes its buffers hold at their most (``HostBuffers.peak``, counted at every allocation)
and the process's resident set at its most during the save and its background write
(``VmHWM`` after a reset, less the resident set outside the staging: ``VmRSS`` before
the save less the anonymous memory the staging added since the Checkpointers were made,
``RssAnon``). Each checkpoint is deleted after its measurement (at most one on disk at a
time); the cache keeps one copy per rank, as it does in a job. The table gives medians over the
repetitions; ratios are per repetition (same repetition, interleaved), then the median.
The JSON (default ``benchmarks/results/async-<UTC time>.json``) holds every sample.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import _util  # noqa: E402

VARIANTS = ("sync", "async", "cache")
#: Parts of a staged save timed inside it (wrapped library functions, see Bench.instrument).
PARTS = ("stage", "cache_remove", "create_file")
MEASUREMENTS = [
    "memcpy",
    "hash",
    "sync",
    "async",
    "cache",
    "async+kernel",
    "cache+kernel",
]
NOTES = [
    "every save writes the whole state: incremental=False, validate=None (no poison check)",
    "blocked = wall time of Checkpointer.save() on the slowest rank; durable = wait() "
    "result .seconds (staging to durable commit); sync = both",
    "2 ranks on 2 cores: each rank's background write thread competes with the ranks "
    "for the CPU (and every process for memory bandwidth)",
]


def _under_mpi() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def launch(nranks: int, argv: list[str]) -> int:
    """Run this script under ``mpirun -n nranks`` with the same arguments."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("mpirun not found: install openmpi-bin (make setup does)")
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [mpirun, "-n", str(nranks), "--oversubscribe", sys.executable, "-m", "mpi4py"]
    return subprocess.run([*cmd, str(Path(__file__).resolve()), *argv], env=env).returncode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64M,512M", help="float64 state per rank (64M,512M,2G)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (median over them)")
    p.add_argument("--json", type=Path, help="default benchmarks/results/async-<UTC time>.json")
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("/tmp/hpcckpt-bench-async"),
        help="scratch on the real disk: a new directory in it is deleted after (and it, if new)",
    )
    p.add_argument("--cache-root", type=Path, default=Path("/dev/shm"))
    p.add_argument("--nranks", type=int, default=2, help="ranks when it launches mpirun itself")
    p.add_argument("--kernel-mib", type=int, default=32, help="each kernel array (MiB)")
    p.add_argument("--kernel-seconds", type=float, default=1.5, help="kernel's time alone")
    p.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache")
    p.add_argument("--staging-budget", help="the async Checkpointer's staging_budget (4G...)")
    return p.parse_args(argv)


# -- helpers (rank side) ---------------------------------------------------------------------


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    target = str(path.resolve())
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, kind = mnt, parts[2]
    return kind


def cpu_times() -> tuple[float, float]:
    """(busy, steal) seconds of the whole machine since boot, from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / tick, steal / tick


def own_cpu() -> float:
    """CPU seconds of this process, every thread."""
    t = os.times()
    return t.user + t.system


def rss_anon() -> int:
    """Anonymous resident memory of this process (``RssAnon``), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def machine_info(directory: Path, cache_root: Path) -> dict:
    import h5py
    import mpi4py
    import numpy as np

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
    info["dir_fs"] = fs_type(directory)
    info["cache_fs"] = fs_type(cache_root)
    info.update(
        h5py=h5py.version.version,
        hdf5=h5py.version.hdf5_version,
        numpy=np.__version__,
        mpi4py=mpi4py.__version__,
    )
    return info


def make_kernel(mib: int):
    """A 5-point Jacobi stencil over an n x n float64 array of about ``mib`` MiB."""
    import numpy as np

    n = max(8, int((mib * 2**20 / 8) ** 0.5))
    a = np.random.default_rng(7).random((n, n))
    b = a.copy()

    def run(iters: int) -> float:
        x, y = a, b
        for _ in range(iters):
            inner = y[1:-1, 1:-1]
            np.add(x[:-2, 1:-1], x[2:, 1:-1], out=inner)
            inner += x[1:-1, :-2]
            inner += x[1:-1, 2:]
            inner *= 0.25
            x, y = y, x
        return float(x[n // 2, n // 2])

    return run, a.nbytes


def _mib(nbytes: int | None) -> str:
    return "default" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


def _median(xs: list[float]) -> float:
    return _util.median([x for x in xs if x is not None])


# -- the measurements -------------------------------------------------------------------------


class Bench:
    """The ranks' side: collective timing helpers and the measurements of one size."""

    def __init__(self, args: argparse.Namespace, scratch: Path, cache_root: Path, drop: bool):
        import numpy as np
        from mpi4py import MPI

        from hpcckpt.coord.checkpointer import Checkpointer
        from hpcckpt.store.io import blocks, memory
        from hpcckpt.store.tier import copies as fast_tier

        self.np, self.MPI, self.Checkpointer = np, MPI, Checkpointer
        self.blocks, self.fast_tier = blocks, fast_tier
        self.memory = memory
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_ranks = node.Get_size()  # ranks sharing the node's memory (the budget)
        node.Free()
        self.anon_base = 0
        self.args, self.scratch, self.cache_root, self.drop = args, scratch, cache_root, drop
        self.bs = blocks.DEFAULT_BLOCK_SIZE
        self.parts: dict[str, float] = {}
        self.instrument()
        self.kernel, self.kernel_bytes = make_kernel(args.kernel_mib)
        self.kernel(1)
        t0 = time.perf_counter()
        self.kernel(10)
        per_iter = self.max((time.perf_counter() - t0) / 10)
        self.iters = max(1, round(args.kernel_seconds / per_iter))

    def instrument(self) -> None:
        """Time the parts of a staged save from inside it: the library functions that copy
        (and hash) the state, remove the previous node-local copy and create the file are
        wrapped with timers (what they do is unchanged)."""
        from hpcckpt.store.save import commit, staging
        from hpcckpt.store.tier import copies as fast_tier
        from hpcckpt.store.tier import data_map

        def wrap(owner, name: str, part: str) -> None:
            inner = getattr(owner, name)

            def timed_call(*a, **k):
                if threading.current_thread() is not threading.main_thread():
                    return inner(*a, **k)  # a background thread's: not the blocked window
                t0 = time.perf_counter()
                try:
                    return inner(*a, **k)
                finally:
                    self.parts[part] = self.parts.get(part, 0.0) + time.perf_counter() - t0

            setattr(owner, name, timed_call)

        wrap(staging.HostBuffers, "stage", "stage")  # copy + hash into the host buffers
        wrap(fast_tier, "write_data", "stage")  # write + hash into the cache's data file
        wrap(data_map.DataMap, "write", "stage")  # or copied into its mapping (tmpfs)
        wrap(fast_tier, "remove", "cache_remove")
        wrap(commit, "write_file", "create_file")  # collective create, metadata

    def max(self, value: float) -> float:
        return self.comm.allreduce(value, op=self.MPI.MAX)

    def prep(self) -> None:
        """Between measurements: flush dirty pages and drop the page cache (rank 0)."""
        self.comm.Barrier()
        if self.rank == 0:
            os.sync()
            if self.drop:
                _util.drop_caches()
        self.comm.Barrier()

    def timed(self, fn):
        """(the slowest rank's seconds, this rank's result) of ``fn`` between barriers."""
        self.comm.Barrier()
        t0 = time.perf_counter()
        out = fn()
        return self.max(time.perf_counter() - t0), out

    def clear(self, directory: Path) -> None:
        self.comm.Barrier()
        if self.rank == 0:
            for p in directory.glob("ckpt-*.h5*"):
                p.unlink()
        self.comm.Barrier()

    def save(self, v: str, with_kernel: bool) -> dict:
        """One save of variant ``v`` (then the kernel, then wait); its figures."""
        ck = self.ck[v]
        self.prep()
        self.parts.clear()
        if ck.buffers is not None:
            mem = self.memory
            state_bytes = sum(a.nbytes for a in self.state.values())
            # As the save plans it: its own reservation still being populated (a save
            # right after restore()) is held (nbytes), not also taken from what is free.
            # The budget the save plans against: fixed by restore()'s plan. Not a plan of
            # its own, which would take the memory reading the save's plan is to use.
            budget = ck.buffers.planned_budget
            if budget is None:
                budget = ck.buffers.plan(state_bytes, self.local_ranks).budget
            outside = mem.rss_bytes() - (rss_anon() - self.anon_base)
            mem.reset_peak()
        blocked, res = self.timed(lambda: ck.save(self.step[v], self.state))
        self.step[v] += 1
        out = {"blocked": blocked}
        if v != "sync":
            out.update({f"part_{k}": self.max(self.parts.get(k, 0.0)) for k in PARTS})
        if v == "sync":
            out["reported"] = res.seconds
            out["durable"] = blocked
        else:
            out["reported"] = res.blocked_seconds
            if with_kernel:
                t0 = time.perf_counter()
                self.kernel(self.iters)
                out["kernel"] = self.max(time.perf_counter() - t0)
            out["durable"] = ck.wait().seconds
        if ck.buffers is not None:  # the most host memory the staging held in this save
            out["staging_peak"] = self.max(ck.buffers.peak)
            out["staging_rss_peak"] = self.max(self.memory.peak_rss_bytes() - outside)
            out["staging_budget"] = self.comm.allreduce(budget, op=self.MPI.MIN)
        self.clear(ck.directory)
        return out

    def kernel_alone(self) -> float:
        self.prep()
        return self.timed(lambda: self.kernel(self.iters))[0]

    def measure(self, m: str, sample: dict) -> None:
        np, bs, u = self.np, self.bs, self.state["u"]
        if m == "memcpy":
            # The async save's own host buffer (free between saves: its write is done)
            (own,) = [b for b in self.ck["async"].buffers.copies().values() if b.shape == u.shape]
            self.prep()
            sample[m], _ = self.timed(lambda: np.copyto(own, u))
            buf = np.empty_like(u)
            buf.fill(0.0)  # first touch outside the timing
            self.prep()
            sample["memcpy_fresh"], _ = self.timed(lambda: np.copyto(buf, u))
            del buf
        elif m == "hash":
            self.prep()
            sample[m], _ = self.timed(lambda: self.blocks.block_hashes(u, bs))
        elif m.endswith("+kernel"):
            # The kernel alone right next to the kernel during the write (order alternates).
            v = m.split("+")[0]
            if sample["rep"] % 2 == 0:
                alone = self.kernel_alone()
                r = self.save(v, True)
            else:
                r = self.save(v, True)
                alone = self.kernel_alone()
            sample[f"{v}_kernel_alone"] = alone
            sample[f"{v}_kernel"] = r["kernel"]
            sample[f"{v}_blocked_k"] = r["blocked"]
            sample[f"{v}_durable_k"] = r["durable"]
        else:
            r = self.save(m, False)
            for key, value in r.items():
                sample[f"{m}_{key}"] = value

    def run_size(self, size: int) -> tuple[dict, list[dict]]:
        """All repetitions for one size; (summary row, raw samples)."""
        comm, rank, label = self.comm, self.rank, _util.size_label(size)
        directory, cache = self.scratch / label, self.cache_root / label
        self.state = {"u": self.np.random.default_rng(rank).random(size // 8)}
        common = {"every_steps": 10**9, "keep_last": None, "incremental": False, "validate": None}
        ckp = self.Checkpointer
        budget = (
            {} if self.args.staging_budget is None else {"staging_budget": self.args.staging_budget}
        )
        self.ck = {
            "sync": ckp(directory / "sync", comm, **common),
            "async": ckp(directory / "async", comm, async_save=True, **budget, **common),
            "cache": ckp(directory / "cache", comm, cache=cache / "ckpt", **common),
        }
        comm.Barrier()
        self.anon_base = rss_anon()  # before any staging: restore() reserves the async one
        for v in VARIANTS:  # as a job starts: nothing to restore
            assert self.ck[v].restore(self.state) is None
        self.step = {v: 0 for v in VARIANTS}
        first, self.first_memory = {}, []
        for v in VARIANTS:  # untimed: tunes, creates the files, fills the cache's file
            r = self.save(v, False)
            first[v] = r["blocked"]
            if "staging_peak" in r:
                self.first_memory.append(r)
        raw = []
        for rep in range(self.args.reps):
            sample: dict = {"bytes_per_rank": size, "rep": rep, "loadavg": os.getloadavg()[0]}
            comm.Barrier()
            wall0, (busy0, steal0), own0 = time.time(), cpu_times(), own_cpu()
            # A new order per repetition, the same on every rank: no measurement always
            # follows the same one (the disk is still busy after a write, on the host side).
            order = self.np.random.default_rng(1000 + rep).permutation(len(MEASUREMENTS))
            sample["order"] = [MEASUREMENTS[i] for i in order]
            for m in sample["order"]:
                self.measure(m, sample)
            comm.Barrier()
            wall = time.time() - wall0
            busy, steal = cpu_times()
            ours = comm.allreduce(own_cpu() - own0)
            # Cores kept busy by everything but the ranks (other jobs, kernel threads such as
            # writeback, mpirun), and the fraction of time the hypervisor took away.
            sample["other_cores"] = max(0.0, (busy - busy0 - ours) / wall)
            sample["steal"] = (steal - steal0) / wall / (os.cpu_count() or 1)
            raw.append(sample)
            if rank == 0:
                print(
                    f"{label} rep {rep + 1}/{self.args.reps}: memcpy {sample['memcpy']:.3f} s, "
                    f"sync {sample['sync_blocked']:.3f} s, async blocked "
                    f"{sample['async_blocked']:.3f} s, cache blocked "
                    f"{sample['cache_blocked']:.3f} s (other work {sample['other_cores']:.2f} "
                    f"cores, steal {100 * sample['steal']:.0f} %)",
                    flush=True,
                )
        host_buffers = self.max(self.ck["async"].buffers.nbytes)
        cache_buffers = self.ck["cache"].buffers  # a cache save's copy goes through them
        cache_host = self.max(cache_buffers.nbytes if cache_buffers is not None else 0)
        every = self.first_memory + [
            {k: s[f"async_{k}"] for k in ("staging_peak", "staging_rss_peak", "staging_budget")}
            for s in raw
        ]
        peak = max(m["staging_peak"] for m in every)
        rss_peak = max(m["staging_rss_peak"] for m in every)
        budget = min(m["staging_budget"] for m in every)
        over = [
            m for m in every if max(m["staging_peak"], m["staging_rss_peak"]) > m["staging_budget"]
        ]
        mine = sum(p.stat().st_size for p in (cache / "ckpt").glob(f"*.rank{rank}.data"))
        cache_bytes = self.max(mine)
        for v in VARIANTS:
            self.ck[v].close()
        self.ck, self.state = {}, {}
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
        comm.Barrier()
        row = summarize(size, raw, first, host_buffers, cache_bytes)
        row["memory_per_rank"].update(
            cache_host_buffers=cache_host,
            async_staging_peak=peak,
            async_staging_rss_peak=rss_peak,
            staging_budget=budget,
            saves_measured=len(every),
            saves_over_budget=len(over),
        )
        return row, raw


def worker(args: argparse.Namespace, argv: list[str]) -> int:
    from mpi4py import MPI

    os.environ.setdefault("HPCCKPT_LOG_LEVEL", "quiet")  # one line per save otherwise
    os.environ.pop("HPCCKPT_CACHE", None)  # it would turn the sync and async variants into cache
    comm = MPI.COMM_WORLD
    rank, nranks = comm.Get_rank(), comm.Get_size()
    sizes = [_util.parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if any(s <= 0 or s % 8 for s in sizes):
        if rank == 0:
            print("--sizes: every size must be a positive multiple of 8 bytes", file=sys.stderr)
        return 2
    tag = comm.bcast(f"hpcckpt-bench-async-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    # Unique directories under --dir and --cache-root: only what this run made is deleted.
    scratch = args.dir.absolute() / tag
    cache_root = args.cache_root.absolute() / tag
    made_dir = comm.bcast(not args.dir.exists())
    notes = list(NOTES)
    drop_note = None
    if rank == 0:
        scratch.mkdir(parents=True, mode=0o700)
        os.makedirs(cache_root, mode=0o700)
        kind = fs_type(scratch)
        if kind in ("tmpfs", "ramfs"):
            notes.append(f"WARNING: --dir {scratch} is on {kind}: the 'disk' writes go to memory")
        if args.no_drop_caches:
            drop_note = "page cache not dropped (--no-drop-caches)"
        else:
            why = _util.drop_caches()
            if why:
                drop_note = f"page cache not dropped: {why}"
        notes.append(
            drop_note or "before every measurement: sync; echo 3 > /proc/sys/vm/drop_caches"
        )
    drop = comm.bcast(drop_note is None)
    comm.Barrier()
    load_before = os.getloadavg()
    t_start = time.time()
    rows, samples = [], []
    info = machine_info(scratch, args.cache_root) if rank == 0 else None
    try:
        bench = Bench(args, scratch, cache_root, drop)
        for size in sizes:
            skip = None
            if rank == 0:
                need_mem = nranks * (4 * size + 2 * bench.kernel_bytes) + (512 << 20)
                if mem_available() < need_mem:
                    skip = (
                        f"needs about {need_mem / 2**30:.1f} GiB of memory (per rank: the "
                        "state, the memcpy buffer, the host buffers, the cache copy), "
                        f"{mem_available() / 2**30:.1f} GiB available"
                    )
                need_disk = 2 * nranks * size + (1 << 30)
                if shutil.disk_usage(scratch).free < need_disk:
                    skip = f"needs {need_disk / 2**30:.1f} GiB free in {scratch}"
            skip = comm.bcast(skip)
            if skip:
                if rank == 0:
                    print(f"{_util.size_label(size)}: skipped ({skip})", flush=True)
                rows.append({"bytes_per_rank": size, "skipped": skip})
                continue
            row, raw = bench.run_size(size)
            rows.append(row)
            samples.extend(raw)
    finally:
        if rank == 0:
            shutil.rmtree(cache_root, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)
            if made_dir:
                try:
                    args.dir.rmdir()  # made by this run, and empty now
                except OSError:
                    pass
    if rank != 0:
        return 0
    load_after = os.getloadavg()
    doc = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": [sys.executable, str(Path(__file__).relative_to(ROOT)), *argv],
        "nranks": nranks,
        "sizes": sizes,
        "reps": args.reps,
        "block_size": bench.bs,
        "kernel": {
            "what": "5-point Jacobi stencil, numpy, one core per rank",
            "array_bytes": bench.kernel_bytes,  # two of them (in and out)
            "iterations": bench.iters,
            "target_seconds": args.kernel_seconds,
        },
        "wall_seconds": round(time.time() - t_start, 1),
        "machine": info,
        "conditions": {
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "dir": str(args.dir.absolute()),
            "cache_root": str(args.cache_root.absolute()),
        },
        "notes": notes,
        "rows": rows,
        "samples": samples,
    }
    print(format_report(doc))
    out = args.json
    if out is None:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        out = HERE / "results" / f"async-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {out}")
    return 0


def summarize(size: int, raw: list[dict], first: dict, host_buffers: int, cache_bytes: int):
    meta = ("bytes_per_rank", "rep", "loadavg", "other_cores", "steal", "order")
    keys = [k for k in raw[0] if k not in meta]
    seconds = {k: _median([s[k] for s in raw]) for k in keys}
    min_max = {k: [min(s[k] for s in raw), max(s[k] for s in raw)] for k in keys}

    def ratio(a: str, b: str) -> float:
        return _median([s[a] / s[b] for s in raw])

    ratios = {
        "sync_x_memcpy": ratio("sync_blocked", "memcpy"),
        "memcpy_fresh_x_memcpy": ratio("memcpy_fresh", "memcpy"),
    }
    for v in ("async", "cache"):
        ratios[f"{v}_blocked_x_memcpy"] = ratio(f"{v}_blocked", "memcpy")
        ratios[f"{v}_first_x_later"] = first[v] / seconds[f"{v}_blocked"]
        ratios[f"{v}_blocked_x_sync"] = ratio(f"{v}_blocked", "sync_blocked")
        ratios[f"{v}_durable_x_sync"] = ratio(f"{v}_durable", "sync_blocked")
    staged = ("async", "cache")
    slowdown = {
        v: _median([s[f"{v}_kernel"] / s[f"{v}_kernel_alone"] - 1 for s in raw]) for v in staged
    }
    extra = {v: _median([s[f"{v}_kernel"] - s[f"{v}_kernel_alone"] for s in raw]) for v in staged}
    for v in staged:
        seconds[f"{v}_rest"] = _median(
            [s[f"{v}_blocked"] - sum(s[f"{v}_part_{k}"] for k in PARTS) for s in raw]
        )
    sd_range = {}
    for v in staged:
        per_rep = [s[f"{v}_kernel"] / s[f"{v}_kernel_alone"] - 1 for s in raw]
        sd_range[v] = [min(per_rep), max(per_rep)]
    return {
        "bytes_per_rank": size,
        "reps": len(raw),
        "seconds": seconds,
        "min_max": min_max,
        "ratios": ratios,
        "slowdown": slowdown,
        "slowdown_min_max": sd_range,
        "kernel_extra_seconds": extra,
        "background_write_seconds": {
            v: _median([s[f"{v}_durable"] - s[f"{v}_blocked"] for s in raw]) for v in staged
        },
        "first_save_seconds": first,
        "memory_per_rank": {"async_host_buffers": host_buffers, "cache_copy": cache_bytes},
        "loadavg": [s["loadavg"] for s in raw],
        "other_cores": [s["other_cores"] for s in raw],
        "steal": [s["steal"] for s in raw],
    }


# -- report ------------------------------------------------------------------------------------


def format_report(doc: dict) -> str:
    n, reps = doc["nranks"], doc["reps"]
    k = doc["kernel"]
    lines = [
        f"{n} ranks, float64 state per rank, median of {reps} (min-max); "
        f"load average {doc['conditions']['loadavg_before'][0]:.1f} before, "
        f"{doc['conditions']['loadavg_after'][0]:.1f} after; {doc['machine']['cores']} cores",
        *[f"- {note}" for note in doc["notes"]],
        "",
        "| size/rank | save | blocked s (min-max) | x memcpy | x sync | durable commit s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    rows = [r for r in doc["rows"] if "skipped" not in r]
    for r in rows:
        s, mm, ra = r["seconds"], r["min_max"], r["ratios"]
        size = _util.size_label(r["bytes_per_rank"])

        def rng(key: str, s=s, mm=mm) -> str:
            return f"{s[key]:.3f} ({mm[key][0]:.3f}-{mm[key][1]:.3f})"

        lines.append(f"| {size} | memcpy (np.copyto, the yardstick) | {rng('memcpy')} | 1 | | |")
        fresh = ra["memcpy_fresh_x_memcpy"]
        lines.append(
            f"| {size} | memcpy into the buffer filled just before | {rng('memcpy_fresh')} | "
            f"{fresh:.2f} | | |"
        )
        lines.append(
            f"| {size} | direct `save` | {rng('sync_blocked')} | "
            f"{ra['sync_x_memcpy']:.1f} | 1 | {s['sync_blocked']:.3f} |"
        )
        for v, what in (("async", "`async_save=True`"), ("cache", "`cache=/dev/shm/...`")):
            lines.append(
                f"| {size} | {what} | {rng(f'{v}_blocked')} | "
                f"{ra[f'{v}_blocked_x_memcpy']:.1f} | {ra[f'{v}_blocked_x_sync']:.2f} | "
                f"{s[f'{v}_durable']:.3f} |"
            )
    for r in rows:
        ra = r["ratios"]
        goals = {
            "async <= 1.2x memcpy": ra["async_blocked_x_memcpy"] <= 1.2,
            "cache <= 1.2x memcpy": ra["cache_blocked_x_memcpy"] <= 1.2,
            "first async <= 2x later": ra["async_first_x_later"] <= 2.0,
            "first cache <= 2x later": ra["cache_first_x_later"] <= 2.0,
            "staging within budget at every save": r["memory_per_rank"]["saves_over_budget"] == 0,
        }
        r["goals"] = goals
    lines += [
        "",
        "Goals: "
        + "; ".join(
            f"{_util.size_label(r['bytes_per_rank'])}: "
            + ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in r["goals"].items())
            for r in rows
        ),
        "",
        "x memcpy, x sync: per-repetition ratios of the blocked time, median. The durable",
        "commit is bound by the disk and moves with it (see the direct save's range).",
        "",
        "Where the blocked time goes (inside the save, slowest rank, medians, s):",
        "",
        "| size/rank | save | blocked | staging: copy + hash | removing the previous copy | "
        "creating the file (collective) | rest | memcpy | hash alone |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["seconds"]
        for v, what, stage in (
            ("async", "async", "into host buffers"),
            ("cache", "cache", "written to the cache"),
        ):
            lines.append(
                f"| {_util.size_label(r['bytes_per_rank'])} | {what} | {s[f'{v}_blocked']:.3f} | "
                f"{s[f'{v}_part_stage']:.3f} ({stage}) | "
                + (f"{s[f'{v}_part_cache_remove']:.3f}" if v == "cache" else "")
                + f" | {s[f'{v}_part_create_file']:.3f} | {s[f'{v}_rest']:.3f} | "
                f"{s['memcpy']:.3f} | {s['hash']:.3f} |"
            )
    lines += [
        "",
        "creating the file: write_file (the ranks agree on the layout, HDF5 creates the",
        "file and its metadata collectively, no array bytes); rest = blocked -",
        "the parts: the encode and directory checks, the ranks' agreements, heartbeats, events,",
        "starting the thread (per repetition, then the median).",
        "",
        f"Compute slowdown: {k['iterations']} iterations of a 5-point stencil over two "
        f"{k['array_bytes'] / 2**20:.0f} MiB arrays per rank, started as soon as save() returns",
        "",
        "| size/rank | alone s | during async write s | slowdown (min..max) | "
        "alone s | during cache drain s | slowdown (min..max) | background write s "
        "(async / cache) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s, bg = r["seconds"], r["background_write_seconds"]
        cells = []
        for v in ("async", "cache"):
            sd, (lo, hi) = r["slowdown"][v], r["slowdown_min_max"][v]
            cells.append(
                f"{s[f'{v}_kernel_alone']:.3f} | {s[f'{v}_kernel']:.3f} | "
                f"{100 * sd:+.0f} % ({100 * lo:+.0f}..{100 * hi:+.0f})"
            )
        lines.append(
            f"| {_util.size_label(r['bytes_per_rank'])} | {cells[0]} | {cells[1]} | "
            f"{bg['async']:.2f} / {bg['cache']:.2f} |"
        )
    lines += [
        "",
        "slowdown = (kernel during the write) / (the kernel alone, run right before or after)",
        "- 1, per repetition, median (min..max);",
        "background write = durable - blocked (no compute running). When it is shorter than",
        "the kernel, only part of the kernel overlaps the write.",
        "",
        "Memory per rank and first (untimed) save:",
    ]
    for r in rows:
        m, f = r["memory_per_rank"], r["first_save_seconds"]
        lines.append(
            f"  {_util.size_label(r['bytes_per_rank']):>5}: host buffers "
            f"{m['async_host_buffers'] / 2**20:.0f} MiB (peak over {m['saves_measured']} saves: "
            f"{m['async_staging_peak'] / 2**20:.0f} MiB held, "
            f"{m['async_staging_rss_peak'] / 2**20:.0f} MiB resident; budget "
            f"{_mib(m['staging_budget'])}, {m['saves_over_budget']} saves over it), cache copy "
            f"{m['cache_copy'] / 2**20:.0f} MiB and its host buffers "
            f"{m['cache_host_buffers'] / 2**20:.0f} MiB; first save blocked: "
            f"sync {f['sync']:.3f} s, "
            f"async {f['async']:.3f} s ({r['ratios']['async_first_x_later']:.1f}x a later one),"
            f" cache {f['cache']:.3f} s ({r['ratios']['cache_first_x_later']:.1f}x)"
        )
    lines.append("Other work on the machine during the repetitions (cores busy outside the ranks,")
    lines.append("incl. kernel writeback threads; steal = time the hypervisor took):")
    for r in rows:
        oc, st = r["other_cores"], r["steal"]
        lines.append(
            f"  {_util.size_label(r['bytes_per_rank']):>5}: other work {_median(oc):.2f} cores "
            f"median ({min(oc):.2f}-{max(oc):.2f}), steal {100 * _median(st):.1f} % "
            f"({100 * min(st):.1f}-{100 * max(st):.1f})"
        )
    for r in doc["rows"]:
        if "skipped" in r:
            lines.append(f"  {_util.size_label(r['bytes_per_rank']):>5}: skipped: {r['skipped']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not _under_mpi():
        return launch(args.nranks, argv)
    return worker(args, argv)


if __name__ == "__main__":
    sys.exit(main())
