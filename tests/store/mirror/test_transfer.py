"""The mirror's verified copy in one pass (hpcckpt/store/mirror/source.py, the backends'
``put_stream``, hpcckpt/store/mirror/copy.py): the source checked as it streams, the
store's checksum on receipt instead of a read-back where the real S3 server checks one,
a damaged upload refused, and the copying thread's lowered priority."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror import priority
from hpcckpt.store.mirror.backend import DirectoryBackend, MirrorUnavailable, Throttle
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
    every body of the copy as it is sent, after its checksum was computed (what a bad NIC
    or proxy would do)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.body_client.meta.events.register("before-send", self._damage)

    @staticmethod
    def _damage(request, **_kw) -> None:
        body = request.body
        data = body.getvalue() if hasattr(body, "getvalue") else body  # bytes or a BytesIO
        if request.method == "PUT" and len(data or b"") > 4096:  # not the probes
            damaged = bytearray(data)
            damaged[len(damaged) // 2] ^= 0x10
            request.body = bytes(damaged)


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


class Requests(CountingS3):
    """The real S3 backend, noting the headers of every part it sends."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.headers: list[set[str]] = []
        for client in {id(c): c for c in (self.client, self.body_client)}.values():
            client.meta.events.register("before-send", self._note)

    def _note(self, request, **_kw) -> None:
        if request.method == "PUT" and "partNumber=" in request.url:
            self.headers.append({k.lower() for k in request.headers.keys()})


def test_the_real_s3_server_checks_content_md5_so_nothing_is_read_back(s3_mirror, tmp_path):
    path = checkpoint(tmp_path, n=5_000_000)  # 40 MB: a multipart upload of 16 MiB parts
    backend = CountingS3(s3_mirror.url)
    # rclone serve s3 checks Content-MD5 only, and answers every PUT and part with the MD5
    # of what it received: compared here, which spares the store a second MD5
    assert backend.receipt_checksum() == "etag"
    up = mirror.upload(backend, path)
    assert backend.read_back == 0 and up.bytes == path.stat().st_size
    assert (s3_mirror.prefix_path / path.name).read_bytes() == path.read_bytes()
    assert mirror.verify_mirrored(backend, path.name).good
    assert not (s3_mirror.prefix_path / ".hpcckpt-checksum-probe").exists()
    reading = CountingS3(s3_mirror.url + "/rb", verify="readback")
    mirror.upload(reading, path)
    assert reading.read_back == path.stat().st_size


def test_etag_checked_parts_carry_no_content_md5_and_a_checksum_verify_sends_it(
    s3_mirror, tmp_path
):
    path = checkpoint(tmp_path, n=5_000_000)
    backend = Requests(s3_mirror.url)
    assert backend.receipt_checksum() == "etag"
    backend.headers.clear()  # the probe's part, when this process had not probed yet
    mirror.upload(backend, path)
    parts = backend.headers
    assert len(parts) == 3 and not any("content-md5" in h for h in parts)
    md5 = Requests(s3_mirror.url + "/md5", verify="checksum")
    assert md5.receipt_checksum() == "md5"
    mirror.upload(md5, path)
    parts = md5.headers  # no probe
    assert len(parts) == 3 and all("content-md5" in h for h in parts)
    assert mirror.verify_mirrored(md5, path.name).good
    assert md5.read_back == path.stat().st_size  # the verify above, not the upload


def test_bodies_go_unsigned_to_a_store_that_does_not_check_their_signed_hash(s3_mirror, tmp_path):
    """rclone serve s3 stores a body other than the one signed (its probe object is gone
    after the probe): botocore's SHA-256 of each body would verify nothing there, so the
    copy's bodies go unsigned over plain HTTP, still checked by their ETags, and arrive
    exact; the client for everything else still signs."""
    path = checkpoint(tmp_path, n=5_000_000)  # 3 parts
    backend = S3Backend(s3_mirror.url)
    assert s3_mirror.url.startswith("s3://") and str(backend.endpoint).startswith("http:")
    assert backend.payload_hash_checked() is False
    assert not (s3_mirror.prefix_path / ".hpcckpt-checksum-probe").exists()
    assert backend.body_client.meta.config.s3["payload_signing_enabled"] is False
    assert "payload_signing_enabled" not in (backend.client.meta.config.s3 or {})
    seen: list[str] = []
    backend.body_client.meta.events.register(
        "before-send",
        lambda request, **_: seen.append(request.headers.get("X-Amz-Content-SHA256", b"")),
    )
    up = mirror.upload(backend, path)
    assert len(seen) >= 3 and all(h in (b"UNSIGNED-PAYLOAD", "UNSIGNED-PAYLOAD") for h in seen)
    assert up.bytes == path.stat().st_size
    assert (s3_mirror.prefix_path / path.name).read_bytes() == path.read_bytes()
    assert mirror.verify_mirrored(backend, path.name).good


