"""Checkpoints on the mirror (the second tier): upload one verified, list and check what
the mirror holds, pull one back, mark a copy bad.

On the mirror a checkpoint ``ckpt-<step>.h5`` is three objects under the backend's root:

- ``ckpt-<step>.h5``: the checkpoint file's bytes, as in the directory;
- ``ckpt-<step>.h5.manifest.json``: written last, only after what arrived was known to
  be the checkpoint's bytes (the store checked a checksum on receipt, a directory's copy
  was checked at its destination, or it was read back and compared), the bytes themselves
  checked against the checkpoint's own array checksums. Without it the data object is an
  upload in progress or a cut one, never a good checkpoint;
- ``ckpt-<step>.h5.bad``: a copy found damaged (at a pull or a verify): skipped from then on.

An incremental checkpoint is mirrored with its chain: each file of the chain is a
checkpoint of its own there (uploaded first, with its manifest), and the manifest of a
delta names the uid of every file it is built on; a mirrored checkpoint is good only
while every file of its chain is, with those uids.

Every function is one process, no MPI (rank 0's background worker, restore on rank 0,
and the ``hpcckpt mirror`` commands use them). Backends raise
:class:`~.mirror.backend.MirrorUnavailable` when the mirror cannot be reached.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.io.durability import atomic_path, rename
from hpcckpt.store.io.safety import FILE_MODE
from hpcckpt.store.mirror import compression, priority
from hpcckpt.store.mirror.backend import CHUNK, MirrorBackend, MirrorUnavailable
from hpcckpt.store.mirror.source import (
    CopyMismatch,
    SourceCheck,
    Streamed,
    copy_checked,
    read_source,
)
from hpcckpt.store.retention import checkpoint_chain, checkpoint_time

MANIFEST = ".manifest.json"
BAD = ".bad"
#: A pull's file before it verified; the next pull of that step replaces it.
PULLING = ".pulling"
#: The manifest's own format version.
MANIFEST_VERSION = 1
#: The checksum of a whole file (end to end: computed on the bytes read locally and on
#: the bytes read back from the mirror, never the store's own checksum).
ALGORITHM = "xxh3_64"
#: Bytes per request when a copy is read back from the mirror: every request costs a round
#: trip, and some servers (rclone serve s3 over files) hash the whole object per request,
#: so few large ranges; this is also the read-back's memory (benchmarks/bench_mirror.py).
READBACK = 64 << 20


class MirrorCopyBad(CheckpointError):
    """A mirrored checkpoint's bytes do not match its manifest (it is marked bad there)."""


@dataclass(frozen=True)
class Mirrored:
    """One checkpoint as the mirror holds it (from its manifest)."""

    step: int
    name: str
    size: int
    checksum: str  # hex xxh3-64 of the whole file
    uid: str | None
    chain: tuple[tuple[str, int, str], ...]  # (name, step, uid) of the files it is built on
    time: float  # when the checkpoint was written
    mirrored_at: float
    #: "good", "bad" (marked), "incomplete" (its data or a chain file is missing, or the
    #: size differs), "broken chain" (a file it needs is bad or another checkpoint now)
    status: str = "good"
    reason: str | None = None
    #: The object as stored: None when it is the file's bytes as they are, else its
    #: encoding (:data:`.compression.ENCODING`), size and xxh3-64.
    encoding: str | None = None
    stored_size: int | None = None
    stored_checksum: str | None = None

    @property
    def object_size(self) -> int:
        """The data object's size on the mirror."""
        return self.size if self.stored_size is None else self.stored_size

    @property
    def object_checksum(self) -> str:
        """The xxh3-64 of the data object's bytes on the mirror."""
        return self.checksum if self.stored_checksum is None else self.stored_checksum

    @property
    def good(self) -> bool:
        return self.status == "good"

    def to_dict(self) -> dict[str, Any]:
        """As plain data (``--json``)."""
        return {
            "step": self.step,
            "file": self.name,
            "size": self.size,
            "checksum": f"{ALGORITHM}:{self.checksum}",
            "uid": self.uid,
            "chain": [name for name, _, _ in self.chain],
            "time": self.time,
            "mirrored_at": self.mirrored_at,
            "status": self.status,
            "reason": self.reason,
            "encoding": self.encoding,
            "stored_size": self.object_size,
        }


