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
