"""A checkpoint's model weights as safetensors files, the layout inference tools load.

The safetensors format is written here directly (no torch, no safetensors package): an
8-byte little-endian header length, a JSON header naming each tensor's ``dtype``,
``shape`` and ``data_offsets``, then the tensors' raw little-endian bytes. Each tensor
is read from the checkpoint as its global array (every writing rank's piece, verified
against its checksums) and written before the next is read, so memory is bounded by the
largest tensor (plus one rank's piece of it), not the model. Past ``max_shard_size`` the
weights are split into ``model-00001-of-0000N.safetensors`` files with the Hugging Face
index ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``).

The weights are the tensors under one key of the saved state (``"model"`` by default),
named as in the model's ``state_dict()``: ``model.load_state_dict(load_file(...))``
takes them. Dtypes are the recorded torch dtypes (bfloat16 is ``BF16``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io.durability import atomic_path, fsync_path
from hpcckpt.store.tree.state_tree import TAG, children, escape, unescape

#: safetensors' dtype codes of the torch dtypes it has.
TORCH_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
#: safetensors' dtype codes of numpy dtypes (arrays saved as numpy, not torch).
NUMPY_DTYPES = {
    "f8": "F64",
    "f4": "F32",
    "f2": "F16",
    "i8": "I64",
    "i4": "I32",
    "i2": "I16",
    "i1": "I8",
    "u8": "U64",
    "u4": "U32",
    "u2": "U16",
    "u1": "U8",
    "b1": "BOOL",
}

#: The Hugging Face default shard cap (``max_shard_size="5GB"``, decimal).
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "K": 1 << 10,
    "M": 1 << 20,
    "G": 1 << 30,
    "T": 1 << 40,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}


def parse_shard_size(text: str | int) -> int:
    """Bytes from ``"5GB"`` (decimal, as Hugging Face writes it), ``"2GiB"``/``"2G"``
    (binary) or a plain number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).upper() if m else ""
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"max shard size {text!r} is not a size: write bytes or e.g. '5GB', '500MB', '2GiB'"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"max shard size must be at least 1 byte, not {text!r}")
    return value


@dataclass(frozen=True)
class Weight:
    """One tensor of the export: its ``state_dict()`` name and where the checkpoint has it."""

    name: str
    path: str  # the array path in the checkpoint
    dtype: str  # safetensors' code: "F32", "BF16"...
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class SafetensorsExport:
    """What :func:`export_safetensors` wrote."""

    out: Path
    files: tuple[Path, ...]
    index: Path | None  # the index file, when the weights were sharded
    key: str  # the state's key the weights came from
    tensors: int
    total_size: int  # bytes of tensor data, all files
    skipped: tuple[str, ...]  # names under the key that are not arrays (scalars...)

    def as_dict(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "files": [p.name for p in self.files],
            "index": self.index.name if self.index else None,
            "key": self.key,
            "tensors": self.tensors,
            "total_size": self.total_size,
            "skipped": list(self.skipped),
        }


def _holds_arrays(node: Any) -> bool:
    if isinstance(node, dict) and "path" in node and node.get(TAG) in ("tensor", "array"):
        return True
    return any(_holds_arrays(sub) for _, sub in children(node))


def _stateful_type(node: Any) -> str:
    return node.get("type", "") if isinstance(node, dict) and node.get(TAG) == "stateful" else ""


def detect_key(tree: Any) -> str:
    """The state key holding the model: ``"model"`` when the state has it, else the one
    top-level value with arrays that is not an optimizer, scheduler or hpcckpt helper."""
    top = dict(children(tree))
    if "model" in top:
        return "model"
    found = []
    for name, node in top.items():
        kind = _stateful_type(node)
        if kind.startswith(("torch.optim.", "torch.amp.", "hpcckpt.")):
            continue
        if _holds_arrays(node):
            found.append(unescape(name))
    if len(found) == 1:
        return found[0]
    keys = ", ".join(repr(unescape(n)) for n in top) or "none"
    why = "several of them hold arrays" if found else "none of them holds a model's tensors"
    raise CheckpointError(
        f"cannot tell which key of the saved state is the model ({why}; keys: {keys}); "
        "name it with --key (e.g. --key model or --key nets/generator)"
    )


