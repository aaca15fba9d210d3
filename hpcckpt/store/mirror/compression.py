"""Lossless compression of the mirror's copies: zstd, with the bytes of float arrays
grouped by their position in the element first (byte-grouping, "shuffle": exponents
beside exponents), streamed in frames of at most :data:`FRAME` bytes.

An encoded object is :data:`MAGIC`, then frames: a header ``<BII`` (the element width
its bytes were grouped by, 0 for none; the frame's bytes before and after compression)
and the zstd frame. The manifest keeps the hashes of the checkpoint's own bytes, which a
pull checks after decoding. Needs the ``zstandard`` package (``hpcckpt[compress]``).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO

import numpy as np

try:  # the optional extra; the mirror works without it, uncompressed
    import zstandard
except ImportError as _missing:  # pragma: no cover - exercised in a subprocess by the tests
    zstandard = None
    MISSING = str(_missing)
else:
    MISSING = ""

MAGIC = b"HPCCKPT-ZSTD1\n"
HEADER = struct.Struct("<BII")
#: Bytes of a frame before compression: zstd's window and the grouping's copy stay small.
FRAME = 4 << 20
#: zstd's level: measured on training state and a PDE field (benchmarks/bench_mirror.py),
#: level 3 stored as much or 1 % less for a fifth less speed.
LEVEL = 1
#: The encoding's name in a manifest.
ENCODING = "zstd-shuffle"
CHOICES = ("auto", "zstd")
INSTALL = "pip install 'hpcckpt[compress]'"


def available() -> bool:
    """Whether the compressor can be used (``zstandard`` installed)."""
    return zstandard is not None


def check_choice(value: str | None) -> str | None:
    """``mirror_compress`` checked: None (off), "zstd" (always) or "auto"."""
    if value is None or value is False:
        return None
    text = str(value).strip().lower()
    if text in ("", "none", "off", "no", "false"):
        return None
    if text not in CHOICES:
        raise ValueError(f"mirror_compress={value!r}: give None, 'auto' or 'zstd'")
    if text == "zstd" and zstandard is None:
        raise ValueError(f"mirror_compress='zstd' needs the zstandard package: {INSTALL}")
    return text


#: Before a copy was compressed in this process: the compressor's bytes/s and the ratio
#: (stored / original) assumed, from the figures of docs/tiers.md (training state, one
#: core, level 1: 204 MB/s, 0.78).
PRIOR_RATE = 200e6
PRIOR_RATIO = 0.8
#: "auto" compresses only when it makes the copy this much faster.
MARGIN = 1.1


class Rates:
    """What this process saw of the store and the compressor, for ``"auto"``: the store's
    bytes/s (a cap where one is set, else measured over the last uncompressed copy) and
    the compressor's bytes/s and ratio over the last compressed one."""

    def __init__(self) -> None:
        self.store: float | None = None
        self.compressor = PRIOR_RATE
        self.ratio = PRIOR_RATIO

    def pays(self, cap: float | None) -> bool:
        """Whether compressing makes a copy faster: the pipeline moves
        min(compressor, store / ratio) bytes of checkpoint per second, against the store
        alone; unknown (no cap, nothing measured yet) is no."""
        store = cap if cap is not None else self.store
        if store is None or self.ratio >= 1:
            return False
        return min(self.compressor, store / self.ratio) >= MARGIN * store

    def note(self, raw: int, stored: int, seconds: float, encoder: Encoder | None) -> None:
        """Record one copy: ``raw`` checkpoint bytes stored as ``stored`` in ``seconds``."""
        if seconds <= 0 or raw <= 0:
            return
        if encoder is None:
            self.store = stored / seconds
        else:
            if encoder.seconds > 0:
                self.compressor = raw / encoder.seconds
            self.ratio = stored / raw


def shuffle(raw: bytes | memoryview, width: int) -> bytes:
    """The bytes grouped by position in each ``width``-byte element (a tail shorter than
    one element stays as it is)."""
    if width <= 1:
        return bytes(raw)
    a = np.frombuffer(raw, dtype=np.uint8)
    whole = (a.size // width) * width
    grouped = a[:whole].reshape(-1, width).T.tobytes()
    return grouped + a[whole:].tobytes()


def unshuffle(data: bytes, width: int) -> bytes:
    """The inverse of :func:`shuffle`."""
    if width <= 1:
        return data
    a = np.frombuffer(data, dtype=np.uint8)
    whole = (a.size // width) * width
    back = a[:whole].reshape(width, -1).T.tobytes()
    return back + a[whole:].tobytes()


class Encoder:
    """Turns the file's bytes, handed in order, into the encoded object's bytes.

    ``width_at(offset)`` gives the element width to group by from a file offset and the
    offset where that width stops applying (the checkpoint's float arrays, from
    :class:`~.mirror.source.SourceCheck`); frames never cross such a boundary.
    """

    def __init__(self, width_at: Callable[[int], tuple[int, int]] | None = None) -> None:
        if zstandard is None:
            raise ValueError(f"compressing the mirror's copies needs zstandard: {INSTALL}")
        self.width_at = width_at or (lambda offset: (0, 1 << 62))
        self.z = zstandard.ZstdCompressor(level=LEVEL)
        self.raw = 0
        self.out = 0
        self.seconds = 0.0

    def encode(self, pieces: Iterable[bytes]) -> Iterator[bytes]:
        """The encoded object, in pieces (the magic first)."""
        self.out += len(MAGIC)
        yield MAGIC
        for piece in pieces:
            view = memoryview(piece)
            pos = 0
            while pos < len(view):
                width, until = self.width_at(self.raw)
                n = min(len(view) - pos, FRAME, max(1, until - self.raw))
                t0 = time.perf_counter()
                frame = self.z.compress(shuffle(view[pos : pos + n], width))
                self.seconds += time.perf_counter() - t0
                out = HEADER.pack(width, n, len(frame)) + frame
                self.raw += n
                self.out += len(out)
                pos += n
                yield out


def decode(src: BinaryIO, write: Callable[[bytes], object]) -> int:
    """Decode an encoded object read from ``src``, handing each frame's original bytes to
    ``write`` in order; the bytes decoded. ValueError when the object is not one."""
    if zstandard is None:
        raise ValueError(f"this mirrored copy is compressed; reading it needs zstandard: {INSTALL}")
    if src.read(len(MAGIC)) != MAGIC:
        raise ValueError("not an hpcckpt zstd object (its first bytes differ)")
    z = zstandard.ZstdDecompressor()
    total = 0
    while head := src.read(HEADER.size):
        if len(head) < HEADER.size:
            raise ValueError(f"the object is cut in a frame header after {total} bytes")
        width, raw, size = HEADER.unpack(head)
        if raw > FRAME or size > 2 * FRAME + 1024:
            raise ValueError(f"a frame of {raw} -> {size} bytes is not one this encoder writes")
        frame = src.read(size)
        if len(frame) < size:
            raise ValueError(f"the object is cut in a frame after {total} bytes")
        data = unshuffle(z.decompress(frame, max_output_size=raw), width)
        if len(data) != raw:
            raise ValueError(f"a frame decoded to {len(data)} bytes, its header says {raw}")
        write(data)
        total += raw
    return total