@pytest.mark.parametrize("verify", ["auto", "checksum"], ids=["etag", "content-md5"])
@pytest.mark.parametrize("n", [100_000, 5_000_000], ids=["one-put", "multipart"])
def test_an_upload_damaged_on_the_way_is_refused_and_leaves_no_object(
    s3_mirror, tmp_path, n, verify
):
    path = checkpoint(tmp_path, n=n)
    backend = Damaging(s3_mirror.url, verify=verify)
    # the ETag differs from the MD5 of the bytes read ("auto"), or the store refused the
    # Content-MD5 ("checksum")
    why = "ETag .* is not the MD5" if verify == "auto" else "BadDigest"
    with pytest.raises(MirrorUnavailable, match=f"{why}.*damaged on the way"):
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


class KernelCopy(DirectoryBackend):
    """The real directory backend, noting each range its kernel copy moves and the
    priority of the thread that moves it."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.copied = 0
        self.streamed = 0
        self.priorities: set[tuple[int, int]] = set()

    def copy_range(self, src: int, dst: int, offset: int, count: int) -> int:
        n = super().copy_range(src, dst, offset, count)
        self.copied += n
        self.priorities.add(priority.thread_priority())
        return n

    def put_stream(self, key, pieces, like=None, **kw):
        self.streamed += 1
        return super().put_stream(key, pieces, like, **kw)


class DamagedAt(KernelCopy):
    """A directory mirror whose destination gets one byte flipped at ``at`` right after
    the kernel copied the range holding it, before anything reads it back (what a bad
    controller, a buggy file system or another writer would do), ``times`` times."""

    def __init__(self, root: Path, at: int, times: int = 1) -> None:
        super().__init__(root, compress=None)
        self.at, self.times = at, times

    def copy_range(self, src: int, dst: int, offset: int, count: int) -> int:
        n = super().copy_range(src, dst, offset, count)
        if self.times and offset <= self.at < offset + n:
            self.times -= 1
            b = os.pread(dst, 1, self.at)
            os.pwrite(dst, bytes([b[0] ^ 0x04]), self.at)
        return n


def test_the_directory_mirror_copies_in_the_kernel_and_checks_the_destination(tmp_path):
    path = checkpoint(tmp_path, n=3_000_000)  # 24 MB: several copy ranges
    (tmp_path / "m").mkdir()
    backend = KernelCopy(tmp_path / "m", compress=None)
    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(mirror.upload(backend, path).bytes))
    t.start()
    t.join()
    size = path.stat().st_size
    assert done == [size] and backend.copied == size and backend.streamed == 0
    copy = tmp_path / "m" / path.name
    assert copy.read_bytes() == path.read_bytes()
    assert copy.stat().st_mode & 0o777 == path.stat().st_mode & 0o777
    manifest = json.loads(backend.get_bytes(path.name + ".manifest.json"))
    assert manifest["checksum"] == mirror.file_checksum(path) and manifest["size"] == size
    # the kernel's copy runs in a thread of its own, at the copying thread's low priority
    assert backend.priorities == {
        (priority.NICE, (priority.IOPRIO_CLASS_BE << 13) | priority.IOPRIO_LEVEL)
    }


def test_where_sendfile_is_refused_the_ranges_are_read_and_written(tmp_path):
    path = checkpoint(tmp_path)
    (tmp_path / "m").mkdir()
    backend = KernelCopy(tmp_path / "m", compress=None)
    backend._sendfile = False  # as after a file system refused it (EINVAL)
    mirror.upload(backend, path)
    assert backend.copied == path.stat().st_size
    assert (tmp_path / "m" / path.name).read_bytes() == path.read_bytes()


@pytest.mark.parametrize("where", ["array block", "metadata"])
def test_a_byte_damaged_on_the_way_to_the_directory_is_never_counted(tmp_path, where):
    path = checkpoint(tmp_path, n=3_000_000)
    run = SourceCheck(path).runs[0]
    at = run.start + run.size // 3 if where == "array block" else 100  # the HDF5 superblock
    assert (where == "array block") == (run.start <= at < run.start + run.size)
    (tmp_path / "m").mkdir()
    backend = DamagedAt(tmp_path / "m", at)
    with pytest.raises(mirror.MirrorCopyBad, match="not the checkpoint's bytes"):
        mirror.upload(backend, path)
    assert backend.list() == [] and list((tmp_path / "m").iterdir()) == []  # no object, no part
    assert mirror.list_mirrored(backend) == []
    # the local checkpoint is fine: the worker retries, and the next copy counts
    assert backend.times == 0
    mirror.upload(backend, path)
    assert (tmp_path / "m" / path.name).read_bytes() == path.read_bytes()
    assert [m.name for m in mirror.list_mirrored(backend) if m.good] == [path.name]


def test_the_worker_retries_a_copy_damaged_on_the_way_and_counts_the_good_one(tmp_path):
    from hpcckpt.store.mirror.worker import MirrorWorker
    from hpcckpt.store.options import MirrorOptions

    path = checkpoint(tmp_path)
    run = SourceCheck(path).runs[0]
    (tmp_path / "m").mkdir()
    backend = DamagedAt(tmp_path / "m", run.start + 10)
    events: list[tuple[str, dict]] = []
    options = MirrorOptions(str(tmp_path / "m"), mirror_retry_max=0.2)
    worker = MirrorWorker(backend, options, lambda kind, fields: events.append((kind, fields)))
    try:
        worker.submit(1, path)
        assert worker.wait(180)
    finally:
        worker.close()
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "mirror_failed" and kinds[-1] == "mirrored"
    assert "not the checkpoint's bytes" in events[0][1]["reason"]
    assert events[0][1]["retry_in"] is not None  # retried, not given up
    assert mirror.newest_good(backend).name == path.name


def test_a_damaged_checkpoint_copied_by_the_kernel_is_refused_as_the_sources_fault(tmp_path):
    path = checkpoint(tmp_path)
    run = SourceCheck(path).runs[-1]
    flip(path, run.start + run.size - 1)  # its last byte
    (tmp_path / "m").mkdir()
    backend = KernelCopy(tmp_path / "m", compress=None)
    with pytest.raises(CheckpointError, match="fails its checks") as err:
        mirror.upload(backend, path)
    assert not isinstance(err.value, mirror.MirrorCopyBad)  # not retried: the source is bad
    assert backend.copied > 0 and list((tmp_path / "m").iterdir()) == []


def test_a_bandwidth_cap_or_compression_keeps_the_metered_stream(tmp_path):
    path = checkpoint(tmp_path)
    capped = KernelCopy(tmp_path / "capped", Throttle(1e9), compress=None)
    zipped = KernelCopy(tmp_path / "zstd", compress="zstd")
    for backend in (capped, zipped):
        backend.root.mkdir()
        mirror.upload(backend, path)
        assert backend.copied == 0 and backend.streamed == 1
        got = mirror.pull(backend, path.name, tmp_path / f"back-{backend.root.name}")
        assert got.read_bytes() == path.read_bytes()


def test_an_incremental_file_copied_by_the_kernel_is_checked_byte_for_byte(tmp_path):
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, max_chain=4)
    u = np.random.default_rng(0).random(2_000_000)
    store.save(1, {"u": u})
    u[:1000] += 1.0
    delta = store.save(2, {"u": u})
    assert delta.kind == "incremental" and not SourceCheck(delta.path).runs  # no plain blocks
    size = delta.path.stat().st_size
    (tmp_path / "m").mkdir()
    backend = DamagedAt(tmp_path / "m", size // 2)
    with pytest.raises(mirror.MirrorCopyBad, match="differ from the source's"):
        mirror.upload(backend, delta.path)  # its base first, through the metered stream
    assert [m.step for m in mirror.list_mirrored(backend) if m.good] == [1]
    assert backend.times == 0 and backend.streamed == 1
    up = mirror.upload(backend, delta.path)
    assert up.files == (delta.path.name,) and up.already == ("ckpt-0000000001.h5",)
    assert backend.streamed == 1 and mirror.newest_good(backend).step == 2
    got = mirror.pull(backend, 2, tmp_path / "back")
    assert got.read_bytes() == delta.path.read_bytes()
