"""An S3 bucket (AWS, or any S3-compatible store: Ceph, MinIO, a campus store) as the
mirror, through boto3: the optional extra ``pip install 'hpcckpt[s3]'``.

The endpoint, region and credentials come the standard way, boto3's own chain:
``AWS_ENDPOINT_URL`` (or ``endpoint_url`` in a profile), ``AWS_PROFILE`` and
``~/.aws/config``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, an instance role.
Large files go up in parts, several at once, each byte spent through the mirror's
:class:`~hpcckpt.store.mirror.backend.Throttle`. Every failure of the store (refused,
slow, denied, missing bucket, full) becomes :class:`MirrorUnavailable` with the reason in
words and never a secret; timeouts and retries are bounded so that a dead store fails
in seconds, not minutes.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hpcckpt.store.io.durability import atomic_path
from hpcckpt.store.mirror import priority
from hpcckpt.store.mirror.backend import MirrorUnavailable, ObjectInfo, Throttle, check_verify

try:  # the optional extra; importing hpcckpt never needs it
    import boto3
    import botocore.exceptions as bce
    from boto3.exceptions import S3UploadFailedError
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
except ImportError as _missing:  # pragma: no cover - exercised in a subprocess by the tests
    boto3 = None
    MISSING = str(_missing)
else:
    MISSING = ""

INSTALL = "pip install 'hpcckpt[s3]'"

#: Part size and parts in flight of a multipart upload (benchmarks/bench_mirror.py measured
#: them against rclone's S3 server here: 16 MiB parts, 4 at a time, were as fast as any
#: larger setting and keep a copy's memory to 64 MiB). Files below the threshold go up in
#: one request.
PART_SIZE = 16 << 20
CONCURRENCY = 4
#: Seconds to open a connection, and to wait for any byte of an answer; attempts of each
#: request (boto3's "standard" retry mode: exponential backoff with jitter). A refused
#: connection fails in well under a second; a store that accepts and never answers in
#: about ATTEMPTS * READ_TIMEOUT.
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 20.0
ATTEMPTS = 3

#: Error codes of a full store or an exceeded quota (AWS, Ceph RGW, MinIO).
FULL = ("QuotaExceeded", "EntityTooLarge", "InsufficientStorage", "XMinioStorageFull")

#: The checksums a store may check on receipt, cheapest first: the S3 flexible checksum
#: CRC32 (AWS, recent MinIO and Ceph); "etag": the store answers each request with the MD5
#: of the bytes it received as the ETag, which the backend compares with the MD5 of what
#: it sent (no second MD5 on the store, where a Content-MD5 costs one: rclone serve s3);
#: then Content-MD5 (every S3 store that checks one). Error codes of a store that refused
#: a body for its checksum.
RECEIPT = ("crc32", "etag", "md5")
DIGEST_CODES = ("BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "InvalidChecksum")
#: The object a probe writes with a wrong checksum: a store that checks refuses it.
PROBE = ".hpcckpt-checksum-probe"
#: What the probe found per (endpoint, bucket): the checksum the store checks, or None.
_PROBED: dict[tuple[str, str], str | None] = {}
#: Per plain-HTTP (endpoint, bucket): whether the store checks a signed body's SHA-256.
_HASH_PROBED: dict[tuple[str, str], bool] = {}
_PROBE_LOCK = threading.Lock()
#: Error codes of a store that refused a body whose SHA-256 is not the one signed.
HASH_CODES = ("XAmzContentSHA256Mismatch", "BadDigest", "SignatureDoesNotMatch")

_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.\-_]{0,254}$")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix"); ValueError otherwise."""
    match = re.fullmatch(r"s3://([^/]+)/*(.*)", url.strip())
    if match is None or not _BUCKET.match(match.group(1)):
        raise ValueError(
            f"mirror URL {url!r} is not s3://bucket/prefix (a bucket name is letters, digits, "
            "dots, dashes and underscores)"
        )
    return match.group(1), match.group(2).strip("/")


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"mirror key {key!r} is not a relative path of plain names")
    return key


