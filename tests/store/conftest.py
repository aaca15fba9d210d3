"""Fixtures of the store's tests."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture
def trackers_released():
    """Write trackers left by earlier tests (of any module) are closed before this test
    allocates, and this test's before the next: a tracker dropped without close() keeps
    its memory registered until the garbage collector finalizes it, and a new array at
    those addresses could not be registered (EBUSY)."""
    gc.collect()
    yield
    gc.collect()
