"""The S3 backend against a real S3 server (rclone serve s3, tests/s3_server.py): objects
in and out, ranges, listing, multipart uploads, the bandwidth cap, and every way the
store fails turned into MirrorUnavailable with the reason in words."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import boto3
import pytest

from hpcckpt.store.mirror.backend import (
    MirrorBackend,
    MirrorUnavailable,
    ObjectInfo,
    Throttle,
    open_backend,
)
from hpcckpt.store.mirror.s3 import S3Backend, parse_s3_url
from tests.s3_server import KEY, SECRET

MiB = 1 << 20


def random_file(path: Path, size: int, seed: int = 0) -> Path:
    path.write_bytes(os.urandom(size) if seed == 0 else bytes([seed % 256]) * size)
    return path


@pytest.fixture
def backend(s3_mirror) -> S3Backend:
    return S3Backend(s3_mirror.url)


def test_an_s3_url_opens_the_s3_backend_of_the_protocol(s3_mirror):
    b = open_backend(s3_mirror.url, bandwidth=100e6)
    assert isinstance(b, S3Backend) and isinstance(b, MirrorBackend)
    assert b.url == s3_mirror.url and b.throttle.bytes_per_s == 100e6
    assert b.endpoint == s3_mirror.server.endpoint  # from AWS_ENDPOINT_URL


def test_urls_are_parsed_and_bad_ones_refused():
    assert parse_s3_url("s3://bucket/a/b/") == ("bucket", "a/b")
    assert parse_s3_url("s3://my-bucket") == ("my-bucket", "")
    for bad in ("s3:/bucket/x", "s3://Bad_Bucket!/x", "http://bucket/x", "s3://"):
        with pytest.raises(ValueError, match="s3://bucket/prefix"):
            parse_s3_url(bad)


def test_files_and_small_objects_go_in_and_come_back(backend, s3_mirror, tmp_path):
    src = random_file(tmp_path / "src.h5", 3 * MiB + 17)
    backend.put_file(src, "ckpt-10/ckpt-10.h5")
    backend.put_bytes("ckpt-10/MANIFEST.json", b'{"step": 10}')
    # the objects are real files of the server's bucket, under the URL's prefix
    on_disk = s3_mirror.prefix_path / "ckpt-10" / "ckpt-10.h5"
    assert on_disk.read_bytes() == src.read_bytes()

    out = tmp_path / "out.h5"
    out.write_bytes(b"old content")
    backend.get_file("ckpt-10/ckpt-10.h5", out)
    assert out.read_bytes() == src.read_bytes()
    assert not list(tmp_path.glob("*.part"))
    assert backend.get_bytes("ckpt-10/MANIFEST.json") == b'{"step": 10}'
    backend.put_bytes("ckpt-10/MANIFEST.json", b"{}")  # replaced whole
    assert backend.get_bytes("ckpt-10/MANIFEST.json") == b"{}"
    assert backend.get_bytes("ckpt-10/absent") is None
    with pytest.raises(FileNotFoundError):
        backend.get_file("ckpt-10/absent", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_ranges_read_exact_bytes_and_stop_at_the_end(backend, tmp_path):
    src = random_file(tmp_path / "f", 1000)
    data = src.read_bytes()
    backend.put_file(src, "f")
    assert backend.read_range("f", 0, 10) == data[:10]
    assert backend.read_range("f", 500, 123) == data[500:623]
    assert backend.read_range("f", 990, 100) == data[990:]
    assert backend.read_range("f", 1000, 10) == b""
    assert backend.read_range("f", 5, 0) == b""
    with pytest.raises(FileNotFoundError):
        backend.read_range("nothing", 0, 10)


def test_list_is_sorted_relative_to_the_prefix_and_delete_is_idempotent(s3_mirror, tmp_path):
    backend = S3Backend(s3_mirror.url)
    other = S3Backend(f"s3://{s3_mirror.bucket}/run-other")  # a sibling prefix: never listed
    other.put_bytes("ckpt-1/x", b"other")
    for key in ("ckpt-20/b", "ckpt-10/a", "ckpt-10/MANIFEST.json"):
        backend.put_bytes(key, key.encode())
    listed = backend.list()
    assert [o.key for o in listed] == ["ckpt-10/MANIFEST.json", "ckpt-10/a", "ckpt-20/b"]
    assert all(isinstance(o, ObjectInfo) and o.size == len(o.key) for o in listed)
    assert all(abs(o.mtime - time.time()) < 300 for o in listed)
    assert [o.key for o in backend.list("ckpt-10/")] == ["ckpt-10/MANIFEST.json", "ckpt-10/a"]
    backend.delete("ckpt-10/a")
    backend.delete("ckpt-10/a")  # absent: no error
    assert [o.key for o in backend.list("ckpt-10")] == ["ckpt-10/MANIFEST.json"]
    assert [o.key for o in other.list()] == ["ckpt-1/x"]
    with pytest.raises(ValueError, match="plain names"):
        backend.put_bytes("../escape", b"x")


def test_a_large_file_goes_up_in_parts_whole(s3_mirror, tmp_path):
    """Past the part size the upload is multipart (S3's ETag of a multipart object ends in
    -<parts>), and the object is the file, byte for byte."""
    backend = S3Backend(s3_mirror.url, part_size=5 * MiB, concurrency=3)
    src = random_file(tmp_path / "big", 23 * MiB + 5)
    backend.put_file(src, "big")
    client = boto3.client("s3")
    head = client.head_object(Bucket=s3_mirror.bucket, Key="run/big")
    assert head["ContentLength"] == src.stat().st_size
    assert (s3_mirror.prefix_path / "big").read_bytes() == src.read_bytes()
    uploads = client.list_multipart_uploads(Bucket=s3_mirror.bucket).get("Uploads", [])
    assert uploads == []  # completed, nothing left behind
    out = tmp_path / "back"
    backend.get_file("big", out)
    assert out.read_bytes() == src.read_bytes()


def test_the_bandwidth_cap_holds_uploads_to_its_rate(s3_mirror, tmp_path):
    """12 MB at 6 MB/s take at least 1.5 s (the bucket holds a quarter second of burst):
    every byte sent, in parts from several threads, spends the one throttle."""
    src = random_file(tmp_path / "f", 12_000_000)
    capped = S3Backend(s3_mirror.url, Throttle(6e6), part_size=5 * MiB, concurrency=3)
    t0 = time.monotonic()
    capped.put_file(src, "capped")
    assert time.monotonic() - t0 >= 1.5
    assert (s3_mirror.prefix_path / "capped").read_bytes() == src.read_bytes()


def test_a_store_that_is_down_fails_fast_and_works_again_when_back(own_s3_server, tmp_path):
    own_s3_server.bucket("ckpts")
    backend = S3Backend("s3://ckpts/run")
    backend.put_bytes("a", b"1")
    own_s3_server.stop()
    src = random_file(tmp_path / "f", MiB)
    for call in (
        lambda: backend.put_file(src, "f"),
        lambda: backend.put_bytes("b", b"2"),
        lambda: backend.get_bytes("a"),
        lambda: backend.read_range("a", 0, 1),
        lambda: backend.list(),
        lambda: backend.delete("a"),
        lambda: backend.get_file("a", tmp_path / "a"),
    ):
        t0 = time.monotonic()
        with pytest.raises(MirrorUnavailable, match="connection refused at http://127.0.0.1:"):
            call()
        assert time.monotonic() - t0 < 10, "a refused connection must not wait for long"
    own_s3_server.start()
    backend.put_file(src, "f")
    assert backend.get_bytes("a") == b"1"
    assert [o.key for o in backend.list()] == ["a", "f"]


def test_a_store_that_never_answers_times_out_as_too_slow(own_s3_server):
    own_s3_server.bucket("ckpts")
    backend = S3Backend("s3://ckpts/run", read_timeout=1, connect_timeout=1, attempts=2)
    backend.put_bytes("a", b"1")
    own_s3_server.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(MirrorUnavailable, match="too slow"):
            backend.get_bytes("a")
        assert time.monotonic() - t0 < 15
    finally:
        own_s3_server.resume()
    assert backend.get_bytes("a") == b"1"


def test_a_missing_bucket_is_named(s3_server, s3_mirror):
    backend = S3Backend("s3://no-such-bucket/run")
    with pytest.raises(MirrorUnavailable, match="bucket 'no-such-bucket' does not exist at http"):
        backend.put_bytes("a", b"1")


def test_wrong_credentials_are_access_denied_and_no_secret_is_shown(s3_mirror, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-wrong-secret-never-shown")
    backend = S3Backend(s3_mirror.url)
    with pytest.raises(MirrorUnavailable, match="access denied") as err:
        backend.list()
    assert "a-wrong-secret-never-shown" not in str(err.value)
    assert "AWS_PROFILE" in str(err.value)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(MirrorUnavailable, match="no S3 credentials found"):
        S3Backend(s3_mirror.url).list()


def test_a_profile_gives_endpoint_and_credentials(s3_mirror, tmp_path, monkeypatch):
    """The standard way on a cluster: AWS_PROFILE names a section of ~/.aws/config that
    holds the endpoint and the keys (none in the environment)."""
    config = tmp_path / "aws-config"
    config.write_text(
        textwrap.dedent(f"""\
        [profile campus]
        endpoint_url = {s3_mirror.server.endpoint}
        region = us-east-1
        aws_access_key_id = {KEY}
        aws_secret_access_key = {SECRET}
        """)
    )
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_PROFILE", "campus")
    backend = S3Backend(s3_mirror.url)
    assert backend.endpoint == s3_mirror.server.endpoint
    backend.put_bytes("p", b"profile")
    assert (s3_mirror.prefix_path / "p").read_bytes() == b"profile"
    monkeypatch.setenv("AWS_PROFILE", "nosuchprofile")
    with pytest.raises(MirrorUnavailable, match="nosuchprofile"):
        S3Backend(s3_mirror.url)


def test_a_full_store_fails_the_upload_and_leaves_no_object(own_s3_server, tmp_path):
    """The server's disk is a 6 MiB tmpfs: an upload of 10 MiB fails (rclone answers a
    full disk with InternalError), no object is left at the key, and the reason says a
    full disk answers so; the codes stores give for a quota are named as such."""
    bucket = own_s3_server.bucket("small")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(bucket)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a small tmpfs is not permitted here: {mounted.stderr.decode()}")
    try:
        backend = S3Backend("s3://small/run", part_size=5 * MiB, concurrency=1, attempts=1)
        with pytest.raises(MirrorUnavailable, match="InternalError.*full disk"):
            backend.put_file(random_file(tmp_path / "f", 10 * MiB), "f")
        assert backend.list() == []
    finally:
        own_s3_server.stop()
        subprocess.run(["umount", str(bucket)], check=True)


@pytest.mark.parametrize(
    "code, status",
    [("QuotaExceeded", 403), ("XMinioStorageFull", 507), ("InsufficientStorage", 507)],
)
def test_the_codes_of_a_full_store_read_as_full(s3_mirror, code, status):
    """Ceph RGW and MinIO answer a quota or a full disk with these codes (rclone cannot
    be made to): the reason says full, not denied."""
    from botocore.exceptions import ClientError

    err = ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )
    assert "full or over quota" in S3Backend(s3_mirror.url).reason(err)


BLOCK_BOTO3 = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("boto3", "botocore", "s3transfer"):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
"""


def test_without_boto3_hpcckpt_imports_and_an_s3_mirror_names_the_extra(tmp_path):
    code = BLOCK_BOTO3 + textwrap.dedent("""
        import hpcckpt, hpcckpt.store.mirror.backend as mb
        mb.open_backend(str(sys.argv[1]))  # a directory mirror needs nothing more
        try:
            mb.open_backend("s3://bucket/run")
        except ValueError as err:
            print(err)
        assert "boto3" not in sys.modules
    """)
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert "pip install 'hpcckpt[s3]'" in out.stdout, out.stdout + out.stderr


def test_over_tls_bodies_are_not_hashed_again_for_the_signature(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://127.0.0.1:9")  # no request is made
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    tls = S3Backend("s3://bucket/p")
    assert tls.client.meta.config.s3["payload_signing_enabled"] is False
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    plain = S3Backend("s3://bucket/p")  # plain HTTP: botocore signs every body
    assert "payload_signing_enabled" not in (plain.client.meta.config.s3 or {})