def _config(
    connect_timeout: float, read_timeout: float, attempts: int, unsigned_bodies: bool = False
) -> Any:
    options: dict[str, Any] = {
        "connect_timeout": connect_timeout,
        "read_timeout": read_timeout,
        "retries": {"total_max_attempts": attempts, "mode": "standard"},
        "max_pool_connections": max(10, 2 * CONCURRENCY),
        "tcp_keepalive": True,
    }
    if unsigned_bodies:
        # With the bytes checked on receipt or read back, botocore's SHA-256 of every body
        # for its signature is a pass that protects nothing more over TLS, nor over plain
        # HTTP on a store that does not check it (S3Backend.payload_hash_checked).
        options["s3"] = {"payload_signing_enabled": False}
    try:
        # Range reads must not be checked against the whole object's checksum (some stores
        # send it with a part); the mirror checks every byte against the checkpoint's own
        # checksums instead. Uploads carry the checksum the backend computes itself, in
        # the pass that reads the file, not a second one botocore would compute.
        return Config(
            **options,
            response_checksum_validation="when_required",
            request_checksum_calculation="when_required",
        )
    except TypeError:  # botocore before 1.36 has no such option and checks no ranges
        return Config(**options)


class S3Backend:
    """The mirror's objects under ``s3://bucket/prefix``: one S3 object per key.

    An object appears whole or not at all (a single PUT, or a multipart upload that S3
    assembles only when completed; an upload cut before completing leaves no object, and
    the parts it sent are aborted when the failure is seen, or dropped by the bucket's
    lifecycle rule for incomplete uploads after a kill).
    """

    def __init__(
        self,
        url: str,
        throttle: Throttle | None = None,
        *,
        part_size: int = PART_SIZE,
        concurrency: int = CONCURRENCY,
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = READ_TIMEOUT,
        attempts: int = ATTEMPTS,
        verify: str = "auto",
        compress: str | None = None,
    ) -> None:
        if boto3 is None:
            raise ValueError(
                f"mirror URL {url!r} needs the S3 client boto3, which is not installed: "
                f"{INSTALL} ({MISSING})"
            )
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.throttle = throttle or Throttle(None)
        self.verify = check_verify(verify)
        self.compress = compress
        self.part_size = part_size
        self.read_chunk = part_size  # a part read whole: handed to the request uncopied
        self.concurrency = concurrency
        self.transfer = TransferConfig(
            multipart_threshold=part_size,
            multipart_chunksize=part_size,
            max_concurrency=concurrency,
            use_threads=concurrency > 1,
        )
        try:
            session = boto3.session.Session()
            self.client = session.client(
                "s3", config=_config(connect_timeout, read_timeout, attempts)
            )
            unsigned = session.client(
                "s3", config=_config(connect_timeout, read_timeout, attempts, True)
            )
            if str(self.client.meta.endpoint_url).startswith("https:"):
                self.client = unsigned
        except bce.BotoCoreError as err:  # a bad profile, an unreadable config file
            raise MirrorUnavailable(
                f"the S3 client for {self.url} could not start: {err}"
            ) from None
        self._unsigned = unsigned  # for bodies whose signed hash the store would not check
        self.endpoint = self.client.meta.endpoint_url

    def __repr__(self) -> str:
        return f"S3Backend({self.url!r} at {self.endpoint})"

    # -- keys ---------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        key = _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    # -- errors -------------------------------------------------------------------------

    def _unavailable(self, what: str, err: BaseException) -> MirrorUnavailable:
        return MirrorUnavailable(f"{what} on the mirror {self.url}: {self.reason(err)}")

    def reason(self, err: BaseException) -> str:
        """Why an S3 call failed, in words, naming the endpoint and never a secret."""
        root = _root_cause(err)
        at = f"at {self.endpoint}"
        if isinstance(root, bce.ClientError):
            code = str(root.response.get("Error", {}).get("Code", ""))
            status = root.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            message = str(root.response.get("Error", {}).get("Message", "") or "")
            text = f"{code} {message}".lower()
            if code in DIGEST_CODES:
                return (
                    f"the store refused the bytes it received {at} ({code}): their checksum "
                    "differs from the one computed as they were read (damaged on the way); "
                    "nothing was stored"
                )
            if code == "NoSuchBucket":
                return f"bucket {self.bucket!r} does not exist {at} (create it, or fix the URL)"
            if (
                code in FULL
                or status == 507
                or "quota" in text
                or "no space" in text
                or "disk full" in text
            ):
                return f"the store is full or over quota {at} ({code or status}: {message})"
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or (
                status == 403
            ):
                return (
                    f"access denied {at} ({code or status}): check the credentials "
                    "(AWS_PROFILE, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and the "
                    f"bucket's policy for {self.bucket!r}"
                )
            if code in ("SlowDown", "ServiceUnavailable", "RequestTimeout") or status == 503:
                return f"the store is overloaded {at} ({code or status}): retry later"
            if isinstance(status, int) and status >= 500:
                return (
                    f"the store failed the request {at} ({code or status}: {message}); some "
                    "stores answer a full disk so: see the store's log"
                )
            return f"the store refused the request {at} ({code or status}: {message})"
        if isinstance(root, (bce.ConnectTimeoutError, bce.ReadTimeoutError)):
            return f"the store is too slow: no answer {at} within the timeout ({root})"
        if isinstance(root, bce.EndpointConnectionError):
            return f"connection refused {at} (is the store up? is AWS_ENDPOINT_URL right?)"
        if isinstance(root, (bce.ConnectionClosedError, bce.ConnectionError)):
            return f"the connection {at} was lost ({type(root).__name__})"
        if isinstance(root, (bce.NoCredentialsError, bce.PartialCredentialsError)):
            return (
                "no S3 credentials found: set AWS_PROFILE (a profile of ~/.aws/config) or "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            )
        if isinstance(root, bce.ProfileNotFound):
            return f"{root} (AWS_PROFILE names a profile that ~/.aws/config does not have)"
        if isinstance(root, OSError) and not isinstance(root, FileNotFoundError):
            return f"{type(root).__name__}: {root}"
        return f"{type(root).__name__}: {root}"

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (bce.BotoCoreError, bce.ClientError, S3UploadFailedError) as err:
            if _not_found(err):
                raise FileNotFoundError(
                    f"{what}: no such object on the mirror {self.url}"
                ) from None
            raise self._unavailable(what, err) from None

    # -- the protocol -------------------------------------------------------------------

    def put_file(self, local: Path, key: str) -> None:
        """Upload ``local`` under ``key``: in parts of ``part_size``, ``concurrency`` at a
        time, past the size threshold; each byte read for sending spends the throttle."""
        self._call(
            f"uploading {key}",
            self.client.upload_file,
            str(local),
            self.bucket,
            self._key(key),
            Config=self.transfer,
            Callback=self.throttle.spend,
        )

    # -- verified uploads -----------------------------------------------------------------

    def receipt_checksum(self) -> str | None:
        """The checksum this store checks on receipt ("crc32", "etag", "md5"), None when
        it checks none (then a copy is read back). With ``verify="auto"`` a probe finds it
        once per store and process: a tiny object sent with a wrong CRC32, which a
        checking store refuses (one accepted is deleted at once), then whether a PUT's
        and a part's ETags are the MD5 of the bytes sent, then a wrong Content-MD5;
        ``"checksum"`` takes Content-MD5 without a probe, ``"readback"`` none."""
        if self.verify == "readback":
            return None
        if self.verify == "checksum":
            return "md5"
        where = (str(self.endpoint), self.bucket)
        with _PROBE_LOCK:
            if where not in _PROBED:
                _PROBED[where] = self._probe()
            return _PROBED[where]

    @property
    def receipt_checked(self) -> bool:
        """Whether uploads are checked by the store on receipt (see :meth:`receipt_checksum`)."""
        return self.receipt_checksum() is not None

    def _probe(self) -> str | None:
        body = b"hpcckpt checks whether this store verifies checksums on receipt\n"
        key = self._key(PROBE)
        for algo in RECEIPT:
            if algo == "etag":
                if self._etag_is_md5(key, body):
                    return algo
                continue
            wrong = self._checksum(body + b"!", algo)
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=body, **wrong)
            except bce.ClientError as err:
                if _code(err) in DIGEST_CODES:
                    return algo
                status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status in (400, 501):  # the header is not understood here: the next one
                    continue
                raise self._unavailable("probing its checksums", err) from None
            except bce.BotoCoreError as err:
                raise self._unavailable("probing its checksums", err) from None
            self._call(f"deleting {PROBE}", self.client.delete_object, Bucket=self.bucket, Key=key)
        return None

    def payload_hash_checked(self) -> bool:
        """Whether this store checks the SHA-256 botocore signs for each body over plain
        HTTP (AWS refuses a body other than the one signed; False over TLS): probed once
        per store and process with a tiny object signed for one body and sent with another."""
        if str(self.endpoint).startswith("https:"):
            return False
        where = (str(self.endpoint), self.bucket)
        with _PROBE_LOCK:
            if where not in _HASH_PROBED:
                _HASH_PROBED[where] = self._probe_payload_hash()
            return _HASH_PROBED[where]

    def _probe_payload_hash(self) -> bool:
        signed = b"hpcckpt: is a signed body's SHA-256 checked here? (signed)\n"
        sent = signed.replace(b"(signed)", b"(sent!!)")  # the same length: Content-Length
        key = self._key(PROBE)

        def swap(request: Any, **_: Any) -> None:
            request.body = sent

        self.client.meta.events.register("before-send.s3.PutObject", swap)
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=signed)
        except (bce.ClientError, bce.BotoCoreError) as err:
            if isinstance(err, bce.ClientError) and _code(err) in HASH_CODES:
                return True
            raise self._unavailable("probing whether it checks signed bodies", err) from None
        finally:
            self.client.meta.events.unregister("before-send.s3.PutObject", swap)
        self._call(f"deleting {PROBE}", self.client.delete_object, Bucket=self.bucket, Key=key)
        return False

    @property
    def body_client(self) -> Any:
        """The client for a copy's bodies: unsigned where the store would not check the
        signed hash (the receipt checksum or the read-back verifies the copy either way)."""
        return self.client if self.payload_hash_checked() else self._unsigned

    def _etag_is_md5(self, key: str, body: bytes) -> bool:
        """Whether the store answers a PUT and a multipart part with the MD5 of the bytes
        it received as their ETag (AWS S3 and MinIO without KMS encryption, Ceph RGW,
        rclone serve s3); the probe's objects and upload are removed."""
        want = hashlib.md5(body).hexdigest()
        try:
            put = self.client.put_object(Bucket=self.bucket, Key=key, Body=body)
            self.client.delete_object(Bucket=self.bucket, Key=key)
            if _etag(put) != want:
                return False
            upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
            try:
                part = self.client.upload_part(
                    Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=1, Body=body
                )
            finally:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
        except (bce.BotoCoreError, bce.ClientError) as err:
            raise self._unavailable("probing its checksums", err) from None
        return _etag(part) == want

    def _check_etag(self, what: str, answer: dict[str, Any], body: bytes) -> None:
        """MirrorUnavailable unless the store's ETag for ``body`` is its MD5 (receipt
        mode "etag": what the store received is what was sent)."""
        got, want = _etag(answer), hashlib.md5(body).hexdigest()
        if got != want:
            raise MirrorUnavailable(
                f"{what} on the mirror {self.url}: the store received other bytes than "
                f"were sent (its ETag {got} is not the MD5 {want} of the bytes read): "
                "damaged on the way; nothing was stored"
            )

    @staticmethod
    def _checksum(body: bytes | memoryview, algo: str | None) -> dict[str, str]:
        """The request's checksum parameter for ``body`` (none for None)."""
        if algo == "crc32":
            crc = zlib.crc32(body) & 0xFFFFFFFF
            return {"ChecksumCRC32": base64.b64encode(crc.to_bytes(4, "big")).decode()}
        if algo == "md5":
            return {"ContentMD5": base64.b64encode(hashlib.md5(body).digest()).decode()}
        return {}

    def put_stream(
        self,
        key: str,
        pieces: Iterable[bytes],
        like: Path | None = None,
        pause: Callable[[], None] | None = None,
    ) -> None:
        """Upload the bytes of ``pieces`` as they come: one PUT when they fit in a part,
        else a multipart upload of ``part_size`` parts, ``concurrency`` in flight, each
        with the checksum the store checks on receipt (computed in the sending thread, off
        the reading one); a part the store refuses, or an exception of ``pieces``, aborts
        the upload, leaving no object. ``pause`` is called before each part's request and
        before the upload's completion (when the store assembles the object): it may hold
        the upload there, between requests, never inside one."""
        full = self._key(key)
        algo = self.receipt_checksum()
        bodies = self.body_client  # probed before any request of this upload
        parts = _parts(pieces, self.part_size)
        first = next(parts, b"")
        second = next(parts, None)
        if second is None:
            self.throttle.spend(len(first))
            answer = self._call(
                f"uploading {key}",
                bodies.put_object,
                Bucket=self.bucket,
                Key=full,
                Body=first,
                **self._checksum(first, algo),
            )
            if algo == "etag":
                try:
                    self._check_etag(f"uploading {key}", answer, first)
                except MirrorUnavailable:
                    self.delete(key)  # what arrived is not the file's bytes: no object left
                    raise
            return
        extra = {"ChecksumAlgorithm": "CRC32"} if algo == "crc32" else {}
        upload = self._call(
            f"uploading {key}",
            self.client.create_multipart_upload,
            Bucket=self.bucket,
            Key=full,
            **extra,
        )["UploadId"]
        done: list[dict[str, Any]] = []
        slots = threading.BoundedSemaphore(self.concurrency + 1)
        futures: list[Future[dict[str, Any]]] = []
        background = threading.current_thread() is not threading.main_thread()
        pool = ThreadPoolExecutor(
            self.concurrency,
            thread_name_prefix="hpcckpt-s3",
            initializer=(lambda: priority.lower_background(True)) if background else None,
        )
        try:
            with pool:
                for number, body in enumerate(_chain(first, second, parts), start=1):
                    self.throttle.spend(len(body))
                    slots.acquire()
                    if any(f.done() and f.exception() for f in futures):
                        slots.release()
                        break
                    fut = pool.submit(
                        self._part, bodies, key, full, upload, number, body, algo, pause
                    )
                    fut.add_done_callback(lambda _f: slots.release())
                    futures.append(fut)
            done = [f.result() for f in futures]
            if pause is not None:
                pause()
            self._call(
                f"uploading {key}",
                self.client.complete_multipart_upload,
                Bucket=self.bucket,
                Key=full,
                UploadId=upload,
                MultipartUpload={"Parts": done},
            )
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload)
            except (bce.BotoCoreError, bce.ClientError):
                pass  # the bucket's rule for incomplete uploads drops its parts
            raise

    def _part(
        self,
        bodies: Any,
        key: str,
        full: str,
        upload: str,
        number: int,
        body: bytes,
        algo: str | None,
        pause: Callable[[], None] | None,
    ) -> dict[str, Any]:
        if pause is not None:
            pause()
        checksum = self._checksum(body, algo)
        answer = self._call(
            f"uploading {key} (part {number})",
            bodies.upload_part,
            Bucket=self.bucket,
            Key=full,
            UploadId=upload,
            PartNumber=number,
            Body=body,
            **checksum,
        )
        if algo == "etag":
            self._check_etag(f"uploading {key} (part {number})", answer, body)
        part: dict[str, Any] = {"ETag": answer["ETag"], "PartNumber": number}
        if "ChecksumCRC32" in checksum:
            part["ChecksumCRC32"] = checksum["ChecksumCRC32"]
        return part

    def get_file(self, key: str, local: Path) -> None:
        """Download ``key`` into ``local`` through a temporary name (never half a file)."""
        local = Path(local)
        # Not durable: the caller checks the bytes, then publishes them durably.
        temp = f"{local.name}.{os.getpid()}.part"
        with atomic_path(local, mode=None, durable=False, temp=temp) as tmp:
            self._call(
                f"downloading {key}",
                self.client.download_file,
                self.bucket,
                self._key(key),
                str(tmp),
                Config=self.transfer,
            )

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            answer = self.client.get_object(
                Bucket=self.bucket,
                Key=self._key(key),
                Range=f"bytes={offset}-{offset + length - 1}",
            )
            return answer["Body"].read()
        except bce.ClientError as err:
            if _code(err) == "InvalidRange":  # past the object's end
                return b""
            if _not_found(err):
                raise FileNotFoundError(f"{key}: no such object on the mirror {self.url}") from None
            raise self._unavailable(f"reading {key}", err) from None
        except bce.BotoCoreError as err:
            raise self._unavailable(f"reading {key}", err) from None

    def put_bytes(self, key: str, data: bytes) -> None:
        """One PUT: S3 makes it visible whole, replacing any older object at once."""
        self.throttle.spend(len(data))
        self._call(
            f"writing {key}",
            self.client.put_object,
            Bucket=self.bucket,
            Key=self._key(key),
            Body=data,
        )

    def get_bytes(self, key: str) -> bytes | None:
        try:
            answer = self._call(
                f"reading {key}", self.client.get_object, Bucket=self.bucket, Key=self._key(key)
            )
            return answer["Body"].read()
        except FileNotFoundError:
            return None
        except (bce.BotoCoreError, bce.ClientError) as err:  # the body's read
            raise self._unavailable(f"reading {key}", err) from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        found = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full
            )
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = obj["Key"]
                    if self.prefix and not key.startswith(self.prefix + "/"):
                        continue
                    found.append(
                        ObjectInfo(
                            self._relative(key),
                            int(obj["Size"]),
                            obj["LastModified"].timestamp(),
                        )
                    )
        except (bce.BotoCoreError, bce.ClientError) as err:
            raise self._unavailable("listing", err) from None
        return sorted(found, key=lambda o: o.key)

    def list_after(self, start_after: str, prefix: str = "") -> list[ObjectInfo]:
        """The objects whose key starts with ``prefix`` and sorts after ``start_after``,
        sorted: one LIST request per 1,000 keys returned, whatever the prefix holds before
        ``start_after`` (the mirror's index asks what is newer than it knows)."""
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        extra = {"StartAfter": self._key(start_after)} if start_after else {}
        found = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full, **extra
            )
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = self._relative(obj["Key"])
                    if "/" in key or (start_after and key <= start_after):
                        continue
                    found.append(ObjectInfo(key, int(obj["Size"]), obj["LastModified"].timestamp()))
        except (bce.BotoCoreError, bce.ClientError) as err:
            raise self._unavailable("listing", err) from None
        return sorted(found, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        """S3 answers a delete of an absent key with success, as the protocol wants."""
        try:
            self._call(
                f"deleting {key}", self.client.delete_object, Bucket=self.bucket, Key=self._key(key)
            )
        except FileNotFoundError:
            pass


def _parts(pieces: Iterable[bytes], size: int) -> Iterator[bytes]:
    """``pieces`` regrouped into parts of ``size`` bytes (the last shorter); a piece of
    exactly ``size`` is handed on without a copy."""
    held: list[bytes] = []
    have = 0
    for piece in pieces:
        if not held and len(piece) == size:
            yield piece
            continue
        held.append(piece)
        have += len(piece)
        while have >= size:
            joined = b"".join(held)
            yield joined[:size]
            rest = joined[size:]
            held, have = ([rest] if rest else []), len(rest)
    if have:
        yield b"".join(held)


def _chain(first: bytes, second: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield second
    yield from rest


def _root_cause(err: BaseException) -> BaseException:
    """The botocore error under boto3's wrappers (S3UploadFailedError, retries exceeded)."""
    seen: set[int] = set()
    while id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (bce.ClientError, bce.BotoCoreError)):
            return err
        inner = getattr(err, "last_exception", None) or err.__cause__ or err.__context__
        if inner is None:
            return err
        err = inner
    return err


def _etag(answer: dict[str, Any]) -> str:
    """An answer's ETag without its quotes, lower case ("" when it has none)."""
    return str(answer.get("ETag") or "").strip('"').lower()


def _code(err: BaseException) -> str:
    root = _root_cause(err)
    if isinstance(root, bce.ClientError):
        return str(root.response.get("Error", {}).get("Code", ""))
    return ""


def _not_found(err: BaseException) -> bool:
    root = _root_cause(err)
    if not isinstance(root, bce.ClientError):
        return False
    status = root.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return _code(root) in ("NoSuchKey", "404", "NotFound") or (
        status == 404 and _code(root) != "NoSuchBucket"
    )
