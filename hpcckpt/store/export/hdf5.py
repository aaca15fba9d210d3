"""Export one checkpoint as a flat, self-contained HDF5 file of the global state.

For post-processing and archiving with tools that know nothing of hpcckpt or of the
number of ranks (layout in docs/format.md, "Export files"):

- ``/arrays/<path>``: a "rows" array (distributed, or stacked along axis 0) as one
  global dataset, with attribute ``rank_offsets``; any other array as a group
  ``/arrays/<path>`` with one dataset ``rank<r>`` per writing rank;
- ``/scalars``: attributes ``<key path>`` = value when every rank saved the same value;
  otherwise groups ``/scalars/rank<r>`` with that rank's values. Integers beyond
  64 bits, complex numbers and such are JSON text;
- ``/trees``: one JSON string per rank, the exact state trees (docs/format.md), so the
  export loses nothing;
- root attributes: ``format`` = "hpcckpt-export", ``export_version``, ``source``,
  ``step``, ``nranks``, ``time``.

Every array is verified against its checksums while copying, one rank's slice at a time.
An incremental checkpoint is materialized: each rank's arrays are assembled from its
chain (the full base and the changed blocks of each delta), so the export is the same
flat file a full checkpoint of that step would give.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcckpt.store.file.format import LIBVER
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io.durability import atomic_path
from hpcckpt.store.tree.queries import scalar_leaves

EXPORT_FORMAT = "hpcckpt-export"
EXPORT_VERSION = 1


def _attr_value(value: Any) -> Any:
    if isinstance(value, bool | float | str):
        return value
    if isinstance(value, int) and -(2**63) <= value < 2**63:
        return value
    return json.dumps(value)


def export_checkpoint(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write checkpoint ``source`` as the flat HDF5 file ``out`` (replaced whole, durably);
    returns ``out``."""
    out = Path(out)
    with atomic_path(out, mode=None, temp=out.name + ".tmp") as tmp:
        _write(source, tmp)
    return out


def _write(source: str | os.PathLike[str], tmp: Path) -> None:
    with CheckpointReader(source) as r, h5py.File(tmp, "w", libver=LIBVER) as f:
        f.attrs["format"] = EXPORT_FORMAT
        f.attrs["export_version"] = EXPORT_VERSION
        f.attrs["source"] = Path(source).name
        f.attrs["step"] = r.step
        f.attrs["nranks"] = r.nranks
        f.attrs["time"] = r.time
        f.attrs["kind"] = r.kind
        f.attrs["chain"] = json.dumps([part.path.name for part in r.chain])
        trees = [r.tree(rank) for rank in range(r.nranks)]
        f.create_dataset(
            "trees",
            data=np.array([json.dumps(t) for t in trees], dtype=object),
            dtype=h5py.string_dtype(),
        )
        per_rank = [dict(scalar_leaves(t)) for t in trees]
        scalars = f.create_group("scalars")
        keys = list(dict.fromkeys(k for leafs in per_rank for k in leafs))
        for key in keys:
            values = [leafs.get(key) for leafs in per_rank]
            if all(json.dumps(v) == json.dumps(values[0]) for v in values):
                if values[0] is not None:
                    scalars.attrs[key] = _attr_value(values[0])
            else:
                for rank, value in enumerate(values):
                    if value is not None:
                        g = scalars.require_group(f"rank{rank}")
                        g.attrs[key] = _attr_value(value)
        arrays = f.create_group("arrays")
        for name, info in r.arrays.items():
            if info.layout == "rows":
                d = arrays.create_dataset(name, shape=info.shape, dtype=info.dtype)
                d.attrs["rank_offsets"] = np.asarray(info.rank_offsets, dtype=np.int64)
                d.attrs["distributed"] = info.distributed
                for rank in range(r.nranks):
                    lo, hi = info.rank_offsets[rank], info.rank_offsets[rank + 1]
                    if hi > lo:
                        d[lo:hi] = r.rows(name, lo, hi)
            else:
                g = arrays.create_group(name)
                for rank in range(r.nranks):
                    g.create_dataset(f"rank{rank}", data=r.rank_array(name, rank))