def _key_node(tree: Any, key: str) -> Any:
    node = tree
    for part in key.split("/"):
        while isinstance(node, dict) and node.get(TAG) == "stateful":
            node = node["v"]
        here = dict(children(node))
        if escape(part) not in here:
            names = ", ".join(repr(unescape(n)) for n in here) or "none"
            raise CheckpointError(
                f"the saved state has no key {key!r} (at {part!r} the keys are {names}); "
                "name the model's key with --key"
            )
        node = here[escape(part)]
    return node


def _leaves(node: Any, name: str) -> Iterator[tuple[str, Any]]:
    """(state_dict name, leaf node): dict keys joined by '.', as nested modules name them."""
    while isinstance(node, dict) and node.get(TAG) == "stateful":
        node = node["v"]
    parts = children(node)
    if not parts or (isinstance(node, dict) and "path" in node):
        yield name, node
        return
    for part, sub in parts:
        part = unescape(part)
        yield from _leaves(sub, f"{name}.{part}" if name else part)


def weights(
    reader: CheckpointReader, key: str | None = None
) -> tuple[str, list[Weight], list[str]]:
    """The key used, the tensors under it (in state_dict order) and the names skipped."""
    tree = reader.tree(0)
    key = detect_key(tree) if key is None else key.strip("/")
    found: list[Weight] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for name, node in _leaves(_key_node(tree, key), ""):
        if not (isinstance(node, dict) and node.get(TAG) in ("tensor", "array")):
            skipped.append(name)
            continue
        path = node["path"]
        info = reader.arrays[path]
        if node.get(TAG) == "tensor":
            code = TORCH_DTYPES.get(node.get("dtype", ""))
            what = f"torch dtype {node.get('dtype')}"
        else:
            code = NUMPY_DTYPES.get(info.dtype.str.lstrip("<>|="))
            what = f"numpy dtype {info.dtype}"
        if code is None:
            raise CheckpointError(
                f"tensor {name!r} ({path}) has {what}, which safetensors cannot hold; "
                f"it holds {', '.join(sorted(TORCH_DTYPES))}"
            )
        if name in seen:
            raise CheckpointError(f"two tensors under {key!r} would both be named {name!r}")
        seen.add(name)
        shape = global_shape(reader, path)
        nbytes = int(np.prod(shape, dtype=np.int64)) * info.dtype.itemsize
        found.append(Weight(name, path, code, shape, nbytes))
    if not found:
        raise CheckpointError(
            f"the saved state's {key!r} holds no tensors; name the model's key with --key"
        )
    return key, found, skipped


def global_shape(reader: CheckpointReader, path: str) -> tuple[int, ...]:
    """The shape of array ``path`` as one global array."""
    info = reader.arrays[path]
    if info.dtensor_shape is not None:
        return tuple(int(n) for n in info.dtensor_shape)
    if info.layout == "rows" and info.distributed and not info.replicated:
        return tuple(int(n) for n in info.shape)
    return tuple(int(n) for n in info.rank_shapes[0])


def global_array(reader: CheckpointReader, path: str) -> np.ndarray:
    """Array ``path`` as one global array, verified: a DTensor's pieces put in place, a
    distributed array's rows from every writing rank, the one copy of a replicated
    array; an array every rank saved with the same bytes is that array, one differing
    between ranks has no global value."""
    info = reader.arrays[path]
    if info.dtensor_shape is not None:
        whole = np.empty(info.dtensor_shape, dtype=info.dtype)
        for rank in info.holders():
            offset, held = info.piece_offsets[rank], info.rank_shapes[rank]
            box = tuple(slice(o, o + n) for o, n in zip(offset, held, strict=True))  # type: ignore[arg-type]
            whole[box] = reader.rank_array(path, rank)
        return whole
    if info.layout == "rows" and info.distributed and not info.replicated:
        out = np.empty(info.shape, dtype=info.dtype)
        offs = info.rank_offsets
        for rank in range(reader.nranks):
            lo, hi = offs[rank], offs[rank + 1]
            if hi > lo:
                part = out[lo:hi]
                got = reader.rows(path, lo, hi, out=part)
                if got.__array_interface__["data"][0] != part.__array_interface__["data"][0]:
                    part[...] = got  # read elsewhere (older formats): copied in
        return out
    if reader.nranks > 1 and not reader.replicated(path):
        raise CheckpointError(
            f"array {path!r} differs between the ranks that wrote the checkpoint and is not "
            "declared distributed, so it has no one global value to export; save the model "
            "declared replicated= (data parallel) or distributed= (split along axis 0), or "
            "export every rank's copy as HDF5 (hpcckpt export without --format)"
        )
    return reader.rank_array(path, 0)