@dataclass(frozen=True)
class Uploaded:
    """What :func:`upload` did: the checkpoint, the files sent (chain files first) with
    their bytes and the seconds it took, and the files the mirror held already (good,
    the same uid: not sent again)."""

    step: int
    files: tuple[str, ...] = ()
    bytes: int = 0
    seconds: float = 0.0
    already: tuple[str, ...] = field(default=())  # chain files the mirror held already


#: What a caller already knows of the mirror: the checkpoints a call needs (itself and its
#: chain) by name, their status checked (None: the call lists every manifest).
Known = Mapping[str, Mirrored] | None


#: Called with (backend, name, reason) once a mark is written: the mirror's index
#: (:mod:`.mirror.index`, which imports this module) registers itself, so that it says so.
MARKED: list[Callable[[MirrorBackend, str, str], None]] = []


def manifest_key(name: str) -> str:
    return name + MANIFEST


def bad_key(name: str) -> str:
    return name + BAD


def file_checksum(path: Path, spend: Callable[[bytes], None] | None = None) -> str:
    """Hex xxh3-64 of a file's bytes, read in chunks (each also given to ``spend``)."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if spend is not None:
                spend(chunk)
    return h.hexdigest()


#: Called by a copy between its chunks: returns when the copy may go on (the mirror's
#: worker passes its gate's ``wait_open``: a save writing holds the copy there).
Pause = Callable[[], None]


def remote_checksum(backend: MirrorBackend, key: str, size: int, pause: Pause | None = None) -> str:
    """Hex xxh3-64 of an object's bytes as the mirror gives them back (read in ranges,
    ``pause`` called before each); MirrorCopyBad when it holds fewer bytes than ``size``."""
    h = xxhash.xxh3_64()
    offset = 0
    while offset < size:
        if pause is not None:
            pause()
        chunk = backend.read_range(key, offset, min(READBACK, size - offset))
        if not chunk:
            raise MirrorCopyBad(f"{key} on the mirror ends at byte {offset} of {size}")
        h.update(chunk)
        offset += len(chunk)
    return h.hexdigest()


def _manifest(backend: MirrorBackend, name: str) -> dict[str, Any] | None:
    raw = backend.get_bytes(manifest_key(name))
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) and data.get("version") == MANIFEST_VERSION else None


def from_manifest(data: dict[str, Any]) -> Mirrored:
    """The checkpoint a manifest's fields describe (status "good": its objects decide)."""
    return Mirrored(
        step=int(data["step"]),
        name=str(data["file"]),
        size=int(data["size"]),
        checksum=str(data["checksum"]),
        uid=data.get("uid"),
        chain=tuple((str(n), int(s), str(u)) for n, s, u in data.get("chain", [])),
        time=float(data.get("time", 0.0)),
        mirrored_at=float(data.get("mirrored_at", 0.0)),
        encoding=data.get("encoding"),
        stored_size=None if data.get("stored_size") is None else int(data["stored_size"]),
        stored_checksum=data.get("stored_checksum"),
    )


def list_mirrored(backend: MirrorBackend) -> list[Mirrored]:
    """Every checkpoint the mirror holds a manifest for, newest step first, each with its
    status: "good", "bad" (marked, with the reason), "incomplete" (data missing or of
    another size) or "broken chain" (a file it is built on is not good there).

    Checks sizes and marks only, not the bytes: :func:`verify_mirrored` reads them.
    """
    objects = {o.key: o for o in backend.list()}
    found: dict[str, Mirrored] = {}
    for key in objects:
        if not key.endswith(MANIFEST):
            continue
        name = key[: -len(MANIFEST)]
        if layout.step_of(name) is None:
            continue
        data = _manifest(backend, name)
        if data is None:
            found[name] = Mirrored(
                layout.step_of(name) or 0, name, 0, "", None, (), 0.0, 0.0,
                "incomplete", "its manifest is not readable",
            )  # fmt: skip
            continue
        m = from_manifest(data)
        if bad_key(name) in objects:
            m = _with(m, "bad", bad_reason(backend, name))
        elif name not in objects or objects[name].size != m.object_size:
            have = "missing" if name not in objects else f"{objects[name].size} bytes"
            m = _with(
                m, "incomplete", f"its data is {have}, the manifest says {m.object_size} bytes"
            )
        found[name] = m
    return judge_chains(found)


