"""The mirror's verified copy in one pass (hpcckpt/store/mirror/source.py, the backends'
``put_stream``, hpcckpt/store/mirror/copy.py): the source checked as it streams, the
store's checksum on receipt instead of a read-back where the real S3 server checks one,
a damaged upload refused, and the copying thread's lowered priority."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror import priority
from hpcckpt.store.mirror.backend import DirectoryBackend, MirrorUnavailable
from hpcckpt.store.mirror.s3 import S3Backend
from hpcckpt.store.mirror.source import SourceCheck, Streamed, read_source
from hpcckpt.store.store import CheckpointStore

MiB = 1 << 20


def checkpoint(tmp_path: Path, n: int = 3_000_000, step: int = 1, **kw) -> Path:
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, incremental=False, **kw)
    rng = np.random.default_rng(step)
    store.save(step, {"u": rng.random(n), "w": rng.random(1000).astype(np.float32), "k": step})
    return store.directory / layout.checkpoint_name(step)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


class Counting(DirectoryBackend):
    """The real directory backend, counting the bytes read back from it."""

    read_back = 0

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        data = super().read_range(key, offset, length)
        self.read_back += len(data)
        return data


class CountingS3(S3Backend):
    read_back = 0

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        data = super().read_range(key, offset, length)
        self.read_back += len(data)
        return data


class Damaging(S3Backend):
    """The real S3 backend with a line between it and the store that flips one bit of
    every part after its checksum was computed (what a bad NIC or proxy would do)."""

    def _sent(self, body, algo):
        sent, checksum = super()._sent(body, algo)
        damaged = bytearray(sent)
        damaged[len(damaged) // 2] ^= 0x10
        return bytes(damaged), checksum


def test_the_stream_hashes_the_file_and_checks_every_block(tmp_path):
    path = checkpoint(tmp_path)
    check = SourceCheck(path)
    assert check.runs and sum(r.size for r in check.runs) >= 3_000_000 * 8
    seen = Streamed()
    data = b"".join(read_source(path, 1 << 20, check, seen))
    assert data == path.read_bytes() and seen.size == len(data)
    assert seen.checksum == mirror.file_checksum(path)
    # a file whose bytes are cut in odd places is checked the same
    seen = Streamed()
    assert b"".join(read_source(path, 777_777, SourceCheck(path), seen)) == data


def test_a_flipped_array_byte_fails_the_stream_and_leaves_nothing(tmp_path):
    path = checkpoint(tmp_path)
    run = SourceCheck(path).runs[0]
    flip(path, run.start + run.size // 2)
    (tmp_path / "m").mkdir()
    backend = DirectoryBackend(tmp_path / "m")
    with pytest.raises(CheckpointError, match="fails its checks.*block"):
        mirror.upload(backend, path)
    assert backend.list() == []  # no object, no manifest, no temporary file left


def test_the_directory_mirror_is_verified_without_reading_back(tmp_path):
    path = checkpoint(tmp_path)
    (tmp_path / "m").mkdir()
    backend = Counting(tmp_path / "m")
    mirror.upload(backend, path)
    assert backend.read_back == 0
    assert (tmp_path / "m" / path.name).read_bytes() == path.read_bytes()
    assert mirror.verify_mirrored(backend, path.name).good
    # with verify="readback" every byte is read back and compared
    (tmp_path / "m2").mkdir()
    again = Counting(tmp_path / "m2", verify="readback")
    mirror.upload(again, path)
    assert again.read_back == path.stat().st_size


def test_the_real_s3_server_checks_content_md5_so_nothing_is_read_back(s3_mirror, tmp_path):
    path = checkpoint(tmp_path, n=5_000_000)  # 40 MB: a multipart upload of 16 MiB parts
    backend = CountingS3(s3_mirror.url)
    assert backend.receipt_checksum() == "md5"  # rclone serve s3 checks Content-MD5 only
    up = mirror.upload(backend, path)
    assert backend.read_back == 0 and up.bytes == path.stat().st_size
    assert (s3_mirror.prefix_path / path.name).read_bytes() == path.read_bytes()
    assert mirror.verify_mirrored(backend, path.name).good
    assert not (s3_mirror.prefix_path / ".hpcckpt-checksum-probe").exists()
    reading = CountingS3(s3_mirror.url + "/rb", verify="readback")
    mirror.upload(reading, path)
    assert reading.read_back == path.stat().st_size


@pytest.mark.parametrize("n", [100_000, 5_000_000], ids=["one-put", "multipart"])
def test_an_upload_damaged_on_the_way_is_refused_and_leaves_no_object(s3_mirror, tmp_path, n):
    path = checkpoint(tmp_path, n=n)
    backend = Damaging(s3_mirror.url)
    with pytest.raises(MirrorUnavailable, match="BadDigest.*damaged on the way"):
        mirror.upload(backend, path)
    assert mirror.list_mirrored(backend) == []
    assert not (s3_mirror.prefix_path / path.name).exists()
    # the same file through an undamaged line is stored whole
    mirror.upload(S3Backend(s3_mirror.url), path)
    assert (s3_mirror.prefix_path / path.name).read_bytes() == path.read_bytes()


def test_a_source_failing_mid_multipart_aborts_the_upload(s3_mirror, tmp_path):
    path = checkpoint(tmp_path, n=5_000_000)
    runs = SourceCheck(path).runs
    last = max(runs, key=lambda r: r.start + r.size)
    flip(path, last.start + last.size - 100)  # in the last part: earlier parts went up
    backend = S3Backend(s3_mirror.url)
    with pytest.raises(CheckpointError, match="fails its checks"):
        mirror.upload(backend, path)
    assert backend.list() == []
    answer = backend.client.list_multipart_uploads(Bucket=backend.bucket)
    assert not answer.get("Uploads")


def test_the_copying_thread_runs_at_the_lowest_priority(tmp_path):
    path = checkpoint(tmp_path, n=100_000)
    (tmp_path / "m").mkdir()
    backend = DirectoryBackend(tmp_path / "m")
    seen: list[tuple[int, int]] = []

    def copy() -> None:
        mirror.upload(backend, path)
        seen.append(priority.thread_priority())

    t = threading.Thread(target=copy)
    t.start()
    t.join()
    nice, ioprio = seen[0]
    assert nice == priority.NICE
    assert ioprio == (priority.IOPRIO_CLASS_BE << 13) | priority.IOPRIO_LEVEL
    # the main thread (a command-line copy) keeps the user's priority
    before = priority.thread_priority()
    mirror.upload(DirectoryBackend(tmp_path / "m"), path)
    assert priority.thread_priority() == before


def test_the_manifest_records_the_files_hash_and_size(tmp_path):
    path = checkpoint(tmp_path)
    (tmp_path / "m").mkdir()
    backend = DirectoryBackend(tmp_path / "m", compress=None)
    mirror.upload(backend, path)
    manifest = json.loads(backend.get_bytes(path.name + ".manifest.json"))
    assert manifest["checksum"] == mirror.file_checksum(path)
    assert manifest["size"] == path.stat().st_size and "encoding" not in manifest