def plan_shards(items: list[Weight], max_shard_size: int) -> list[list[Weight]]:
    """Tensors grouped into files of at most ``max_shard_size`` bytes of data, in order, as
    Hugging Face does (a tensor larger than the cap gets a file of its own)."""
    shards: list[list[Weight]] = [[]]
    size = 0
    for w in items:
        if shards[-1] and size + w.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(w)
        size += w.nbytes
    return shards


def header(items: list[Weight]) -> bytes:
    """A safetensors header: the JSON, padded with spaces to 8 bytes, after its length."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for w in items:
        meta[w.name] = {
            "dtype": w.dtype,
            "shape": list(w.shape),
            "data_offsets": [offset, offset + w.nbytes],
        }
        offset += w.nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _atomic(path: Path) -> AbstractContextManager[Path]:
    """The temporary name ``.<name>.tmp`` of an export file, published durably."""
    return atomic_path(path, mode=None, temp=f".{path.name}.tmp")


def _write_file(reader: CheckpointReader, items: list[Weight], path: Path) -> None:
    with open(path, "wb") as f:
        f.write(header(items))
        for w in items:
            array = global_array(reader, w.path)
            if array.dtype.byteorder == ">":
                array = array.astype(array.dtype.newbyteorder("<"))
            array = np.ascontiguousarray(array)
            if array.nbytes != w.nbytes:
                raise CheckpointError(
                    f"tensor {w.name!r}: read {array.nbytes} bytes, expected {w.nbytes}"
                )
            if array.nbytes:
                f.write(memoryview(array.reshape(-1)).cast("B"))
            del array  # the next tensor is read only after this one is written


def export_safetensors(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    key: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> SafetensorsExport:
    """Write the model weights of checkpoint file ``source`` into directory ``out``.

    ``key``: the state's key path holding the model (``"model"`` or the one model-like
    value when None). A previous export in ``out`` (``model*.safetensors``, the index)
    is replaced once the new files are complete; other files there are left alone.
    """
    cap = parse_shard_size(max_shard_size)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file; the safetensors export needs a directory")
    out.mkdir(parents=True, exist_ok=True)
    with CheckpointReader(source) as reader:
        used, items, skipped = weights(reader, key)
        shards = plan_shards(items, cap)
        n = len(shards)
        names = (
            [SINGLE_FILE]
            if n == 1
            else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        )
        index = out / INDEX_FILE if n > 1 else None
        # Every file is published when the stack closes, none if one fails to be written;
        # the stack closes in reverse, so the index, entered first, comes after its shards.
        with ExitStack() as stack:
            index_tmp = None
            if index is not None:
                index_tmp = stack.enter_context(_atomic(index))
            for name, shard in zip(names, shards, strict=True):
                _write_file(reader, shard, stack.enter_context(_atomic(out / name)))
            if index_tmp is not None:
                doc = {
                    "metadata": {"total_size": sum(w.nbytes for w in items)},
                    "weight_map": {
                        w.name: name
                        for name, shard in zip(names, shards, strict=True)
                        for w in shard
                    },
                }
                index_tmp.write_text(json.dumps(doc, indent=2) + "\n")
    files = [out / name for name in names]
    keep = {*names, INDEX_FILE} if index is not None else set(names)
    for old in out.iterdir():  # a previous export's files this one did not replace
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD.match(old.name):
            if old.name not in keep:
                old.unlink()
    fsync_path(out)  # the removals too
    return SafetensorsExport(
        out=out,
        files=tuple(files),
        index=index,
        key=used,
        tensors=len(items),
        total_size=sum(w.nbytes for w in items),
        skipped=tuple(skipped),
    )
