"""``hpcckpt.store.file.format``: what the writer writes and docs/format.md documents are the
names and version defined there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from hpcckpt.store.file import format as fmt
from hpcckpt.store.file import layout
from hpcckpt.store.store import CheckpointStore

DOC = Path(__file__).resolve().parents[3] / "docs" / "format.md"


def test_array_paths_name_their_datasets():
    assert fmt.dataset_name("model/w") == "state/model/w"
    assert fmt.delta_name("model/w") == "delta/model/w"
    assert fmt.index_name("model/w") == "delta_index/model/w"


def test_docs_state_the_version_the_hdf5_formats_and_the_datasets():
    text = DOC.read_text()
    assert text.startswith(f"# The checkpoint format (format_version {fmt.FORMAT_VERSION})")
    assert f'format = "{fmt.FORMAT}"' in text
    assert f"libver={fmt.LIBVER!r}".replace("'", '"') in text
    block = re.search(r"## Inside one file\n\n```\n(.*?)```", text, re.S)
    assert block, "docs/format.md lost its tree of the file"
    listed = {line.split()[0] for line in block.group(1).splitlines()}
    named = [fmt.META, fmt.RANK_TREE, fmt.CHECKSUMS, fmt.BLOCK_HASHES]
    named += [fmt.dataset_name("<path>"), fmt.delta_name("<path>"), fmt.index_name("<path>")]
    assert {"/" + n for n in named} <= listed


def test_a_saved_file_follows_the_format(tmp_path):
    """Full, then incremental: the names, version and kinds defined here are the file's."""
    store = CheckpointStore(tmp_path, MPI.COMM_SELF, block_size=4096, min_delta_saving=0)
    u = np.zeros(5000)
    assert store.save(1, {"u": u}).kind == fmt.FULL
    assert store.save(2, {"u": u}).kind == fmt.INCREMENTAL
    for step, kind, data in ((1, fmt.FULL, fmt.dataset_name), (2, fmt.INCREMENTAL, fmt.delta_name)):
        with h5py.File(tmp_path / layout.checkpoint_name(step), "r") as f:
            meta = f[fmt.META].attrs
            assert meta["format"] == fmt.FORMAT and meta["format_version"] == fmt.FORMAT_VERSION
            assert meta["kind"] == kind and 1 <= meta["nranks"] <= fmt.MAX_RANKS
            for name in (fmt.RANK_TREE, fmt.CHECKSUMS, fmt.BLOCK_HASHES, data("u")):
                assert isinstance(f[name], h5py.Dataset), name
            if kind == fmt.INCREMENTAL:
                assert isinstance(f[fmt.index_name("u")], h5py.Dataset)
            (info,) = json.loads(meta[fmt.ARRAY_INFO])
            # what versions 1-3 kept on the dataset; block_elems only describes the deltas
            assert set(info) - {"block_elems"} <= fmt.ARRAY_ATTRS
            assert not set(f[data("u")].attrs)  # version 4: nothing on the dataset
