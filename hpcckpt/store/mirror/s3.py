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

import os
import re
from pathlib import Path
from typing import Any

from hpcckpt.store.io.durability import atomic_path
from hpcckpt.store.mirror.backend import MirrorUnavailable, ObjectInfo, Throttle

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


def _config(connect_timeout: float, read_timeout: float, attempts: int) -> Any:
    options: dict[str, Any] = {
        "connect_timeout": connect_timeout,
        "read_timeout": read_timeout,
        "retries": {"total_max_attempts": attempts, "mode": "standard"},
        "max_pool_connections": max(10, 2 * CONCURRENCY),
        "tcp_keepalive": True,
    }
    try:
        # Range reads must not be checked against the whole object's checksum (some stores
        # send it with a part); the mirror checks every byte against the checkpoint's own
        # checksums instead. Uploads still carry a checksum when the store supports it.
        return Config(**options, response_checksum_validation="when_required")
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
    ) -> None:
        if boto3 is None:
            raise ValueError(
                f"mirror URL {url!r} needs the S3 client boto3, which is not installed: "
                f"{INSTALL} ({MISSING})"
            )
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.throttle = throttle or Throttle(None)
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
        except bce.BotoCoreError as err:  # a bad profile, an unreadable config file
            raise MirrorUnavailable(
                f"the S3 client for {self.url} could not start: {err}"
            ) from None
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

    def delete(self, key: str) -> None:
        """S3 answers a delete of an absent key with success, as the protocol wants."""
        try:
            self._call(
                f"deleting {key}", self.client.delete_object, Bucket=self.bucket, Key=self._key(key)
            )
        except FileNotFoundError:
            pass


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
