"""How many bounce buffers a cold restore's direct reads hold, and what a cap costs.

    .venv/bin/python benchmarks/experiments/ring_cap.py [--size 1G] [--arrays 12]
        [--caps 1000,16,8,4] [--repeat 4]

One process, no MPI: ``--arrays`` arrays of ``--size`` in all are written to one file,
then read back in place ``--repeat`` times per cap, cold (the file dropped from the
page cache before each), by two threads through one :class:`HashedReads` as a
restore's :meth:`read_all` does (``read_plan.READERS``). Per cap
(``bounce.RING_BUFFERS``; 1000 is none in practice): the median seconds and the
buffers the ring made (its most out at once) in each run. The caps take turns in a
rotated order; each run's bytes and hashes are checked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.append(str(HERE.parent.parent))  # after PYTHONPATH: another tree's code can be measured

import _util  # noqa: E402

from hpcckpt.store.io import bounce, direct_io  # noqa: E402
from hpcckpt.store.restore import read_plan  # noqa: E402

BLOCK = 1 << 20
HEAD = 400  # the arrays start unaligned in the file, as a checkpoint's do


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G", help="bytes in all")
    ap.add_argument("--arrays", type=int, default=12)
    ap.add_argument("--caps", default="1000,16,8,4")
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--root", default="/var/tmp/hpcckpt-bench/ring_cap")
    args = ap.parse_args()
    caps = [int(c) for c in args.caps.split(",")]
    each = _util.parse_size(args.size) // args.arrays + 3 * direct_io.ALIGN + 16
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, each, dtype=np.uint8) for _ in range(args.arrays)]
    os.makedirs(args.root, exist_ok=True)
    path = os.path.join(args.root, "f")
    with open(path, "wb") as f:
        f.write(b"h" * HEAD)
        for a in arrays:
            f.write(a.tobytes())
    want = [
        direct_io.read_hashed(path, HEAD + i * each, memoryview(a), BLOCK)
        for i, a in enumerate(arrays)
    ]
    outs = [np.empty(each, dtype=np.uint8) for _ in arrays]
    runs: dict[int, list[tuple[float, int]]] = {c: [] for c in caps}
    for rep in range(args.repeat):
        for cap in caps[rep % len(caps) :] + caps[: rep % len(caps)]:
            bounce.RING_BUFFERS = cap
            for out in outs:
                out[:] = 0
            drop(path)
            start = time.perf_counter()
            with direct_io.HashedReads() as reads:
                with ThreadPoolExecutor(read_plan.READERS) as pool:
                    started = [
                        pool.submit(reads.start, path, HEAD + i * each, memoryview(out), BLOCK)
                        for i, out in enumerate(outs)
                    ]
                    finishes = [f.result() for f in started]
                got = [finish() for finish in finishes]
                made = reads.ring().made
            runs[cap].append((time.perf_counter() - start, made))
            exact = all(np.array_equal(o, a) for o, a in zip(outs, arrays, strict=True))
            if not exact or not all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)):
                sys.exit(f"a read with cap {cap} was not exact")
    os.unlink(path)
    for cap, took in runs.items():
        seconds = [round(s, 3) for s, _ in took]
        print(
            f"cap {cap}: median {statistics.median(seconds):.3f} s, all {seconds}, buffers "
            f"made {[m for _, m in took]}; load average {os.getloadavg()[0]:.1f}"
        )


def drop(path: str) -> None:
    """``path`` written back and out of the page cache (checked)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(50):
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if direct_io.resident_pages(fd, 0, os.fstat(fd).st_size) == 0:
                return
            time.sleep(0.02)
    finally:
        os.close(fd)
    sys.exit(f"{path} stays in the page cache")


if __name__ == "__main__":
    main()
