"""Read and edit a checkpoint file's array descriptions (``meta.attrs['array_info']``)
the way a user with h5py or a damaged disk would: tests craft files with them."""

from __future__ import annotations

import json
from typing import Any

import h5py
import numpy as np


def described(f: h5py.File, path: str) -> dict[str, Any]:
    """Array ``path``'s entry of ``meta.attrs['array_info']`` in the open file ``f``."""
    paths = json.loads(f["meta"].attrs["arrays"])
    return json.loads(f["meta"].attrs["array_info"])[paths.index(path)]


def redescribe(f: h5py.File, path: str, **changes: Any) -> None:
    """Set keys of array ``path``'s description in ``f`` (opened ``r+``)."""
    paths = json.loads(f["meta"].attrs["arrays"])
    info = json.loads(f["meta"].attrs["array_info"])
    info[paths.index(path)].update(changes)
    f["meta"].attrs["array_info"] = json.dumps(info)


def as_version_3(f: h5py.File) -> None:
    """Rewrite ``f`` (opened ``r+``) as hpcckpt wrote format version 3: each array's
    description as attributes of its dataset (JSON text for shapes), none on ``/meta``."""
    meta = f["meta"].attrs
    paths = json.loads(meta["arrays"])
    prefix = "delta/" if meta["kind"] == "incremental" else "state/"
    for path, info in zip(paths, json.loads(meta["array_info"]), strict=True):
        attrs = f[prefix + path].attrs
        for key, value in info.items():
            if key in ("shape", "rank_shapes"):
                value = json.dumps(value)
            elif key == "rank_offsets":
                value = np.asarray(value, dtype=np.int64)
            attrs[key] = value
    del meta["array_info"]
    meta["format_version"] = 3


def small_state(k: float) -> dict[str, Any]:
    """The state the crafted-file tests save: an array, a 0-d array and a scalar."""
    return {"u": np.arange(100.0) * k, "s": np.array(k), "k": k}


def two_checkpoints(directory: Any) -> tuple[Any, Any]:
    """A one-process store with good checkpoints of steps 1 and 2: (store, newest path)."""
    from mpi4py import MPI

    from hpcckpt.store.file import layout
    from hpcckpt.store.store import CheckpointStore

    store = CheckpointStore(directory, MPI.COMM_SELF)
    store.save(1, small_state(1))
    store.save(2, small_state(2))
    return store, store.directory / layout.checkpoint_name(2)


def crafted_falls_back(store: Any, newest: Any, craft: Any, fragment: str) -> None:
    """``craft`` damages the newest checkpoint's metadata: reading it names ``fragment``,
    and a restore marks it bad (never deletes it) and takes step 1, bit-exactly."""
    import pytest

    from hpcckpt.store.errors import CorruptCheckpoint
    from hpcckpt.store.file import layout
    from hpcckpt.store.file.reader import CheckpointReader

    with h5py.File(newest, "r+") as f:
        craft(f)
    with pytest.raises(CorruptCheckpoint, match=fragment):
        CheckpointReader(newest)
    target = small_state(0)
    got = store.restore(target)
    assert got.step == 1 and got.skipped[0][0] == 2
    assert np.array_equal(target["u"], np.arange(100.0)) and target["k"] == 1
    assert newest.exists() and (newest.parent / (newest.name + layout.BAD)).exists()
