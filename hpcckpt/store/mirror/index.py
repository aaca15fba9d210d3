"""The mirror's index: one small object, ``index.json`` beside the manifests, that says
which checkpoints the mirror holds, so that a copy and a prune cost the same requests
whether the mirror holds ten checkpoints or thousands.

The manifests stay the truth and the index is a cache of them: each entry is a
manifest's fields with the hash of its bytes and the checkpoint's status ("good",
"bad" with the mark's reason, "incomplete"). It is written whole (one PUT on S3, a
temporary name renamed on a directory mirror) after each copy's manifest, after a
prune's deletions and after a mark, each time re-read first so that only this writer's
own change is applied to what another writer left. :func:`load` believes it only
after a cheap check, one listing of the keys that sort after its newest checkpoint
(names are zero-padded steps, so that is the newest checkpoint's objects and anything
newer): a manifest newer than the index (a copy whose index write was lost to another
writer, or cut by a kill) is fetched and added; the newest it names gone (deleted by
hand or by another writer) sends it to :func:`reconcile`. A missing or unreadable index
is rebuilt from the manifests. What a call acts upon (the checkpoint it copies,
verifies or pulls, and its chain) is checked against its own objects by
:func:`confirm`, a listing of its name and its manifest, never taken from the index.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import xxhash

from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror.backend import MirrorBackend, MirrorUnavailable, ObjectInfo
from hpcckpt.store.retention import checkpoint_chain

log = logging.getLogger("hpcckpt.store")

#: The index's key, at the mirror's root beside the checkpoints.
INDEX = "index.json"
FORMAT = "hpcckpt mirror index"
VERSION = 1
#: Every checkpoint object's key starts so (data, manifest, mark).
PREFIX = "ckpt-"
GOOD, BAD, INCOMPLETE = "good", "bad", "incomplete"
UNREADABLE = "its manifest is not readable"


@dataclass
class Index:
    """What the mirror holds: ``entries`` by checkpoint name, each the manifest's fields
    (``manifest``), the hash of its bytes (``hash``), ``status`` and ``reason``."""

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: How :func:`load` got it: "read", "repaired" (newer manifests added) or "rebuilt".
    source: str = "read"

    def newest(self) -> str | None:
        """The name of the newest checkpoint it names (None: none)."""
        named = [(layout.step_of(n), n) for n in self.entries]
        steps = [(s, n) for s, n in named if s is not None]
        return max(steps)[1] if steps else None

    def to_bytes(self) -> bytes:
        data = {"format": FORMAT, "version": VERSION, "written_at": time.time()}
        data["entries"] = dict(sorted(self.entries.items()))
        return (json.dumps(data, separators=(",", ":")) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes | None) -> Index | None:
        """The index in ``raw``; None when absent, unreadable or of another version."""
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            if data.get("format") != FORMAT or data.get("version") != VERSION:
                return None
            entries = {str(k): dict(v) for k, v in data["entries"].items()}
            for e in entries.values():
                _mirrored(e)  # every entry must read back
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        return cls(entries)

    def listing(self) -> list[mirror.Mirrored]:
        """Its checkpoints as :func:`~.mirror.copy.list_mirrored` gives them, newest step
        first, a delta whose chain is not good there "broken chain"."""
        return _chains({n: _mirrored(e) for n, e in self.entries.items()})


def _mirrored(entry: dict[str, Any]) -> mirror.Mirrored:
    m = mirror.from_manifest(entry["manifest"])
    if entry.get("status", GOOD) != GOOD:
        m = replace(m, status=str(entry["status"]), reason=entry.get("reason"))
    return m


def _chains(found: dict[str, mirror.Mirrored]) -> list[mirror.Mirrored]:
    """``found`` newest first, judged as :func:`~.mirror.copy.list_mirrored` judges it."""
    return mirror.judge_chains(found)


def _list_after(backend: MirrorBackend, start_after: str, prefix: str) -> list[ObjectInfo]:
    """The objects after ``start_after`` whose key starts with ``prefix``: the backend's
    ``list_after`` (one request), else its whole listing filtered (another backend)."""
    fn = getattr(backend, "list_after", None)
    if fn is not None:
        return list(fn(start_after, prefix))
    return [o for o in backend.list(prefix) if o.key > start_after and "/" not in o.key]


def _entry(
    backend: MirrorBackend, name: str, objects: dict[str, ObjectInfo] | None
) -> dict[str, Any] | None:
    """The entry of ``name`` from its manifest, judged by the ``objects`` listed beside
    it (None: just copied and verified, good); None when its manifest is gone."""
    raw = backend.get_bytes(mirror.manifest_key(name))
    if raw is None:
        return None
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or manifest.get("version") != mirror.MANIFEST_VERSION:
            raise ValueError("another manifest version")
        mirror.from_manifest(manifest)
    except (ValueError, TypeError, KeyError):
        step = layout.step_of(name) or 0
        manifest = {"step": step, "file": name, "size": 0, "checksum": ""}
        return {"manifest": manifest, "hash": "", "bytes": len(raw), "status": INCOMPLETE,
                "reason": UNREADABLE}  # fmt: skip
    entry = {"manifest": manifest, "hash": xxhash.xxh3_64_hexdigest(raw), "bytes": len(raw)}
    entry.update(status=GOOD, reason=None)
    if objects is not None:
        _judge(backend, name, entry, objects)
    return entry


def _judge(
    backend: MirrorBackend, name: str, entry: dict[str, Any], objects: dict[str, ObjectInfo]
) -> None:
    """Set ``entry``'s status from the objects listed: marked bad, or its data missing
    or of another size than the manifest says."""
    manifest = entry["manifest"]  # a compressed copy's object is its stored size
    size = int(
        manifest["stored_size"]
        if manifest.get("stored_size") is not None
        else manifest.get("size", 0)
    )
    if mirror.bad_key(name) in objects:
        if entry.get("status") != BAD:
            entry.update(status=BAD, reason=mirror.bad_reason(backend, name))
    elif name not in objects or objects[name].size != size:
        have = "missing" if name not in objects else f"{objects[name].size} bytes"
        entry.update(
            status=INCOMPLETE, reason=f"its data is {have}, the manifest says {size} bytes"
        )
    elif entry.get("reason") != UNREADABLE:
        entry.update(status=GOOD, reason=None)


def _get(backend: MirrorBackend) -> bytes | None:
    """The stored index's bytes; None when absent or not readable by this user (another
    member of the group: read as missing, rebuilt from the manifests)."""
    try:
        return backend.get_bytes(INDEX)
    except MirrorUnavailable as exc:
        log.debug("mirror: the index %s cannot be read: %s", INDEX, exc)
        return None


def _put(backend: MirrorBackend, index: Index) -> bool:
    """Write the index; a mirror that refuses (read-only credentials, full) only costs
    the next reader a rebuild: whether it was written."""
    like = getattr(backend, "put_bytes_like", None)  # a directory: the checkpoints' modes
    newest = index.newest()
    try:
        if like is not None and newest is not None:
            like(INDEX, index.to_bytes(), newest)
        else:
            backend.put_bytes(INDEX, index.to_bytes())
    except MirrorUnavailable as exc:
        log.warning("mirror: the index %s was not written: %s", INDEX, exc)
        return False
    return True


def reconcile(backend: MirrorBackend, index: Index | None = None) -> Index:
    """The index made true to one listing of the whole mirror (``backend.list``: one
    request per 1,000 objects on S3): each manifest's entry taken from ``index`` (by
    default the stored one) when it has one of the same length, fetched otherwise;
    statuses from the objects listed. Written back when it changed or none was stored.
    What ``mirror ls`` and a command-line prune use, and how a missing or stale index
    is rebuilt."""
    stored = Index.parse(_get(backend)) if index is None else index
    base = stored.entries if stored is not None else {}
    objects = {o.key: o for o in backend.list() if "/" not in o.key}
    entries: dict[str, dict[str, Any]] = {}
    for key, info in objects.items():
        if not key.endswith(mirror.MANIFEST):
            continue
        name = key[: -len(mirror.MANIFEST)]
        if layout.step_of(name) is None:
            continue
        if name in base and base[name].get("bytes") == info.size:
            entry: dict[str, Any] | None = json.loads(json.dumps(base[name]))
        else:
            entry = _entry(backend, name, None)
        if entry is None:
            continue
        _judge(backend, name, entry, objects)
        entries[name] = entry
    out = Index(entries, source="read")
    if not entries and (stored is None or not stored.entries):  # nothing to keep
        return out
    if stored is None or not stored.entries or entries != stored.entries:
        out.source = "rebuilt" if stored is None or not stored.entries else "repaired"
        _put(backend, out)
    return out


def load(backend: MirrorBackend) -> Index:
    """The mirror's index, after the cheap check (one listing of what sorts after its
    newest checkpoint): newer manifests added, a missing newest or an unreadable index
    made good by :func:`reconcile`; written back when it changed."""
    index = Index.parse(_get(backend))
    if index is None:
        return reconcile(backend, Index())
    newest = index.newest()
    after = {o.key: o for o in _list_after(backend, newest or "", PREFIX)}
    if newest is not None and mirror.manifest_key(newest) not in after:
        return reconcile(backend, index)
    changed = False
    for key in sorted(after):
        if not key.endswith(mirror.MANIFEST):
            continue
        name = key[: -len(mirror.MANIFEST)]
        if layout.step_of(name) is None:
            continue
        entry = index.entries.get(name) if name == newest else None
        if entry is None:  # newer than the index: a copy it does not know yet
            entry = _entry(backend, name, after)
            if entry is None:
                continue
            index.entries[name] = entry
            changed = True
        elif mirror.bad_key(name) in after and entry.get("status") != BAD:
            _judge(backend, name, entry, after)
            changed = True
    if changed:
        index.source = "repaired"
        _put(backend, index)
    return index


def commit(
    backend: MirrorBackend,
    base: Index,
    add: dict[str, dict[str, Any]] | None = None,
    remove: Iterable[str] = (),
) -> Index:
    """Write the index with ``add`` (entries by name) and without ``remove``: applied to
    the stored index as re-read now (another writer's change since ``base`` was read
    stays), or to ``base`` when none can be read. The index written."""
    current = Index.parse(_get(backend)) or Index(dict(base.entries))
    for name in remove:
        current.entries.pop(name, None)
    current.entries.update(add or {})
    _put(backend, current)
    return current


def note_bad(backend: MirrorBackend, name: str, reason: str) -> None:
    """A mark was just written for ``name``: the stored index says so too (an absent or
    unreadable index is left for the next :func:`load` to rebuild, marks included)."""
    index = Index.parse(_get(backend))
    if index is None or name not in index.entries:
        return
    index.entries[name].update(status=BAD, reason=reason)
    _put(backend, index)


def confirm(backend: MirrorBackend, names: Iterable[str]) -> dict[str, mirror.Mirrored]:
    """The checkpoints ``names`` and the files of their chains as the mirror holds them
    now, read from their own objects (per name: one listing of its objects, its
    manifest, its mark's reason when marked), statuses as
    :func:`~.mirror.copy.list_mirrored` gives them; absent names are left out."""
    todo = list(names)
    found: dict[str, mirror.Mirrored] = {}
    seen: set[str] = set()
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        objects = {o.key: o for o in _list_after(backend, "", name)}
        if mirror.manifest_key(name) not in objects:
            continue
        entry = _entry(backend, name, objects)
        if entry is None:
            continue
        m = _mirrored(entry)
        found[name] = m
        todo.extend(c for c, _, _ in m.chain)
    return {m.name: m for m in _chains(found)}


def upload(
    backend: MirrorBackend,
    path: Path,
    *,
    verify_source: bool = True,
    pause: mirror.Pause | None = None,
) -> Copied:
    """:func:`~.mirror.copy.upload` of one checkpoint (``pause``: between its chunks),
    told what the mirror holds of it and its chain by :func:`confirm`, then the index
    updated with what was sent: the same requests whatever the number of checkpoints on
    the mirror."""
    _uid, chain = checkpoint_chain(path)
    known = confirm(backend, [path.name, *(c for c, _, _ in chain)])
    index = load(backend)
    uploaded = mirror.upload(backend, path, verify_source=verify_source, known=known, pause=pause)
    add = {}
    for name in uploaded.files:  # just copied and verified
        entry = _entry(backend, name, None)
        if entry is not None:
            add[name] = entry
    for name in (*uploaded.already, path.name):  # good there already: the index may lack it
        if name not in add and name not in index.entries and name in known:
            entry = _entry(backend, name, None)
            if entry is not None:
                add[name] = entry
    if add:
        index = commit(backend, index, add)
    return Copied(uploaded, index)


@dataclass(frozen=True)
class Copied:
    """What :func:`upload` did (``uploaded``) and the index it left (``index``)."""

    uploaded: mirror.Uploaded
    index: Index


if note_bad not in mirror.MARKED:  # a mark written anywhere reaches the index
    mirror.MARKED.append(note_bad)
