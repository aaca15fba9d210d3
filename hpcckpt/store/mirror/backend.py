"""Where the mirror (the second tier) keeps its objects: the protocol every backend
implements, a directory backend, the bandwidth cap, and ``open_backend`` for a URL.

A backend is a flat key/value store of whole objects (S3's model): a directory on
another file system and an S3 bucket behave the same to the code that mirrors
checkpoints (``store/mirror.py``). Keys use ``/`` as separator and never start with it.
"""

from __future__ import annotations

import errno
import importlib
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, runtime_checkable

from hpcckpt.store.io.durability import atomic_file, atomic_path


class MirrorUnavailable(Exception):
    """The mirror cannot be reached or refused the operation; str() says why, in words,
    without secrets."""


@dataclass(frozen=True)
class ObjectInfo:
    """One object of the mirror: its key, size in bytes and modification time (epoch s)."""

    key: str
    size: int
    mtime: float


@runtime_checkable
class MirrorBackend(Protocol):
    """What the mirror needs from a store of objects.

    Every method raises :class:`MirrorUnavailable` when the store cannot be reached or
    refuses (full, denied, timed out); ``get_bytes`` returns None for an absent key, the
    other reads raise ``FileNotFoundError``.
    """

    url: str  # for messages (no credentials)
    #: How a copy is verified: "auto", "checksum" (on receipt) or "readback"
    verify: str
    #: Compression of the copies: None, "auto" or "zstd" (:mod:`.mirror.compression`)
    compress: str | None

    @property
    def receipt_checked(self) -> bool:
        """Whether a :meth:`put_stream` is verified on receipt (no read-back needed)."""
        ...

    def put_file(self, local: Path, key: str) -> None:
        """Upload a whole file under ``key`` (replacing it), throttled by the backend's cap."""
        ...

    def put_stream(
        self,
        key: str,
        pieces: Iterable[bytes],
        like: Path | None = None,
        pause: Callable[[], None] | None = None,
    ) -> None:
        """Store the bytes of ``pieces`` (consumed in order, each spent through the cap)
        under ``key``: whole or not at all; an exception raised by ``pieces`` leaves no
        object. ``like``: the file whose permission bits the object keeps, where it can.
        ``pause``: called between the store's own requests (a save writing holds the
        copy there; ``pieces`` may hold it too), never inside one.

        ``receipt_checked`` says whether what arrived is known to be what was sent
        without reading it back (the store checked a checksum on receipt, or the bytes
        were written from the very buffer that was hashed)."""
        ...

    def get_file(self, key: str, local: Path) -> None:
        """Download the object ``key`` into the file ``local`` (replaced)."""
        ...

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes ``offset .. offset+length`` of the object (fewer at its end)."""
        ...

    def put_bytes(self, key: str, data: bytes) -> None:
        """Store a small object (manifests, markers), replacing it atomically."""
        ...

    def get_bytes(self, key: str) -> bytes | None:
        """A small object's bytes, or None when it is absent."""
        ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""
        ...

    def delete(self, key: str) -> None:
        """Remove an object; removing an absent one is not an error."""
        ...


class Throttle:
    """Caps bytes per second across threads; Throttle(None) is no cap.

    A token bucket holding at most a quarter second of bytes: a caller that spends more
    than what has accumulated sleeps until the rate allows it, so the copy never takes
    more than its share of the application's I/O for long.
    """

    def __init__(self, bytes_per_s: float | None) -> None:
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"a bandwidth cap must be positive, not {bytes_per_s!r} bytes/s")
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._available = 0.0
        self._last = time.monotonic()

    def spend(self, n: int) -> None:
        """Account ``n`` bytes about to be sent; sleep as needed to keep to the cap."""
        if self.bytes_per_s is None or n <= 0:
            return
        with self._lock:
            now = time.monotonic()
            burst = self.bytes_per_s / 4
            self._available = min(burst, self._available + (now - self._last) * self.bytes_per_s)
            self._last = now
            self._available -= n
            wait = -self._available / self.bytes_per_s if self._available < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


#: Bytes per chunk of a directory backend's copy (and of its throttle's accounting).
CHUNK = 8 << 20
#: Bytes per read and write of a directory backend's :meth:`~DirectoryBackend.put_stream`:
#: writes of 8 MiB ran at a fraction of ``copyfile``'s speed here, stalled by the
#: kernel's throttling of dirty pages; 1 MiB kept pace with it (benchmarks/bench_mirror.py).
STREAM_CHUNK = 1 << 20


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise ValueError(f"mirror key {key!r} is not a relative path of plain names")
    return key


