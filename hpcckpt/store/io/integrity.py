"""Checksums of array bytes: xxh3-64, fast enough to run on every save and restore.

Measure the throughput on this machine with ``python -m hpcckpt.store.io.integrity``.
"""

from __future__ import annotations

import time

import numpy as np
import xxhash

ALGORITHM = "xxh3_64"


def checksum(data: np.ndarray | bytes) -> int:
    """xxh3-64 of the C-order bytes of ``data`` (an array or raw bytes)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
        if data.size == 0:
            return xxhash.xxh3_64_intdigest(b"")
        return xxhash.xxh3_64_intdigest(memoryview(data).cast("B"))
    return xxhash.xxh3_64_intdigest(data)


def throughput(mib: int = 256, repeat: int = 5) -> float:
    """Bytes per second ``checksum`` reaches on one core over ``mib`` MiB (best of ``repeat``)."""
    data = np.random.default_rng(0).integers(0, 255, size=mib * 2**20, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        checksum(data)
        best = min(best, time.perf_counter() - t0)
    return data.nbytes / best


if __name__ == "__main__":  # pragma: no cover
    rate = throughput()
    print(f"{ALGORITHM}: {rate / 2**20:.0f} MiB/s ({rate / 1e9:.2f} GB/s) on one core, 256 MiB")
