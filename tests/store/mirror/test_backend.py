"""The mirror's backends (hpcckpt/store/mirror/backend.py): the directory backend, the
bandwidth cap, URLs and bandwidths as users write them."""

from __future__ import annotations

import os
import threading
import time

import pytest

from hpcckpt.store.mirror.backend import (
    DirectoryBackend,
    MirrorBackend,
    MirrorUnavailable,
    ObjectInfo,
    Throttle,
    check_url,
    open_backend,
    parse_bandwidth,
)


def test_directory_backend_stores_whole_objects_and_lists_them(tmp_path):
    root = tmp_path / "mirror"
    root.mkdir()
    b = DirectoryBackend(root)
    assert isinstance(b, MirrorBackend)
    src = tmp_path / "f"
    src.write_bytes(os.urandom(3 << 20))
    b.put_file(src, "run/a.h5")
    b.put_bytes("run/a.h5.manifest.json", b"{}")
    assert [(o.key, o.size) for o in b.list()] == [
        ("run/a.h5", 3 << 20),
        ("run/a.h5.manifest.json", 2),
    ]
    assert [o.key for o in b.list("run/a.h5.m")] == ["run/a.h5.manifest.json"]
    assert b.read_range("run/a.h5", 100, 10) == src.read_bytes()[100:110]
    out = tmp_path / "back"
    b.get_file("run/a.h5", out)
    assert out.read_bytes() == src.read_bytes()
    assert b.get_bytes("absent") is None
    with pytest.raises(FileNotFoundError):
        b.read_range("absent", 0, 1)
    b.delete("run/a.h5")
    b.delete("run/a.h5")  # absent: no error
    assert [o.key for o in b.list()] == ["run/a.h5.manifest.json"]
    assert isinstance(b.list()[0], ObjectInfo)


def test_a_cut_write_leaves_only_a_part_file_that_lists_nothing(tmp_path):
    root = tmp_path / "mirror"
    root.mkdir()
    (root / "ckpt-0000000001.h5.123.456.part").write_bytes(b"half")
    b = DirectoryBackend(root)
    assert b.list() == []
    b.put_bytes("k", b"whole")
    assert {p.name for p in root.iterdir()} == {"ckpt-0000000001.h5.123.456.part", "k"}


def test_a_missing_mirror_directory_is_unavailable_with_the_reason(tmp_path):
    b = DirectoryBackend(tmp_path / "gone")
    with pytest.raises(MirrorUnavailable, match="does not exist"):
        b.list()
    with pytest.raises(MirrorUnavailable, match="gone"):
        b.put_bytes("k", b"x")


def test_a_read_only_mirror_directory_refuses_with_the_reason(tmp_path):
    root = tmp_path / "ro"
    root.mkdir()
    os.chmod(root, 0o500)
    try:
        if os.access(root, os.W_OK):  # root ignores modes: a file in the way instead
            (root / "k").mkdir()
            with pytest.raises(MirrorUnavailable, match="writing k"):
                DirectoryBackend(root).put_bytes("k", b"x")
        else:
            with pytest.raises(MirrorUnavailable, match="Permission denied"):
                DirectoryBackend(root).put_bytes("k", b"x")
    finally:
        os.chmod(root, 0o700)


@pytest.mark.parametrize("key", ["/abs", "../up", "a//b", "a/./b", ""])
def test_keys_are_relative_plain_names(tmp_path, key):
    with pytest.raises(ValueError, match="relative path"):
        DirectoryBackend(tmp_path).put_bytes(key, b"x")


def test_throttle_caps_the_rate_across_threads():
    throttle = Throttle(20e6)  # 20 MB/s
    t0 = time.monotonic()
    threads = [
        threading.Thread(target=lambda: [throttle.spend(1_000_000) for _ in range(5)])
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    # 10 MB at 20 MB/s, less the quarter second of burst: at least 0.25 s
    assert elapsed >= 0.24
    t0 = time.monotonic()
    Throttle(None).spend(10**12)
    assert time.monotonic() - t0 < 0.1
    with pytest.raises(ValueError, match="positive"):
        Throttle(0)


def test_put_file_goes_through_the_throttle(tmp_path):
    src = tmp_path / "f"
    src.write_bytes(b"\0" * (16 << 20))
    (tmp_path / "m").mkdir()
    b = open_backend(str(tmp_path / "m"), bandwidth=32e6)
    t0 = time.monotonic()
    b.put_file(src, "f")
    assert time.monotonic() - t0 >= 0.25  # 16.8 MB at 32 MB/s less 8 MB of burst


@pytest.mark.parametrize(
    ("text", "rate"),
    [("500M", 500e6), ("1G", 1e9), ("200MB/s", 200e6), ("1.5GiB/s", 1.5 * 2**30), ("100", 100)],
)
def test_parse_bandwidth(text, rate):
    assert parse_bandwidth(text) == rate


@pytest.mark.parametrize("text", ["fast", "-5M", "0", "5X", ""])
def test_parse_bandwidth_refuses_nonsense_naming_the_forms(text):
    with pytest.raises(ValueError, match="500M|more than zero"):
        parse_bandwidth(text)


def test_open_backend_by_url(tmp_path):
    assert isinstance(open_backend(str(tmp_path)), DirectoryBackend)
    b = open_backend(f"file://{tmp_path}")
    assert isinstance(b, DirectoryBackend) and b.root == tmp_path
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        open_backend("ftp://host/x")
    with pytest.raises(ValueError, match="absolute path"):
        check_url("file://relative")
    with pytest.raises(ValueError, match="names no bucket"):
        check_url("s3:///prefix")
    with pytest.raises(ValueError, match="empty"):
        check_url("  ")


@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_copies_keep_the_checkpoints_mode_whatever_the_umask(tmp_path, mode):
    (tmp_path / "m").mkdir()
    local = tmp_path / "ckpt-000001.h5"
    local.write_bytes(b"x" * 100)
    local.chmod(mode)
    backend = DirectoryBackend(tmp_path / "m")
    old = os.umask(0o022)
    try:
        backend.put_file(local, "ckpt-000001.h5")
        backend.put_bytes("ckpt-000001.h5.manifest.json", b"{}")
        backend.put_bytes("ckpt-000001.h5.bad", b"damaged")
        backend.put_bytes("notes.txt", b"nothing it describes")
    finally:
        os.umask(old)
    got = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    assert got == {
        "ckpt-000001.h5": mode,
        "ckpt-000001.h5.manifest.json": mode,
        "ckpt-000001.h5.bad": mode,
        "notes.txt": 0o644,
    }
