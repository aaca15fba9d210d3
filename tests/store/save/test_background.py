"""A rank's staged bytes written in a thread (hpcckpt/store/save/background.py): at their
offsets, fsynced, held until let go, errors kept rather than raised."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

from hpcckpt.store.io import direct_io, faults
from hpcckpt.store.io.direct_io import Extent
from hpcckpt.store.save.background import BackgroundWrite, DeferredWrite
from tests.store.save.test_staging import random_array


def test_background_write_writes_extents_at_their_offsets_and_fsyncs(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.partial"
    path.write_bytes(b"\xee" * 20000)
    u = random_array((100,), "f8", 20)  # 800 bytes, format "d"
    g = random_array((7, 9), "i2", 21)  # 2-d: cast to bytes by the writer
    raw = bytes(range(256)) * 3
    extents = [
        Extent(100, memoryview(u)),
        Extent(5000, memoryview(g)),
        Extent(19000, memoryview(raw)),
        Extent(21000, memoryview(b"tail")),  # past the end: the file grows
    ]
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    writer = BackgroundWrite(path, extents)
    assert writer.done()  # not started: nothing under way
    writer.start()
    writer.wait()
    assert writer.done()
    assert writer.error is None
    assert writer.bytes == u.nbytes + g.nbytes + len(raw) + 4
    assert writer.seconds > 0
    assert synced == [path.stat().st_ino]

    data = path.read_bytes()
    assert len(data) == 21004
    assert data[100:900] == u.tobytes()
    assert data[5000 : 5000 + g.nbytes] == g.tobytes()
    assert data[19000 : 19000 + len(raw)] == raw
    assert data[21000:] == b"tail"
    # Bytes between the extents are left as they were (not zeroed, not moved).
    assert data[:100] == b"\xee" * 100
    assert data[900:5000] == b"\xee" * 4100
    assert data[20000:21000] == b"\0" * 1000


def test_a_started_write_waits_for_go_and_a_wait_lets_it_run(tmp_path):
    """The thread is started at once but writes nothing before go(): the caller's own
    last work (an event, a heartbeat) does not share the interpreter with it."""
    path = tmp_path / "f"
    path.write_bytes(b"")
    u = random_array((5000,), "f8", 3)
    writer = BackgroundWrite(path, [Extent(0, memoryview(u))]).start()
    time.sleep(0.3)
    assert not writer.done() and writer.bytes == 0 and path.stat().st_size == 0
    writer.go()
    writer._thread.join(30)
    assert writer.done() and writer.error is None and path.read_bytes() == u.tobytes()
    held = BackgroundWrite(tmp_path / "g", [Extent(0, memoryview(u))])
    (tmp_path / "g").write_bytes(b"")
    held.start().wait()  # no go(): waiting lets it run
    assert held.done() and (tmp_path / "g").read_bytes() == u.tobytes()


def test_a_deferred_write_is_handed_to_its_thread_once_at_go_or_wait():
    handed = []
    write = DeferredWrite(
        lambda: BackgroundWrite(Path("/nonexistent/x"), []), launch=lambda: handed.append(1)
    )
    assert handed == [] and not write.done()
    write.go()
    write.go()
    assert handed == [1]
    other = DeferredWrite(lambda: None, launch=lambda: handed.append(2))  # type: ignore[arg-type,return-value]
    threading.Timer(0.2, other.run).start()
    other.wait()  # hands it over, then waits for the run
    assert handed == [1, 2] and other.done()


def test_background_write_loops_over_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_io, "WRITE_CHUNK", 1000)  # each extent takes several pwrites
    path = tmp_path / "f"
    path.write_bytes(b"")
    u = random_array((1234,), "f8", 22)
    writer = BackgroundWrite(path, [Extent(4096, memoryview(u))]).start()
    writer.wait()
    assert writer.error is None and writer.bytes == u.nbytes
    assert path.read_bytes()[4096:] == u.tobytes()


def test_background_write_records_a_missing_file_and_does_not_raise(tmp_path):
    path = tmp_path / "no-such-dir" / "ckpt.partial"
    writer = BackgroundWrite(path, [Extent(0, memoryview(b"x" * 10))]).start()
    writer.wait()  # would re-raise nothing: the thread never raises
    assert writer.done()
    assert isinstance(writer.error, FileNotFoundError)
    assert writer.bytes == 0
    assert not path.parent.exists()


def test_background_write_records_an_io_error_in_the_middle(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"\0" * 100)
    monkeypatch.setattr(faults, "_FAULTS", [("drain.eio", None, None)])
    writer = BackgroundWrite(path, [Extent(0, memoryview(b"a" * 10))]).start()
    writer.wait()
    assert isinstance(writer.error, OSError) and writer.error.errno == errno.EIO
    assert writer.bytes == 0
    assert path.read_bytes() == b"\0" * 100


def test_background_write_with_nothing_to_write(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"keep")
    writer = BackgroundWrite(path, []).start()
    writer.wait()
    assert writer.error is None and writer.bytes == 0
    assert path.read_bytes() == b"keep"
