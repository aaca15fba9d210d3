"""What a cold same-rank restore's read costs, apart from torch and DCP.

Usage: ``python benchmarks/bench_cold_read.py [--size 256M] [--arrays 12] [--repeat 5]
[--variants d2x2,s2x8,b2x16] [--torch | --fsdp] [--disk]``.

Without ``--disk``: 2 ranks (under ``mpirun``, started here) save ``--arrays`` float32
arrays of ``--size`` per rank in all (plus as many small ones, as an FSDP model's
biases) with :class:`CheckpointStore`, then restore them in place ``--repeat`` times,
each after the page cache was dropped; prints the slowest rank's median seconds. To
compare two versions of the code, run it with ``PYTHONPATH`` set to each in turn. With
``--variants d2x2,d2x8,b2x16``: each repetition restores once per variant in turn, and
each variant's median ratio to the first one's time of the same repetition is printed
too (pairs taken minutes apart would differ by the machine's load alone). A variant is
``[d|s|b]READERSxMIB``: arrays read at once, and how a cold extent is read
(``direct_io.COLD_READ``, ``DIRECT_BOUNCE``): ``d`` (or nothing) past the page cache in
MIB pieces into huge-page buffers copied in place, ``s`` straight into the destination,
``b`` through the page cache in MIB pieces. ``--torch``: the state as torch tensors
(torch's allocator).
``--fsdp``: ``bench_fsdp.py``'s state and restore instead (:func:`fsdp_restores`), each
variant paired with DCP's restore of the same state.

With ``--disk``: what the disk itself does with one file of twice ``--size``, cold
(page cache dropped before each read): ``O_DIRECT`` reads of 1, 4, 8 and 16 MiB at 1, 2
and 4 requests in flight, and buffered reads of 1 and 8 MiB (the kernel's readahead),
each by two processes at once reading one half each, as two ranks do.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing import Barrier, Process, Queue
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parent))  # after PYTHONPATH: another tree's code can be measured

import _util  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256M", help="bytes per rank")
    ap.add_argument("--arrays", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--root", default="/var/tmp/hpcckpt-bench/cold_read")
    ap.add_argument("--variants", default="", help="READERSxMIB,... compared in turn")
    ap.add_argument("--torch", action="store_true", help="the state as torch tensors")
    ap.add_argument("--fsdp", action="store_true", help="an FSDP2 model + AdamW, DCP beside")
    ap.add_argument("--disk", action="store_true", help="measure the disk instead")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def restores(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    from hpcckpt.store.store import CheckpointStore

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    each = _util.parse_size(args.size) // args.arrays // 4
    rng = np.random.default_rng(rank)
    state = {f"w{i}": rng.random(each, dtype=np.float32) for i in range(args.arrays)}
    state.update({f"b{i}": rng.random(1024, dtype=np.float32) for i in range(args.arrays)})
    if args.torch:  # memory from torch's allocator, as a model's and an optimizer's
        import torch

        state = {k: torch.from_numpy(v).clone() for k, v in state.items()}
    store = CheckpointStore(args.root, comm, incremental=False)
    store.save(1, state)
    want = {k: np.array(v, copy=True) for k, v in state.items()}
    cold = _util.ColdCache(comm)
    variants = [v for v in args.variants.split(",") if v] or ["default"]
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeat):
        for variant in variants:
            if variant != "default":
                configure(variant)
            for v in state.values():
                v[...] = 0
            cold()
            start = time.perf_counter()
            store.restore(state)
            seconds[variant].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
            if not all(np.array_equal(np.asarray(state[k]), want[k]) for k in want):
                sys.exit("a restore was not exact")
    if rank == 0:
        first = np.array(seconds[variants[0]])
        for variant, took in seconds.items():
            ratio = float(np.median(np.array(took) / first))
            print(
                f"cold restore in place, 2 ranks x {args.size} ({args.arrays} large "
                f"{'tensors' if args.torch else 'arrays'}), "
                f"{variant}: median {statistics.median(took):.3f} s (x{ratio:.3f} of "
                f"{variants[0]}, paired), all {[round(s, 3) for s in took]}; drop: "
                f"{cold.problem or 'ok'}; load average {os.getloadavg()[0]:.1f}"
            )


def fsdp_restores(args: argparse.Namespace) -> None:
    """The restore of ``bench_fsdp.py``'s state (an FSDP2 MLP of 4 layers + AdamW, gloo,
    ``--size`` per rank) by ``Checkpointer.restore`` once per variant and by DCP
    (``dcp.load`` + ``set_state_dict``), in turn, cold, in a rotated order, in one
    process: each median is also given as a ratio to DCP's time of the same repetition."""

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from mpi4py import MPI
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import hpcckpt

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    _util.gloo_over_mpi(comm)
    width = max(8, int((2 * _util.parse_size(args.size) / 12 / 4) ** 0.5))  # as bench_fsdp
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).square().mean().backward()
    optim.step()
    tensors = list(model.parameters())
    tensors += [v for st in optim.state.values() for v in st.values() if torch.is_tensor(v)]
    locals_ = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    want = [t.clone() for t in locals_]
    state = {"model": model, "optim": optim}
    root = Path(args.root)
    ck = hpcckpt.Checkpointer(
        root / "hpcckpt", comm, every_steps=1, keep_last=None, incremental=False, validate=None
    )
    ck.restore(state)
    ck.save(1, state)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / "dcp"))
    cold = _util.ColdCache(comm)
    methods = [v for v in args.variants.split(",") if v] or ["default"]
    methods.append("dcp")
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    for rep in range(args.repeat):
        for method in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
            with torch.no_grad():
                for t in locals_:
                    t.zero_()
            cold()
            start = time.perf_counter()
            if method == "dcp":
                msd, osd = get_state_dict(model, optim)
                sd = {"model": msd, "optim": osd}
                dcp.load(sd, checkpoint_id=str(root / "dcp"))
                set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=osd)
            else:
                if method != "default":
                    configure(method)
                ck.restore(state)
            seconds[method].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
            if not all(torch.equal(t, w) for t, w in zip(locals_, want, strict=True)):
                sys.exit(f"a restore ({method}) was not exact")
    ck.finish()
    dist.destroy_process_group()
    if rank == 0:
        dcp_s = seconds["dcp"]
        for method, took in seconds.items():
            ratio = statistics.median([a / b for a, b in zip(took, dcp_s, strict=True)])
            print(
                f"cold FSDP restore, 2 ranks x {args.size}, {method}: median "
                f"{statistics.median(took):.3f} s (x{ratio:.3f} of DCP, paired), all "
                f"{[round(s, 3) for s in took]}; drop: {cold.problem or 'ok'}; "
                f"load average {os.getloadavg()[0]:.1f}"
            )