class DirectoryBackend:
    """A directory on another file system as a mirror: one file per key.

    Every write goes to a temporary name in the same directory, is fsynced and then
    renamed over the key (and the directory fsynced), so a reader sees an object whole
    or not at all, and a cut copy leaves only a ``.part`` file that ``list`` ignores.
    A copied file keeps its source's permission bits, whatever the umask (the checkpoint
    directory's: 0600, or 0640 with ``share_group``), and an object written from bytes
    (``NAME.manifest.json``, ``NAME.bad``) takes those of the object ``NAME`` it
    describes, when the mirror holds it.
    """

    PART = ".part"

    def __init__(
        self,
        root: str | os.PathLike[str],
        throttle: Throttle | None = None,
        *,
        verify: str = "auto",
        compress: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.url = str(self.root)
        self.throttle = throttle or Throttle(None)
        self.verify = check_verify(verify)
        self.compress = compress
        self.read_chunk = STREAM_CHUNK
        self._sendfile = True  # until the file systems refuse it once

    @property
    def receipt_checked(self) -> bool:
        """A directory's copy is checked as it is made: the kernel's copy read back from
        the destination and checked against the checkpoint's hashes as it lands
        (:meth:`put_copied`), or written from the very buffers that were hashed
        (:meth:`put_stream`); a read-back after the fsync would read the same page
        cache again, so it is done only with ``verify="readback"``."""
        return self.verify != "readback"

    @property
    def kernel_copy(self) -> bool:
        """Whether an uncompressed copy goes through :meth:`put_copied` (no cap set: a
        cap meters the bytes through :meth:`put_stream`)."""
        return self.throttle.bytes_per_s is None

    def copy_range(self, src: int, dst: int, offset: int, count: int) -> int:
        """Copy up to ``count`` bytes of ``src`` from ``offset`` to ``dst`` at the same
        offset, in the kernel (``sendfile``, as ``shutil.copyfile``; read and write where
        the file systems refuse it); the bytes copied."""
        if self._sendfile:
            try:
                os.lseek(dst, offset, os.SEEK_SET)
                return os.sendfile(dst, src, offset, count)
            except OSError as err:
                if err.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                self._sendfile = False
        data = os.pread(src, count, offset)
        view = memoryview(data)
        while view:  # a short write is continued, never taken as done
            n = os.pwrite(dst, view, offset + len(data) - len(view))
            view = view[n:]
        return len(data)

    def put_copied(self, key: str, local: Path, copy: Callable[[int, int], None]) -> None:
        """Store the file ``local`` under ``key`` with its permission bits: ``copy(src,
        dst)`` fills the temporary file ``dst`` (open for reading and writing) from
        ``src`` and checks it, raising when it does not match; then it is fsynced, its
        size checked and renamed over the key, as :meth:`put_stream`. The source's own
        errors (gone, unreadable) are raised as they are, not as the mirror's."""
        src = os.open(local, os.O_RDONLY | os.O_CLOEXEC)
        try:
            try:
                os.posix_fadvise(src, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except (AttributeError, OSError):
                pass
            self._ensure_root()
            final = self._path(key)
            temp = f"{final.name}.{os.getpid()}.{threading.get_ident()}{self.PART}"
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                with atomic_path(final, mode=_permissions(local), temp=temp) as tmp:
                    dst = os.open(tmp, flags, 0o600)
                    try:
                        copy(src, dst)
                        want, got = os.fstat(src).st_size, os.fstat(dst).st_size
                        if got != want:
                            raise OSError(0, f"{want} bytes copied but the file holds {got}")
                    finally:
                        os.close(dst)
            except OSError as err:
                if isinstance(err, FileNotFoundError) and not self.root.is_dir():
                    raise MirrorUnavailable(f"the mirror directory {self.url} went away") from None
                raise self._unavailable(f"writing {key}", err) from None
        finally:
            os.close(src)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def _unavailable(self, what: str, err: OSError) -> MirrorUnavailable:
        return MirrorUnavailable(
            f"{what} on the mirror {self.url}: {os.strerror(err.errno or 0)}"
            if err.errno
            else f"{what} on the mirror {self.url}: {err}"
        )

    def _ensure_root(self) -> None:
        if not self.root.is_dir():
            raise MirrorUnavailable(
                f"the mirror directory {self.url} does not exist or is not a directory "
                "(mounted? create it, or give another mirror)"
            )

    def _write(self, key: str, fill: Callable[[BinaryIO], object], mode: int | None) -> None:
        self._ensure_root()
        final = self._path(key)
        temp = f"{final.name}.{os.getpid()}.{threading.get_ident()}{self.PART}"
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(final, mode=mode, temp=temp) as out:
                fill(out)
        except OSError as err:
            if isinstance(err, FileNotFoundError) and not self.root.is_dir():
                raise MirrorUnavailable(f"the mirror directory {self.url} went away") from None
            raise self._unavailable(f"writing {key}", err) from None

    def put_file(self, local: Path, key: str) -> None:
        def fill(out: BinaryIO) -> None:
            with open(local, "rb") as src:
                while chunk := src.read(CHUNK):
                    self.throttle.spend(len(chunk))
                    out.write(chunk)

        self._write(key, fill, _permissions(local))

    def put_stream(
        self,
        key: str,
        pieces: Iterable[bytes],
        like: Path | None = None,
        pause: Callable[[], None] | None = None,
    ) -> None:
        written = 0  # ``pause``: the pieces pause between reads, the writes follow them

        def fill(out: BinaryIO) -> None:
            nonlocal written
            fd = out.fileno()
            for piece in pieces:
                self.throttle.spend(len(piece))
                view = memoryview(piece)
                while view:  # a short write is continued, never taken as done
                    n = os.write(fd, view)
                    view = view[n:]
                written += len(piece)
            if os.fstat(fd).st_size != written:
                raise OSError(0, f"{written} bytes written but the file holds another size")

        self._write(key, fill, _permissions(like) if like is not None else None)

    def put_bytes(self, key: str, data: bytes) -> None:
        described = None
        for suffix in (".manifest.json", ".bad"):
            if key.endswith(suffix):
                described = key[: -len(suffix)]
        mode = _permissions(self._path(described)) if described else None
        self._write(key, lambda out: out.write(data), mode)

    def put_bytes_like(self, key: str, data: bytes, like: str) -> None:
        """Store a small object with the permission bits of the object ``like`` (the
        mirror's index takes its newest checkpoint's), atomically as :meth:`put_bytes`."""
        self._write(key, lambda out: out.write(data), _permissions(self._path(like)))

    def get_file(self, key: str, local: Path) -> None:
        self._ensure_root()
        src = self._path(key)
        try:
            # Not durable: the caller checks the bytes, then publishes them durably.
            with (
                open(src, "rb") as inp,
                atomic_file(local, mode=None, durable=False, temp=local.name + self.PART) as out,
            ):
                while chunk := inp.read(CHUNK):
                    out.write(chunk)
        except FileNotFoundError:
            raise
        except OSError as err:
            raise self._unavailable(f"reading {key}", err) from None

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        self._ensure_root()
        try:
            with open(self._path(key), "rb") as inp:
                return os.pread(inp.fileno(), length, offset)
        except FileNotFoundError:
            raise
        except OSError as err:
            raise self._unavailable(f"reading {key}", err) from None

    def get_bytes(self, key: str) -> bytes | None:
        self._ensure_root()
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise self._unavailable(f"reading {key}", err) from None

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        self._ensure_root()
        found = []
        try:
            for dirpath, _dirs, files in os.walk(self.root):
                for name in files:
                    if name.endswith(self.PART):
                        continue
                    path = Path(dirpath) / name
                    key = path.relative_to(self.root).as_posix()
                    if not key.startswith(prefix):
                        continue
                    try:
                        st = path.stat()
                    except FileNotFoundError:
                        continue
                    found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        except OSError as err:
            raise self._unavailable("listing", err) from None
        return sorted(found, key=lambda o: o.key)

    def list_after(self, start_after: str, prefix: str = "") -> list[ObjectInfo]:
        """The top-level objects whose key starts with ``prefix`` and sorts after
        ``start_after``, sorted by key: one read of the directory's names, and a stat of
        only those returned (the mirror's index asks what is newer than it knows)."""
        self._ensure_root()
        found = []
        try:
            with os.scandir(self.root) as entries:
                names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
        except OSError as err:
            raise self._unavailable("listing", err) from None
        for name in sorted(names):
            if name <= start_after or not name.startswith(prefix) or name.endswith(self.PART):
                continue
            try:
                st = (self.root / name).stat()
            except FileNotFoundError:
                continue
            found.append(ObjectInfo(name, st.st_size, st.st_mtime))
        return found

    def delete(self, key: str) -> None:
        self._ensure_root()
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            raise self._unavailable(f"deleting {key}", err) from None


VERIFY = ("auto", "checksum", "readback")


def check_verify(value: str) -> str:
    """``mirror_verify`` checked: "auto", "checksum" or "readback"."""
    text = str(value).strip().lower()
    if text not in VERIFY:
        raise ValueError(f"mirror_verify={value!r}: give 'auto', 'checksum' or 'readback'")
    return text


def _permissions(path: Path) -> int | None:
    """A file's permission bits, None when it is not there."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None


#: Backends for URL schemes, loaded by name when a URL of theirs is opened: the S3
#: backend needs boto3 (the optional extra ``hpcckpt[s3]``), and it implements this
#: module's protocol, so this module names it instead of importing it.
SCHEMES: dict[str, str] = {"s3": "hpcckpt.store.mirror.s3:S3Backend"}

ACCEPTED = "a directory path, file:///path, or s3://bucket/prefix"


def check_url(url: str) -> str:
    """``url`` stripped when it is a form :func:`open_backend` accepts (ValueError naming
    the accepted forms otherwise); opens nothing and imports no client."""
    text = str(url).strip()
    if not text:
        raise ValueError(f"the mirror URL is empty; give {ACCEPTED}")
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", text)
    if match is None:
        return text
    scheme = match.group(1).lower()
    if scheme == "file" and not text[len("file://") :].startswith("/"):
        raise ValueError(
            f"mirror URL {text!r}: a file:// URL needs an absolute path (file:///project/run)"
        )
    if scheme == "s3" and not text[len("s3://") :].split("/")[0]:
        raise ValueError(f"mirror URL {text!r} names no bucket; write s3://bucket/prefix")
    if scheme != "file" and scheme not in SCHEMES:
        raise ValueError(f"mirror URL {text!r}: unknown scheme {scheme!r}; give {ACCEPTED}")
    return text


def open_backend(
    url: str,
    bandwidth: float | None = None,
    *,
    verify: str = "auto",
    compress: str | None = None,
) -> MirrorBackend:
    """The backend for a mirror URL: ``s3://bucket/prefix`` -> the S3 backend, a path or
    ``file://`` URL -> :class:`DirectoryBackend`; ``bandwidth`` caps uploads (bytes/s);
    ``verify`` and ``compress`` as :class:`~.mirror.options.MirrorOptions` says."""
    text = str(url).strip()
    if not text:
        raise ValueError(f"the mirror URL is empty; give {ACCEPTED}")
    throttle = Throttle(bandwidth)
    how = {"verify": verify, "compress": compress}
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", text)
    if match is None:
        return DirectoryBackend(Path(text).expanduser(), throttle, **how)
    scheme = match.group(1).lower()
    if scheme == "file":
        path = text[len("file://") :]
        if not path.startswith("/"):
            raise ValueError(
                f"mirror URL {text!r}: a file:// URL needs an absolute path (file:///project/run)"
            )
        return DirectoryBackend(Path(path), throttle, **how)
    if scheme in SCHEMES:
        module, name = SCHEMES[scheme].split(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError as err:
            raise ValueError(
                f"mirror URL {text!r} needs the S3 client: pip install 'hpcckpt[s3]' ({err})"
            ) from None
        return cls(text, throttle=throttle, **how)
    raise ValueError(f"mirror URL {text!r}: unknown scheme {scheme!r}; give {ACCEPTED}")


_UNITS = {
    "": 1,
    "K": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "KI": 1 << 10,
    "MI": 1 << 20,
    "GI": 1 << 30,
    "TI": 1 << 40,
}


def parse_bandwidth(text: str) -> float:
    """A bandwidth as bytes per second: "500M", "1G", "200MB/s", "1.5GiB/s", "1000000"
    (decimal units; ``Ki``/``Mi``/``Gi`` binary)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?)?\s*(?:B)?\s*(?:/s)?\s*", str(text))
    if match is None:
        raise ValueError(
            f"bandwidth {text!r} is not a rate; write bytes per second with an optional "
            "unit, like 500M, 1G, 200MB/s or 1.5GiB/s"
        )
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").upper()]
    if value <= 0:
        raise ValueError(f"bandwidth {text!r} must be more than zero bytes per second")
    return value