def judge_chains(found: dict[str, Mirrored]) -> list[Mirrored]:
    """``found`` (by name) newest step first, a good one whose chain is not good on the
    mirror turned "broken chain" with the reason (``found`` is updated too)."""
    out = []
    for m in sorted(found.values(), key=lambda m: m.step):  # chains point to older steps
        if m.good:
            for cname, _, cuid in m.chain:
                base = found.get(cname)
                if base is None or not base.good or base.uid != cuid:
                    why = "missing" if base is None else (base.reason or base.status)
                    if base is not None and base.good:
                        why = "another checkpoint of that step now"
                    m = _with(m, "broken chain", f"{cname} it is built on: {why}")
                    break
            found[m.name] = m
        out.append(m)
    return sorted(out, key=lambda m: m.step, reverse=True)


def _with(m: Mirrored, status: str, reason: str | None) -> Mirrored:
    return Mirrored(**{**m.__dict__, "status": status, "reason": reason})


def bad_reason(backend: MirrorBackend, name: str) -> str:
    """Why a mirrored checkpoint was marked bad (its mark's reason)."""
    raw = backend.get_bytes(bad_key(name))
    try:
        return str(json.loads(raw or b"{}").get("reason") or layout.MARKED)
    except (ValueError, AttributeError):
        return layout.MARKED


def newest_good(backend: MirrorBackend) -> Mirrored | None:
    """The newest good mirrored checkpoint (None: none)."""
    return next((m for m in list_mirrored(backend) if m.good), None)


def mark_bad(backend: MirrorBackend, name: str, reason: str) -> None:
    """Mark a mirrored checkpoint bad (its data stays for inspection)."""
    record = {"reason": reason, "time": time.time()}
    backend.put_bytes(bad_key(name), (json.dumps(record) + "\n").encode())
    for hook in MARKED:
        hook(backend, name, reason)


@dataclass(frozen=True)
class Verified:
    """What :func:`verify_mirrored` found for one mirrored checkpoint."""

    step: int
    name: str
    good: bool
    problems: tuple[str, ...]
    marked: bool  # marked bad now by this check

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "file": self.name,
            "good": self.good,
            "problems": list(self.problems),
            "marked_bad": self.marked,
        }


def verify_mirrored(
    backend: MirrorBackend, name: str, *, mark: bool = True, known: Known = None
) -> Verified:
    """Read a mirrored checkpoint back and compare its xxh3-64 with its manifest (and
    check the files of its chain the same way); with ``mark``, a copy that fails is
    marked bad on the mirror. ``name`` is ``ckpt-<step>.h5`` or the step as text.
    ``known``: the checkpoint and its chain as the mirror holds them (the index's
    :func:`~.mirror.index.confirm`), instead of listing every manifest."""
    name = _name(name)
    step = layout.step_of(name) or 0
    listing = dict(known) if known is not None else {m.name: m for m in list_mirrored(backend)}
    m = listing.get(name)
    if m is None:
        return Verified(step, name, False, ("not on the mirror (no manifest)",), False)
    problems: list[str] = []
    if m.status in ("bad", "incomplete"):
        problems.append(f"{m.status}: {m.reason}")
    marked = False
    for part in [*(listing.get(c) for c, _, _ in m.chain), m]:
        if part is None or part.status in ("bad", "incomplete"):
            continue
        try:
            got = remote_checksum(backend, part.name, part.object_size)
            want = part.object_checksum
            why = None if got == want else f"checksum {got} != manifest {want}"
        except (MirrorCopyBad, FileNotFoundError) as exc:
            why = str(exc) or "its data is missing"
        if why is not None:
            problems.append(f"{part.name}: {why}")
            if mark:
                mark_bad(backend, part.name, why)
                marked = True
    if not problems and m.status != "good":
        problems.append(f"{m.status}: {m.reason}")
    return Verified(step, name, not problems, tuple(problems), marked)


