"""What a checkpoint directory holds, for people and scripts: list, describe, verify.

One process, plain h5py, no MPI: the ``hpcckpt ls/inspect/verify`` commands run on a
login node without mpirun. Results are plain dicts, ready for ``--json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.mirror import index as mirror_index
from hpcckpt.store.mirror.backend import MirrorBackend, MirrorUnavailable
from hpcckpt.store.retention import checkpoint_chain
from hpcckpt.store.tree.queries import scalar_leaves

GOOD, BAD, PARTIAL = "good", "bad", "partial"
REJECTED = "rejected"  # kept aside by the poisoned-state guard, never restored
ABSENT = "absent"  # not in the directory (a row of a checkpoint only the mirror holds)
#: A tier's status when the mirror holds another checkpoint under the same name (another
#: uid: written again after a restart from an older step), or could not be asked.
OTHER, UNREACHABLE = "another checkpoint", "unreachable"


def list_directory(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every checkpoint and partial file of ``directory``, oldest step first.

    ``status`` is "good" when the file is committed, not marked bad and its structure
    is sound (checksums are not read: that is :func:`verify`), "bad" when marked bad
    or structurally broken, "partial" for an unfinished save. An incremental
    checkpoint is "bad" too when a file of its chain is missing, marked bad or
    replaced. ``kind`` is "full" or "incremental"; ``base`` the step of the full
    checkpoint an incremental one is built on; ``written`` the array bytes the save
    wrote (all ranks) and ``dirty`` the fraction of the state's blocks among them.
    """
    root = Path(directory)
    rows = []
    for e in layout.scan(root):
        row: dict[str, Any] = {
            "step": e.step,
            "file": e.path.name,
            "size": _size(e.path),
            "time": None,
            "ranks": None,
            "kind": "full",
            "base": None,
            "written": None,
            "dirty": None,
            "status": GOOD if e.good_candidate else BAD,
            "reason": e.bad_reason,
        }
        try:
            with CheckpointReader(e.path, resolve_chain=False) as r:
                row.update(time=r.time, ranks=r.nranks, kind=r.kind)
                row.update(_chain_columns(r))
            with CheckpointReader(e.path):  # the chain: present, unmarked, the same files
                pass
        except CheckpointError as exc:
            row.update(status=BAD, reason=row["reason"] or str(exc))
        rows.append(row)
    for p in layout.partials(root):
        step = layout.partial_step(p.name)
        rows.append(
            {
                "step": step,
                "file": p.name,
                "size": _size(p),
                "time": None,
                "ranks": None,
                "kind": None,
                "base": None,
                "written": None,
                "dirty": None,
                "status": PARTIAL,
                "reason": "unfinished save; the next save removes it",
            }
        )
    rows.extend(_rejected_rows(root))  # kept aside by the poisoned-state guard (coord/validate.py)
    rows.sort(key=lambda row: (row["step"] if row["step"] is not None else -1, row["file"]))
    return rows


