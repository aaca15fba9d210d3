"""Fixtures of the store's tests."""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.io import direct_io
from hpcckpt.store.store import CheckpointStore


def small_state(k: float) -> dict:
    """A small state whose values all depend on ``k``: 1000 float64 and a nested dict."""
    return {"u": np.arange(1000.0) * k, "meta": {"k": k, "name": "run"}}


@pytest.fixture
def make_state():
    """:func:`small_state`, for the store's tests in one process."""
    return small_state


@pytest.fixture
def store(tmp_path):
    """A store of ``tmp_path/ck`` in one process (MPI.COMM_SELF), default options."""
    return CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)


@pytest.fixture
def trackers_released():
    """Write trackers left by earlier tests (of any module) are closed before this test
    allocates, and this test's before the next: a tracker dropped without close() keeps
    its memory registered until the garbage collector finalizes it, and a new array at
    those addresses could not be registered (EBUSY)."""
    gc.collect()
    yield
    gc.collect()


def drop_from_cache(path) -> None:
    """Write the file back and drop it from the page cache (as after a restart), and
    check that it is gone: the kernel may keep pages it is still writing back."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(50):
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            left = direct_io.resident_pages(fd, 0, os.fstat(fd).st_size)
            if left == 0:
                return
            time.sleep(0.02)
    finally:
        os.close(fd)
    pytest.fail(f"{left} pages of {path} stay in the page cache after fsync + FADV_DONTNEED")


@pytest.fixture
def uncached():
    """:func:`drop_from_cache`."""
    return drop_from_cache


@pytest.fixture
def read_past(monkeypatch):
    """The bytes each direct read of a restore read past the page cache (the real
    ``direct_io._read_shifted`` runs)."""
    counts: list[int] = []
    real = direct_io._read_shifted

    def counted(*args, **kwargs):
        counts.append(real(*args, **kwargs))
        return counts[-1]

    monkeypatch.setattr(direct_io, "_read_shifted", counted)
    return counts