def _name(name: str | int) -> str:
    text = str(name)
    if text.isdigit():
        return layout.checkpoint_name(int(text))
    if layout.step_of(text) is None:
        raise ValueError(f"{text!r} is not a checkpoint name (ckpt-<step>.h5) or a step")
    return text


def pull(
    backend: MirrorBackend,
    name: str | int,
    directory: str | os.PathLike[str],
    *,
    mode: int = FILE_MODE,
    known: Known = None,
) -> Path:
    """Fetch a good mirrored checkpoint (and the files of its chain the directory lacks)
    into ``directory``; each file is checked against its manifest before it gets its
    name there (durably), with the directory's file ``mode``. The path of the checkpoint.

    MirrorCopyBad when a file's bytes do not match (it is marked bad on the mirror);
    CheckpointError when the checkpoint is not good on the mirror; FileExistsError when
    the directory holds another checkpoint of that step (never replaced).
    """
    name = _name(name)
    root = Path(directory)
    listing = dict(known) if known is not None else {m.name: m for m in list_mirrored(backend)}
    m = listing.get(name)
    if m is None or not m.good:
        why = "not on the mirror" if m is None else f"{m.status}: {m.reason}"
        raise CheckpointError(f"{name} cannot be pulled from {backend.url}: {why}")
    root.mkdir(parents=True, exist_ok=True)
    for cname, _, cuid in m.chain:  # oldest first: a delta is never there without its base
        local = root / cname
        if local.exists():
            if checkpoint_chain(local)[0] == cuid:
                continue
            raise FileExistsError(
                f"{local} is another checkpoint than the one {name} is built on; move it "
                "aside to pull this one"
            )
        _fetch(backend, listing[cname], root, mode)
    target = root / name
    if target.exists():
        if checkpoint_chain(target)[0] == m.uid and file_checksum(target) == m.checksum:
            return target
        raise FileExistsError(f"{target} exists and is another file; move it aside to pull")
    return _fetch(backend, m, root, mode)


def _fetch(backend: MirrorBackend, m: Mirrored, root: Path, mode: int) -> Path:
    final = root / m.name
    with atomic_path(final, mode=mode, temp=m.name + PULLING) as tmp:
        try:
            backend.get_file(m.name, tmp)
        except FileNotFoundError:
            mark_bad(backend, m.name, "its data object is missing")
            raise MirrorCopyBad(
                f"{m.name} on the mirror {backend.url}: its data is missing"
            ) from None
        if m.encoding is not None:
            _decode_in_place(tmp, m)
        got = file_checksum(tmp)
        if got != m.checksum or tmp.stat().st_size != m.size:
            why = f"pulled bytes do not match its manifest ({ALGORITHM} {got} != {m.checksum})"
            mark_bad(backend, m.name, why)
            raise MirrorCopyBad(f"{m.name} on the mirror {backend.url}: {why}; marked bad there")
    layout.clear_marks(final)  # marks beside the name judged another file
    return final


def _decode_in_place(tmp: Path, m: Mirrored) -> None:
    """Replace the downloaded encoded object ``tmp`` by the file it encodes (checked by
    the caller against the manifest); MirrorCopyBad when it does not decode."""
    if m.encoding != compression.ENCODING:
        raise CheckpointError(
            f"{m.name} on the mirror is stored as {m.encoding!r}, which this hpcckpt does "
            "not know; upgrade hpcckpt"
        )
    encoded = tmp.with_name(tmp.name + ".zst")
    rename(tmp, encoded, durable=False)  # a scratch name, removed below
    try:
        with open(encoded, "rb", buffering=CHUNK) as src, open(tmp, "wb") as out:
            try:
                compression.decode(src, out.write)
            except ValueError as exc:
                raise MirrorCopyBad(f"{m.name} on the mirror does not decode: {exc}") from None
    finally:
        encoded.unlink(missing_ok=True)


