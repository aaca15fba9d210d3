"""The checkpoint file's format: its name and version, HDF5 object formats, the names of its
groups, datasets and attributes, and the bounds past which a value is damage.

One home for what the writer (:mod:`.file.writer`) and the readers (:mod:`.file.reader`,
:mod:`.file.descriptions`, :mod:`.restore.read_plan`) must agree on; documented in docs/format.md.
"""

from __future__ import annotations

FORMAT = "hpcckpt"
FORMAT_VERSION = 4
#: HDF5 object formats files are written in: from 1.8's, whose attributes may exceed
#: 64 KiB (per-rank tables of thousands of ranks, thousands of array paths), up to
#: 1.10's, so that an HDF5 1.10 library still reads every file.
LIBVER = ("v108", "v110")
#: Kinds of checkpoint files (format version 2): a full one, or the changed blocks only.
FULL, INCREMENTAL = "full", "incremental"
#: More ranks than this in a file is taken as damage, not as a real run.
MAX_RANKS = 1 << 24
#: A dimension, offset or extent larger than this is taken as damage.
MAX_DIM = 1 << 62

#: The group holding the file's attributes and its tables, and those tables: every
#: rank's state tree (uint8), the checksum table (uint64, nranks x (arrays + 1)) and
#: every rank's block hashes (uint64).
META = "meta"
RANK_TREE = "meta/rank_tree"
CHECKSUMS = "meta/checksums"
BLOCK_HASHES = "meta/block_hashes"
#: The attribute of ``/meta`` describing every array (format version 4).
ARRAY_INFO = "array_info"
#: The attributes of an array's dataset the reader uses (format versions 1-3; version 4
#: keeps them in ``meta.attrs['array_info']``); others are never read.
ARRAY_ATTRS = frozenset(
    ["shape", "layout", "rank_offsets", "rank_shapes", "distributed", "torch_dtype", "replicated"]
)


def dataset_name(path: str) -> str:
    """The HDF5 dataset of an array path (``state/<escaped keys joined by '/'>``)."""
    return "state/" + path


def delta_name(path: str) -> str:
    """The dataset of an array's changed blocks in an incremental file."""
    return "delta/" + path


def index_name(path: str) -> str:
    """The (rank, block, start) index of an array's changed blocks in an incremental file."""
    return "delta_index/" + path
