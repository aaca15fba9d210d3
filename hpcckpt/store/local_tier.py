"""The node-local tier of a :class:`~hpcckpt.store.store.CheckpointStore`: a checkpoint
on the node-local tier only, sealing every rank's copy with its redundancy, and the
restore from that tier (as it is, or moved and rebuilt: :mod:`.local_restore`).

The files themselves are :mod:`.fast_tier`'s (copies) and :mod:`.redundancy`'s (partner
copies, XOR parity); this module is the collective sequence around them. The store's
staged save (``begin_save`` with ``cache``) seals its copy here too.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from hpcckpt.store import fast_tier, faults, local_restore, redundancy, safety
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.results import RestoreResult, SaveResult
from hpcckpt.store.state_tree import Targets, check_fits

if TYPE_CHECKING:
    from hpcckpt.store.store import CheckpointStore

log = logging.getLogger("hpcckpt.store")


def save_local(store: CheckpointStore, step: int, state: dict[str, Any], cache: Path) -> SaveResult:
    """A node-local checkpoint only (no drain): every rank's copy and its redundancy
    are written and sealed when this returns; collective.

    It is restorable from then on (``CheckpointStore.restore``), never from the directory,
    until a later save or the scavenge (``begin_save`` with ``redrain``) drains one.
    Raises CheckpointError on every rank when any rank fails; nothing is sealed then.
    """
    t0 = time.perf_counter()
    tree, arrays, *_ = store._encode(step, state)
    faults.fault_point("save.begin", step)
    uid = store.comm.bcast(uuid.uuid4().hex if store.rank == 0 else None)
    error: BaseException | None = None
    hashes: dict[str, Any] = {}
    offsets: dict[str, int] = {}
    try:
        safety.make_directory(cache, store.dir_mode)
        if not store.local_newer:  # older copies are durable in the directory
            fast_tier.remove(cache, store.rank, nranks=store.nranks)
        _, hashes, offsets = fast_tier.write_data(
            cache, step, store.rank, arrays, store.block_size, store.file_mode
        )
    except Exception as exc:  # every rank must reach the agreement below
        error = exc
    store._agree(error, f"writing node-local checkpoint of step {step} in {cache}")
    why = seal(store, cache, step, uid, tree, arrays, hashes, offsets)
    if why is not None:
        raise CheckpointError(f"sealing node-local checkpoint of step {step} failed ({why})")
    store.local_newer = True
    faults.fault_point("stage.written")
    mine = sum(a.nbytes for a in arrays.values())
    total = store.comm.allreduce(mine, op=MPI.SUM)
    seconds = store.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    nblocks = sum(len(h) for h in hashes.values())
    nblocks = store.comm.allreduce(nblocks, op=MPI.SUM)
    return SaveResult(
        step,
        cache / fast_tier.manifest_name(step, store.rank),
        total,
        seconds,
        "full",
        nblocks,
        nblocks,
        blocked_seconds=seconds,
        tier="cache",
    )


def seal(
    store: CheckpointStore,
    cache: Path,
    step: int,
    uid: str,
    tree: Any,
    arrays: dict[str, np.ndarray],
    hashes: dict[str, Any],
    offsets: dict[str, int],
) -> str | None:
    """Write the redundancy (if any), then seal every rank's copy; collective.

    Returns None when every rank sealed, else the ranks' errors (the copies that
    were sealed stay valid: each one verifies on its own).
    """
    doc = fast_tier.manifest_doc(
        step=step,
        uid=uid,
        rank=store.rank,
        nranks=store.nranks,
        directory=store.directory,
        block_size=store.block_size,
        tree=tree,
        arrays=arrays,
        hashes=hashes,
        offsets=offsets,
        node=store.node,
        replicated=store._replicated_paths,
    )
    red_doc = None
    if store.redundancy is not None:
        error: BaseException | None = None
        sets = store._sets
        assert sets is not None
        data = cache / fast_tier.data_name(step, store.rank)
        out = cache / redundancy.file_name(step, store.rank, sets.scheme)
        encoded: dict[str, Any] = {}
        try:
            encoded = redundancy.encode(sets, data, out, store.file_mode)
        except OSError as exc:
            error = exc
        faults.fault_point("redundancy.encoded", step)
        manifests = sets.comm.allgather(doc)
        try:
            store._agree(error, f"writing the {sets.scheme} redundancy of step {step}")
        except CheckpointError as exc:
            return str(exc)
        red_doc = redundancy.redundancy_doc(
            step=step,
            uid=uid,
            rank=store.rank,
            nranks=store.nranks,
            directory=store.directory,
            layout=sets,
            encoded=encoded,
            manifests=manifests,
        )
    problem = None
    try:
        fast_tier.write_manifest(
            cache / fast_tier.manifest_name(step, store.rank), doc, store.file_mode
        )
        if red_doc is not None:
            path = cache / redundancy.manifest_name(step, store.rank)
            fast_tier.write_manifest(path, red_doc, store.file_mode)
    except OSError as exc:
        problem = f"rank {store.rank}: {exc}"
    problems = [p for p in store.comm.allgather(problem) if p]
    if problems:
        return "; ".join(problems[:4])
    fast_tier.remove(cache, store.rank, keep=step, nranks=store.nranks)
    store.local_step = step
    return None


def log_sets(store: CheckpointStore, sets: redundancy.SetLayout) -> None:
    """One line: the sets the ranks formed (smaller than asked when nodes are few)."""
    if store.rank != 0:
        return
    sizes = sorted({len(s) for s in sets.sets})
    smaller = max(sizes) < store.redundancy_set
    log.info(
        "%s redundancy: %d set(s) of %s rank(s) on distinct nodes%s",
        sets.scheme,
        len(sets.sets),
        "/".join(map(str, sizes)),
        f" (fewer nodes than redundancy_set={store.redundancy_set})" if smaller else "",
    )


def restore_rebuilt(
    store: CheckpointStore,
    state: dict[str, Any],
    cache: Path,
    newest: int,
    skipped: list[tuple[int, str]],
    targets: Targets,
) -> RestoreResult | None:
    """Restore the newest node-local checkpoint newer than step ``newest`` that the ranks
    can move and rebuild (:mod:`.local_restore`); the ones that could not, into ``skipped``."""
    try:  # a node new to this job (a spare, a replaced node) has no directory yet
        safety.make_directory(cache, store.dir_mode)
    except OSError as exc:
        log.warning("rank %d: cannot create %s: %s", store.rank, cache, exc)
    found = local_restore.restore(
        store.comm, cache, store.directory, newest, store.file_mode, store.node
    )
    for step, why in found.skipped:
        if store.rank == 0:
            log.warning("node-local checkpoint of step %d not used: %s", step, why)
        skipped.append((step, why))
    store.local_set_aside = list(found.set_aside)
    for step, node, name, why in found.set_aside:
        if store.rank == 0:
            log.warning("node-local %s on %s set aside (step %d): %s", name, node, step, why)
    if found.step is None:
        return None
    copy = found.copy
    assert copy is not None
    arrays = dict(found.arrays)
    # Replicated arrays are in rank 0's copy only (the others hold stand-ins).
    for name in store.comm.bcast(copy.replicated if store.rank == 0 else None):
        arrays[name] = _bcast_array(store.comm, arrays.get(name))
    fatal = check_fits(state, copy.tree, arrays, targets)
    fatals = [f for f in store.comm.allgather(fatal) if f]
    if fatals:
        if store.rank == 0:
            log.warning("node-local copy of step %d not used (%s)", found.step, fatals[0])
        return None
    store._decode(state, copy.tree, arrays, targets)
    store.last = None  # the next save is a full one, in the directory
    store.local_newer = True
    store.local_step = found.step
    store.restored_copy = copy
    return RestoreResult(
        found.step,
        copy.path,
        [],
        store.nranks,
        source="cache",
        local_skipped=tuple(skipped),
        rebuilt=tuple(found.rebuilt),
        rebuilt_from=found.scheme,
        moved=tuple(found.moved),
    )


def restore_local(
    store: CheckpointStore,
    state: dict[str, Any],
    cache: Path,
    newest: int,
    skipped: list[tuple[int, str]],
    targets: Targets,
) -> RestoreResult | None:
    """Restore the node-local copy newer than step ``newest`` if every rank has it whole
    (one copy per rank is kept: a sealed copy replaces the older ones); else into
    ``skipped`` with the reason.

    Without redundancy a damaged part cannot be rebuilt: the rank that holds it sets it
    aside (:attr:`CheckpointStore.local_set_aside`, never tried again); the other ranks'
    sound parts stay until the next save replaces them.
    """
    mine = fast_tier.scan(cache, store.directory, store.rank, store.nranks)
    offers = store.comm.allgather({(c.step, c.uid) for c in mine if c.step > newest})
    common = set.intersection(*offers)
    if not common:
        if any(offers):
            if store.rank == 0:
                log.info("node-local copies in %s are not complete on every rank", cache)
        return None
    step, uid = max(common)
    copy = next(c for c in mine if (c.step, c.uid) == (step, uid))
    problem = fatal = aside = None
    arrays: dict[str, Any] = {}
    try:
        arrays = fast_tier.load(copy)
    except (CorruptCheckpoint, OSError, ValueError) as exc:
        problem = f"rank {store.rank}: {exc}"
        if fast_tier.set_aside_file(copy.path):
            aside = (step, store.node, copy.path.name, problem)
    if not any(store.comm.allgather(problem)):
        # Replicated arrays are in rank 0's copy only (the others hold stand-ins).
        for name in store.comm.bcast(copy.replicated if store.rank == 0 else None):
            arrays[name] = _bcast_array(store.comm, arrays.get(name))
        fatal = check_fits(state, copy.tree, arrays, targets)
    outcome = store.comm.allgather((problem, fatal, aside))
    problems = [p for p, _, _ in outcome if p]
    fatals = [f for _, f, _ in outcome if f]
    if problems or fatals:
        why = "; ".join((problems or fatals)[:4])
        if store.rank == 0:
            log.warning("node-local copy of step %d not used (%s)", step, why)
        skipped.append((step, why))
        store.local_set_aside += [a for _, _, a in outcome if a]
        return None
    store._decode(state, copy.tree, arrays, targets)
    store.last = None  # the next save is a full one, in the directory
    store.local_newer = True
    store.restored_copy = copy
    return RestoreResult(step, copy.path, [], store.nranks, source="cache")


def _bcast_array(comm: MPI.Comm, array: np.ndarray | None) -> np.ndarray:
    """Rank 0's ``array`` on every rank (in pieces below MPI's 2 GiB count limit)."""
    spec = comm.bcast((array.dtype.str, array.shape) if comm.Get_rank() == 0 else None)
    out = array if comm.Get_rank() == 0 else np.empty(spec[1], dtype=np.dtype(spec[0]))
    assert out is not None
    raw = out.reshape(-1).view(np.uint8)
    piece = 1 << 30
    for lo in range(0, raw.size, piece):
        comm.Bcast(raw[lo : lo + piece], root=0)
    return out