def upload(
    backend: MirrorBackend,
    path: Path,
    *,
    verify_source: bool = True,
    known: Known = None,
    pause: Pause | None = None,
) -> Uploaded:
    """Mirror one committed checkpoint of a directory, with the files of its chain the
    mirror lacks (oldest first). Each file is read once: checked against its own
    checksums (``verify_source``) and hashed as its bytes are sent (compressed where
    the backend's ``compress`` says), or, to a directory, copied by the kernel and
    checked at its destination; what arrived is checked by the store on receipt, or
    read back and compared where the store checks nothing; only then it gets its
    manifest. ``known``: the checkpoint and its chain as the mirror holds them (the index's
    :func:`~.mirror.index.confirm`), instead of listing every manifest. ``pause`` is
    called between chunks (read, copied, read back; an S3 part is never held mid-request):
    it holds the copy while a save writes.

    CheckpointError when the local checkpoint (or a file it needs) is missing or bad;
    MirrorCopyBad when the bytes read back or copied differ; MirrorUnavailable from the backend
    (also when the store refused a part for its checksum: damaged on the way).
    """
    t0 = time.perf_counter()
    step = layout.step_of(path.name)
    if step is None:
        raise ValueError(f"{path} is not a checkpoint file (ckpt-<step>.h5)")
    priority.lower_background()
    uid, chain = checkpoint_chain(path)
    mirrored = dict(known) if known is not None else {m.name: m for m in list_mirrored(backend)}
    have = mirrored.get(path.name)
    if have is not None and have.good and uid is not None and have.uid == uid:
        return Uploaded(step, (), 0, time.perf_counter() - t0, (path.name,))  # there already
    check = SourceCheck(path) if verify_source else None  # CheckpointError when bad
    sent: list[str] = []
    already: list[str] = []
    total = 0
    for cname, _cstep, cuid in chain:
        have = mirrored.get(cname)
        if have is not None and have.good and have.uid == cuid:
            already.append(cname)
            continue
        local = path.parent / cname
        if not local.exists() or checkpoint_chain(local)[0] != cuid:
            raise CheckpointError(
                f"{path.name} is not mirrored: {cname} it is built on is neither in "
                f"{path.parent} nor good on the mirror"
            )
        total += _send(backend, local, pause=pause)  # verified as part of the chain
        sent.append(cname)
    total += _send(backend, path, uid=uid, chain=chain, check=check, pause=pause)
    sent.append(path.name)
    return Uploaded(step, tuple(sent), total, time.perf_counter() - t0, tuple(already))


