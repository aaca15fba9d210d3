"""Fixtures of the store's tests."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture
def trackers_released():
    """The test's write trackers are closed before the next test allocates: a tracker
    dropped without close() keeps its memory registered until the garbage collector
    finalizes it, and a new array at those addresses could not be registered (EBUSY)."""
    yield
    gc.collect()
