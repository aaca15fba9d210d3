"""Checksums of array bytes: xxh3-64, fast enough to run on every save and restore."""

from __future__ import annotations

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