def with_tiers(
    directory: str | os.PathLike[str],
    rows: list[dict[str, Any]],
    backend: MirrorBackend | None,
) -> str | None:
    """Add each row's ``tiers``: where the checkpoint is and its status in each.

    ``tiers["directory"]`` is the row's status (None when only the mirror holds it);
    with a mirror, ``tiers["mirror"]`` is its status there ("good", "bad", "incomplete",
    "broken chain", "another checkpoint" of that step, None: not mirrored, or
    "unreachable"). Checkpoints only the mirror holds get rows of their own (status
    "absent"). Returns why the mirror could not be listed, or None.
    """
    for row in rows:
        row["tiers"] = {"directory": row["status"]}
    if backend is None:
        return None
    try:  # the index made true to one listing: no manifest fetched that it holds
        listing = {m.name: m for m in mirror_index.reconcile(backend).listing()}
    except MirrorUnavailable as exc:
        for row in rows:
            row["tiers"]["mirror"] = UNREACHABLE
        return str(exc)
    root = Path(directory)
    for row in rows:
        m = listing.get(row["file"]) if row["status"] in (GOOD, BAD) else None
        if m is None:
            row["tiers"]["mirror"] = None
            continue
        listing.pop(row["file"])
        same = m.uid is None or checkpoint_chain(root / row["file"])[0] in (None, m.uid)
        row["tiers"]["mirror"] = m.status if same else OTHER
        row["mirror_reason"] = m.reason if same else f"uid {m.uid} on the mirror"
    for m in listing.values():
        rows.append(
            {
                "step": m.step,
                "file": m.name,
                "size": m.size,
                "time": m.time,
                "ranks": None,
                "kind": "incremental" if m.chain else "full",
                "base": m.chain[0][1] if m.chain else None,
                "written": None,
                "dirty": None,
                "status": ABSENT,
                "reason": "only on the mirror ('hpcckpt mirror pull' fetches it)",
                "tiers": {"directory": None, "mirror": m.status},
                "mirror_reason": m.reason,
            }
        )
    rows.sort(key=lambda row: (row["step"] if row["step"] is not None else -1, row["file"]))
    return None


def mirror_tier(path: Path, backend: MirrorBackend) -> dict[str, Any]:
    """What the mirror holds of the checkpoint file ``path`` (for ``inspect``): its
    status there (None: not mirrored), when it was mirrored, and why it is not good."""
    try:  # its own objects, not every manifest
        listing = mirror_index.confirm(backend, [path.name])
    except MirrorUnavailable as exc:
        return {"url": backend.url, "status": UNREACHABLE, "reason": str(exc)}
    m = listing.get(path.name)
    if m is None:
        return {"url": backend.url, "status": None, "reason": "not mirrored"}
    same = m.uid is None or checkpoint_chain(path)[0] in (None, m.uid)
    return {
        "url": backend.url,
        "status": m.status if same else OTHER,
        "reason": m.reason if same else f"uid {m.uid} on the mirror",
        "mirrored_at": m.mirrored_at,
        "checksum": m.to_dict()["checksum"],
    }


def describe_mirrored(backend: MirrorBackend, step: int) -> dict[str, Any] | None:
    """What the mirror's manifest says of its checkpoint of ``step`` (for ``inspect`` of a
    step the directory lacks): file, step, time, size, kind, chain and the mirror's
    status; arrays, scalars and meta are None (they are in the data, which is not
    fetched: ``hpcckpt mirror pull`` does). None when the mirror holds no such step;
    MirrorUnavailable when it cannot be listed."""
    name = layout.checkpoint_name(step)
    m = mirror_index.confirm(backend, [name]).get(name)  # its own objects
    if m is None:
        return None
    return {
        "file": m.name,
        "step": m.step,
        "nranks": None,
        "time": m.time,
        "size": m.size,
        "format_version": None,
        "kind": "incremental" if m.chain else "full",
        "chain": [name for name, _, _ in m.chain],
        "meta": None,
        "arrays": None,
        "scalars": None,
        "tiers": {
            "directory": None,
            "mirror": {
                "url": backend.url,
                "status": m.status,
                "reason": m.reason,
                "mirrored_at": m.mirrored_at,
                "checksum": m.to_dict()["checksum"],
            },
        },
    }


def _rejected_rows(root: Path) -> list[dict[str, Any]]:
    """Checkpoints kept aside as ``ckpt-<step>.h5.rejected``: their state failed the check."""
    rows = []
    for p in layout.rejected_files(root):
        info = layout.read_rejected_info(p)
        problems = info.get("problems") or {}
        reason = "; ".join(f"rank {r}: {m}" for r, m in problems.items()) or "state rejected"
        rows.append(
            {
                "step": layout.rejected_step(p.name),
                "file": p.name,
                "size": _size(p),
                "time": info.get("time"),
                "ranks": None,
                "kind": "full",
                "base": None,
                "written": None,
                "dirty": None,
                "status": REJECTED,
                "reason": reason,
            }
        )
    return rows


