"""A request body over the bytes of an S3 part that a save can hold mid-request.

The part goes out in slices of at least :data:`SLICE` bytes, views of the part's own
buffer (no copy; fewer system calls than the HTTP client's small blocks). Between two
slices the mirror worker's gate may keep the request waiting while a save writes, so
that the parts already in flight when a save begins stop too, not only those not yet
started; never longer than :data:`HOLD` seconds per pass over the body.
"""

from __future__ import annotations

import inspect
import io
import time
from collections.abc import Callable
from typing import Any

#: Bytes per slice; seconds a pass over a body may be held in all (below the idle timeout
#: of S3 stores, about 20 s on AWS, after which the store drops the request).
SLICE = 1 << 20
HOLD = 5.0


class PartBody(io.RawIOBase):
    """A request's body over the bytes of a part, handed out in slices of at least
    :data:`SLICE` bytes without a copy (fewer system calls than the client's small
    blocks); before each slice past the first, ``hold`` may keep the request waiting
    (a save writes), at most :data:`HOLD` seconds per pass over the body."""

    def __init__(self, data: bytes, hold: Callable[[float], None] | None) -> None:
        super().__init__()
        self._view = memoryview(data)
        self._pos = 0
        self._hold = hold
        self._held = 0.0

    def __len__(self) -> int:
        return len(self._view)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = min(max(base + offset, 0), len(self._view))
        if self._pos == 0:
            self._held = 0.0  # a new pass: signing, then sending, or a retry
        return self._pos

    def read(self, size: int | None = -1) -> bytes | memoryview:  # type: ignore[override]
        if self._pos and self._hold is not None and self._held < HOLD:
            t0 = time.monotonic()
            self._hold(HOLD - self._held)
            self._held += time.monotonic() - t0
        left = len(self._view) - self._pos
        if left <= 0:
            return b""
        n = left if size is None or size < 0 else min(left, max(size, SLICE))
        piece = self._view[self._pos : self._pos + n]
        self._pos += n
        return piece

    def readinto(self, buffer: Any) -> int:
        piece = self.read(len(buffer))
        n = min(len(piece), len(buffer))
        buffer[:n] = piece[:n]
        self._pos -= len(piece) - n
        return n


def holder(pause: Callable[..., None] | None) -> Callable[[float], None] | None:
    """``pause`` as a hold of at most a given time, when it takes a ``timeout`` (the
    mirror worker's gate); None otherwise (held only between requests)."""
    if pause is None:
        return None
    try:
        takes = "timeout" in inspect.signature(pause).parameters
    except (TypeError, ValueError):
        return None
    return (lambda seconds: pause(timeout=seconds)) if takes else None
