"""Boxes of a DTensor read from the pieces stored (hpcckpt/store/restore/pieces.py), on a
file two real ranks saved (tests/store/apps/dtensor_app.py under mpirun): the blocks of a
box are read as the planned read reads, hashed piece by piece and past the page cache
when cold, and what the file lacks is damage, not a short array."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io import direct_io
from hpcckpt.store.restore.pieces import PieceReader
from tests.mpi_helpers import ROOT, mpirun

pytestmark = [pytest.mark.mpi]

APP = ROOT / "tests" / "store" / "apps" / "dtensor_app.py"
FILE = "ckpt-0000000005.h5"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The app's tensors saved by 2 ranks on a 1-D mesh: 't/big' (64 x 256 float32,
    4 KiB blocks of 4 rows) as two Shard(0) pieces of 32 rows."""
    directory = tmp_path_factory.mktemp("pieces") / "ck"
    out = directory.parent / "save.json"
    proc = mpirun(2, [APP, directory, "save", "--mesh", "2", "--out", out], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return directory / FILE


def drop_pages(path: Path) -> None:
    """Take ``path``'s pages out of the page cache (they are clean: fsynced first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_cold_box_is_read_past_the_page_cache_and_verified(saved, tmp_path, monkeypatch):
    path = tmp_path / FILE
    shutil.copy(saved, path)
    with CheckpointReader(path) as reader:
        whole = PieceReader(reader).whole("t/big")
    shifted: list[int] = []
    real = direct_io._read_shifted

    def spy(*args, **kwargs):
        shifted.append(len(args[2]))
        return real(*args, **kwargs)

    # The app's pieces are 32 KiB: let them count as large enough for direct reads.
    monkeypatch.setattr(direct_io, "MIN_DIRECT_BYTES", 4096)
    monkeypatch.setattr(direct_io, "_read_shifted", spy)
    with CheckpointReader(path, direct_io=True) as reader:
        drop_pages(path)
        boxes = PieceReader(reader)
        out = np.full((16, 256), -1.0, dtype=np.float32)
        got = boxes.box("t/big", (32, 0), (16, 256), out)  # rank 1's first 4 blocks
        assert got is out and np.array_equal(out, whole[32:48])
        assert shifted == [16 * 1024], shifted  # read straight into it, past the cache
        assert boxes.bytes_read == 16 * 1024
        drop_pages(path)
        across = PieceReader(reader)
        got = across.box("t/big", (30, 0), (20, 256))  # rows 30-31 of rank 0, 32-49 of rank 1
    assert np.array_equal(got, whole[30:50])
    assert across.bytes_read == 4 * 1024 + 16 * 1024 + 4 * 1024  # rows 28-31, 32-47, 48-51


def test_a_box_across_pieces_opens_one_direct_descriptor(saved, tmp_path, monkeypatch):
    """The runs of one box (here three, of two pieces) share one direct descriptor and
    one hashing thread, both ended with the box."""
    import threading

    path = tmp_path / FILE
    shutil.copy(saved, path)
    with CheckpointReader(path) as reader:
        whole = PieceReader(reader).whole("t/big")
    monkeypatch.setattr(direct_io, "MIN_DIRECT_BYTES", 4096)
    shifted: list[int] = []
    real_shifted = direct_io._read_shifted

    def spy(*args, **kwargs):
        shifted.append(len(args[2]))
        return real_shifted(*args, **kwargs)

    monkeypatch.setattr(direct_io, "_read_shifted", spy)
    opens: list[str] = []
    real_open = direct_io._open_direct
    monkeypatch.setattr(direct_io, "_open_direct", lambda p: opens.append(p) or real_open(p))
    # The buffered edge of one run reads ahead into the next: every run direct all the same.
    monkeypatch.setattr(direct_io, "_cached", lambda fd, offset, length: False)
    with CheckpointReader(path, direct_io=True) as reader:
        drop_pages(path)
        got = PieceReader(reader).box("t/big", (30, 0), (20, 256))
    assert np.array_equal(got, whole[30:50])
    assert shifted == [4 * 1024, 16 * 1024, 4 * 1024]  # rows 28-31, 32-47, 48-51: past the cache
    assert opens == [path]
    assert not [t for t in threading.enumerate() if t.name.startswith("hpcckpt-hash")]


def test_a_piece_past_the_end_of_the_file_is_damage(saved, tmp_path):
    path = tmp_path / FILE
    shutil.copy(saved, path)
    with CheckpointReader(path) as reader:
        at = reader.raw_start("state/t/big", np.dtype(np.float32))
        assert at is not None
        os.truncate(path, at + 40 * 1024)  # rank 1's piece (rows 32-63) ends in row 40
        boxes = PieceReader(reader)
        assert boxes.box("t/big", (0, 0), (32, 256)).shape == (32, 256)  # rank 0's, whole
        with pytest.raises(CorruptCheckpoint, match="'t/big' of rank 1 ends past the end"):
            boxes.box("t/big", (32, 0), (32, 256))