def _send(
    backend: MirrorBackend,
    local: Path,
    uid: str | None = None,
    chain: list[tuple[str, int, str]] | None = None,
    check: SourceCheck | None = None,
    pause: Pause | None = None,
) -> int:
    """Upload one file in one pass over its bytes (checked by ``check``, hashed, maybe
    compressed, sent), make sure what arrived is what was sent, then write its manifest.
    Its size."""
    if uid is None and chain is None:
        uid, chain = checkpoint_chain(local)
    name = local.name
    backend.delete(manifest_key(name))  # an older copy of this name stops counting first
    backend.delete(bad_key(name))
    seen = Streamed()
    encoder = _encoder(backend, check)
    stored = _Tally()
    t0 = time.perf_counter()
    if encoder is None and check is not None and getattr(backend, "kernel_copy", False):
        _copy_checked(backend, local, check, seen, pause)  # the kernel copies, checked
        stored.size, stored.hex = seen.size, seen.checksum
    else:
        chunk = getattr(backend, "read_chunk", CHUNK)
        pieces = read_source(local, chunk, check, seen, pause)
        if encoder is not None:
            pieces = stored.count(encoder.encode(pieces))
        backend.put_stream(name, pieces, local, pause=pause)  # between the store's requests
        if encoder is None:  # the bytes sent are the bytes read, hashed once as they were
            stored.size, stored.hex = seen.size, seen.checksum
    _rates(backend).note(seen.size, stored.size, time.perf_counter() - t0, encoder)
    if not backend.receipt_checked:  # the store checks nothing on receipt: read it back
        got = remote_checksum(backend, name, stored.size, pause)
        if got != stored.checksum:
            raise MirrorCopyBad(
                f"{name}: the bytes read back from {backend.url} differ from the bytes "
                f"sent ({ALGORITHM} {got} != {stored.checksum}); not marked good"
            )
    manifest = {
        "version": MANIFEST_VERSION,
        "step": layout.step_of(name),
        "file": name,
        "size": seen.size,
        "checksum": seen.checksum,
        "algorithm": ALGORITHM,
        "uid": uid,
        "chain": [list(c) for c in chain or []],
        "time": checkpoint_time(local),
        "mirrored_at": time.time(),
    }
    if encoder is not None:
        manifest.update(
            encoding=compression.ENCODING, stored_size=stored.size, stored_checksum=stored.checksum
        )
    backend.put_bytes(manifest_key(name), (json.dumps(manifest) + "\n").encode())
    return seen.size


def _copy_checked(
    backend: Any, local: Path, check: SourceCheck, seen: Streamed, pause: Pause | None
) -> None:
    """A directory mirror's copy made by the kernel and checked at its destination
    (:func:`.source.copy_checked`); when the destination fails, the source is checked
    alone: CheckpointError when it is the damaged one, else MirrorCopyBad."""
    try:
        backend.put_copied(
            local.name,
            local,
            lambda src, dst: copy_checked(src, dst, check, seen, backend.copy_range, pause=pause),
        )
    except CopyMismatch as exc:
        for _ in read_source(local, CHUNK, SourceCheck(local), Streamed()):
            pass  # CheckpointError here: the checkpoint itself is damaged
        raise MirrorCopyBad(
            f"{local.name}: the copy on {backend.url} is not the checkpoint's bytes ({exc}); "
            "not marked good"
        ) from None


class _Tally:
    """Counts and hashes the bytes handed to the store (the object's own size and xxh3)."""

    def __init__(self) -> None:
        self.size = 0
        self._h = xxhash.xxh3_64()
        self.hex: str | None = None  # the checksum, when known without hashing here

    @property
    def checksum(self) -> str:
        return self.hex if self.hex is not None else self._h.hexdigest()

    def count(self, pieces: Any) -> Any:
        for piece in pieces:
            self._h.update(piece)
            self.size += len(piece)
            yield piece


def _encoder(backend: MirrorBackend, check: SourceCheck | None) -> compression.Encoder | None:
    """The encoder for this copy, when the backend's ``compress`` asks for one."""
    how = getattr(backend, "compress", None)
    if how is None or not compression.available():
        return None
    if how == "auto" and not _rates(backend).pays(backend.throttle.bytes_per_s):
        return None
    return compression.Encoder(check.width_at if check is not None else None)


def _rates(backend: MirrorBackend) -> compression.Rates:
    """The rates this process saw for ``backend`` (kept on it)."""
    rates = getattr(backend, "rates", None)
    if rates is None:
        rates = compression.Rates()
        backend.rates = rates  # type: ignore[attr-defined]
    return rates


def delete_mirrored(backend: MirrorBackend, name: str) -> None:
    """Remove a checkpoint from the mirror: its manifest first (it stops counting at
    once), then its data and its mark."""
    backend.delete(manifest_key(name))
    backend.delete(name)
    backend.delete(bad_key(name))


__all__ = [
    "MirrorCopyBad",
    "MirrorUnavailable",
    "Mirrored",
    "Uploaded",
    "Verified",
    "delete_mirrored",
    "list_mirrored",
    "mark_bad",
    "newest_good",
    "pull",
    "upload",
    "verify_mirrored",
]