def _chain_columns(r: CheckpointReader) -> dict[str, Any]:
    total, dirty = r.attrs.get("total_blocks"), r.attrs.get("dirty_blocks")
    return {
        "base": r.chain_refs[0][1] if r.chain_refs else None,
        "written": r.attrs.get("data_bytes"),
        "dirty": round(dirty / total, 6) if total and dirty is not None else None,
    }


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def find(directory: str | os.PathLike[str], step: int | None) -> Path:
    """The checkpoint file of ``step``, or the newest committed one; FileNotFoundError if none."""
    entries = layout.scan(directory)
    if step is None:
        if not entries:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        return entries[0].path
    for e in entries:
        if e.step == step:
            return e.path
    steps = sorted(e.step for e in entries)
    raise FileNotFoundError(f"no checkpoint of step {step} in {directory} (steps: {steps})")


def describe(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Arrays (dtype, shapes, per-rank extents), scalars and metadata of one checkpoint."""
    with CheckpointReader(path) as r:
        arrays = []
        for name, info in r.arrays.items():
            arrays.append(
                {
                    "name": name,
                    "dtype": str(info.dtype),
                    "layout": info.layout,
                    "distributed": info.distributed,
                    "replicated": info.replicated,
                    "torch_dtype": info.torch_dtype or None,
                    "shape": list(info.shape),
                    "rank_offsets": list(info.rank_offsets),
                    "rank_shapes": [list(s) for s in info.rank_shapes],
                    "bytes": sum(info.rank_bytes(k) for k in range(r.nranks)),
                }
            )
        trees = [dict(scalar_leaves(r.tree(k))) for k in range(r.nranks)]
        scalars: dict[str, Any] = {}
        for key in dict.fromkeys(k for t in trees for k in t):
            values = [t.get(key) for t in trees]
            same = all(v == values[0] for v in values)
            scalars[key] = values[0] if same else {f"rank {k}": v for k, v in enumerate(values)}
        return {
            "file": Path(path).name,
            "step": r.step,
            "nranks": r.nranks,
            "time": r.time,
            "format_version": int(r.attrs["format_version"]),
            "kind": r.kind,
            "chain": [part.path.name for part in r.chain[:-1]],
            "meta": {k: v for k, v in r.attrs.items() if k != "arrays"},
            "arrays": arrays,
            "scalars": scalars,
        }


def verify(path: str | os.PathLike[str], *, clear_mark: bool = False) -> dict[str, Any]:
    """Read every rank's tree and arrays of one checkpoint and check every checksum.

    For an incremental checkpoint, every block it is made of is read from the file of
    its chain that holds it and checked: a bad base or delta makes it bad. With
    ``clear_mark``, a checkpoint whose only problem is its bad mark (every byte checks)
    loses the mark, so restore takes it again: the way back from a false alarm.
    """
    path = Path(path)
    marked = layout.read_bad(path)  # a mark of the file this one replaced does not count
    problems: list[str] = []
    nranks = kind = None
    chain: list[str] = []
    try:
        with CheckpointReader(path) as r:
            nranks, kind = r.nranks, r.kind
            chain = [part.path.name for part in r.chain[:-1]]
            problems = r.verify()
    except CheckpointError as exc:
        problems = [str(exc)]
    cleared = None
    if marked is not None and clear_mark and not problems:
        layout.clear_bad(path)
        cleared, marked = marked, None
    if marked is not None:
        problems.append(f"marked bad ({marked})")
    return {
        "step": layout.step_of(path.name),
        "file": path.name,
        "ranks": nranks,
        "kind": kind,
        "chain": chain,  # the base and deltas an incremental checkpoint is built on
        "good": not problems,
        "problems": problems,
        "cleared_mark": cleared,  # the reason of the bad mark removed, or None
    }
