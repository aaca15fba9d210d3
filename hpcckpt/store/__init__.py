"""The store: what a checkpoint is and where it lies. Its public API is this module:
``coord/``, ``cli/`` and applications import from ``hpcckpt.store`` only, never from a
module inside its sub-packages (``tests/test_import_graph.py`` checks it).

The front, directly in this folder: :mod:`.store` (``CheckpointStore``), :mod:`.options`,
:mod:`.results`, :mod:`.errors`, :mod:`.agreement`, :mod:`.retention`, :mod:`.catalog`.
The sub-packages, each a subject, from the bottom up (a sub-package imports only those
before it; docs/architecture.md):

- ``io/``: bytes, fsync and the one atomic write, locks, direct I/O, file-system tuning;
- ``tree/``: the state's values (encode/decode, tensors, devices, DTensors, replicas);
- ``file/``: the checkpoint file (format, directory names, layout plan, writer, reader);
- ``mirror/``: the second tier (backends, the verified copy, the worker, its retention);
- ``tier/``: the node-local tier (copies, partner/XOR redundancy, rebuild);
- ``save/``: the commit, staged saves, incremental change detection;
- ``restore/``: which checkpoint, loading it, read plans, resharding;
- ``export/``: flat HDF5 and safetensors exports.

Each name below is loaded on first use, so that ``from hpcckpt.store import
CheckpointError`` (the command-line tools) loads neither MPI nor HDF5.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Each public name and the module (under ``hpcckpt.store``) that defines it, as
#: ``"module"`` or ``"module:name"`` where the name there differs.
_HOMES: dict[str, str] = {
    # the store and what it returns
    "CheckpointStore": "store",
    "PendingSave": "store",
    "StagingRefused": "store",
    "SaveResult": "results",
    "RestoreResult": "results",
    "MirrorWait": "mirror.worker",
    # what the store reports beside its calls (its ``report`` callback's kinds)
    "MIRRORED": "mirror.worker",
    "MIRROR_FAILED": "mirror.worker",
    "MIRROR_PRUNED": "mirror.worker",
    "STAGING_REFUSED": "store",
    # what the Checkpointer holds and calls beside the store: the directory and its
    # lock, host buffers of async saves, the staging budget, the node-local path
    "make_directory": "io.safety",
    "DirectoryLock": "io.lock",
    "DirectoryLocked": "io.lock",
    "fault_point": "io.faults",
    "HostBuffers": "save.staging",
    "parse_budget": "save.staging_budget",
    "node_path": "tier.copies",
    "state_bytes": "tree.encoding",
    # the state's values, for the poisoned-state guard
    "is_tensor": "tree.tensors",
    "is_dtensor": "tree.tensors",
    "local_part": "tree.tensors",
    "to_array": "tree.tensors",
    "is_stateful": "tree.state_tree",
    "rejected_name": "file.layout",
    # its options
    "StoreOptions": "options",
    "ArrayOptions": "options",
    "IncrementalOptions": "options",
    "FileOptions": "options",
    "TierOptions": "options",
    "MirrorOptions": "options",
    "RetentionOptions": "options",
    "Split": "options",
    "fields_of": "options",
    "route": "options",
    "TuningOptions": "io.filesystem",
    # errors
    "CheckpointError": "errors",
    "CorruptCheckpoint": "errors",
    "CallMismatch": "errors",
    "CallTimeout": "errors",
    # how the ranks agree
    "Agreement": "agreement",
    "CallAgreement": "agreement",
    "Call": "agreement",
    # the communicator between ranks (MPI or torch.distributed)
    "Comm": "comm",
    "as_comm": "comm",
    # reading checkpoints in one process (the catalog, :mod:`.catalog`, lists, describes
    # and verifies them; :mod:`.retention` prunes)
    "CheckpointReader": "file.reader",
    "committed_checkpoints": "file.layout:scan",
    "step_of": "file.layout",
    "export_checkpoint": "export.hdf5",
    "export_safetensors": "export.safetensors",
    "parse_shard_size": "export.safetensors",
    # the mirror, for the command-line tools
    "MirrorUnavailable": "mirror.backend",
    "open_backend": "mirror.backend",
    "MirrorCopyBad": "mirror.copy",
    "list_mirrored": "mirror.copy",
    "verify_mirrored": "mirror.copy",
    "pull_mirrored": "mirror.copy:pull",
    "load_mirror_index": "mirror.index:load",
    "reconcile_mirror_index": "mirror.index:reconcile",
    "confirm_mirrored": "mirror.index:confirm",
    "prune_mirror": "mirror.worker",
    "checkpoint_name": "file.layout",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hpcckpt.store' has no attribute {name!r}")
    module, _, there = home.partition(":")
    value = getattr(importlib.import_module(f"hpcckpt.store.{module}"), there or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