_RING_BUFFERS: dict[int, int] = {}  # the ring's cap as the code has it


def configure(variant: str) -> None:
    """Set the restore's cold read to ``variant``: ``[d|s|b]READERSxMIB[cBUFFERS]``, ``d``
    (the default) past the page cache in MIB pieces through huge-page buffers, at most
    BUFFERS of them (the code's cap without it), ``s`` the same straight into the
    destination (moved by up to a page), ``b`` through the page cache in MIB pieces."""
    from hpcckpt.store.io import bounce, direct_io
    from hpcckpt.store.restore import read_plan

    mode = "buffered" if variant[0] == "b" else "direct"
    readers, mib = variant.lstrip("dbs").split("x")
    mib, _, cap = mib.partition("c")  # cBUFFERS: the ring's cap (bounce.RING_BUFFERS)
    default = _RING_BUFFERS.setdefault(0, bounce.RING_BUFFERS)
    bounce.RING_BUFFERS = int(cap) if cap else default
    read_plan.READERS = int(readers)
    direct_io.COLD_READ = mode
    direct_io.DIRECT_BOUNCE = variant[0] != "s"
    if mode == "direct":
        direct_io.DIRECT_READ_PIECE_BYTES = int(mib) << 20
    else:
        direct_io.READ_PIECE_BYTES = int(mib) << 20


def _reader(path: str, part: int, half: int, bs: int, qd: int, direct: bool, q, bar) -> None:
    buf = mmap.mmap(-1, half)
    view = memoryview(buf)
    view[:] = b"\1" * half  # touched, as an application's arrays
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    todo = iter(range(0, half, bs))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                at = next(todo, None)
            if at is None:
                return
            os.preadv(fd, [view[at : at + bs]], part * half + at)

    bar.wait()
    start = time.perf_counter()
    threads = [threading.Thread(target=work) for _ in range(qd)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q.put(time.perf_counter() - start)
    os.close(fd)


def disk(args: argparse.Namespace) -> None:
    half = _util.parse_size(args.size) // (1 << 20) << 20
    Path(args.root).mkdir(parents=True, exist_ok=True)
    path = str(Path(args.root) / "disk.bin")
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as fh:
        for _ in range(2 * half >> 20):
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    cases = [(False, 1, 1), (False, 8, 1)]
    cases += [(True, mib, qd) for mib in (1, 4, 8, 16) for qd in (1, 2, 4)]
    try:
        for _ in range(args.repeat):
            for direct, mib, qd in cases:
                if problem := _util.drop_caches():
                    sys.exit(problem)
                q: Queue = Queue()
                bar = Barrier(2)
                procs = [
                    Process(target=_reader, args=(path, p, half, mib << 20, qd, direct, q, bar))
                    for p in range(2)
                ]
                for p in procs:
                    p.start()
                for p in procs:
                    p.join()
                took = max(q.get(), q.get())
                kind = "O_DIRECT" if direct else "buffered"
                print(
                    f"{kind:8} {mib:2} MiB x {qd} in flight, 2 processes: "
                    f"{2 * half / took / 1e9:.2f} GB/s ({took * 1000:.0f} ms), "
                    f"load average {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    finally:
        os.unlink(path)


def main() -> None:
    args = parse()
    if args.disk:
        disk(args)
        return
    if args.worker:
        fsdp_restores(args) if args.fsdp else restores(args)
        return
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        sys.exit("mpirun not found: install Open MPI (make setup does)")
    shutil.rmtree(args.root, ignore_errors=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    argv = [mpirun, "-n", "2", "--oversubscribe", sys.executable, "-m", "mpi4py"]
    argv += [__file__, "--worker", "--size", args.size, "--arrays", str(args.arrays)]
    argv += ["--repeat", str(args.repeat), "--root", args.root, "--variants", args.variants]
    argv += ["--torch"] if args.torch else []
    argv += ["--fsdp"] if args.fsdp else []
    try:
        subprocess.run(argv, env=env, check=True)
    finally:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
