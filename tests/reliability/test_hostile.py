"""Hostile or foreign files in a checkpoint directory: clear errors, nothing run or touched outside.

Every crafted checkpoint is written with valid checksums where that matters (an
attacker can compute xxh3 too), so these test the structural checks, not the hashes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io import integrity
from hpcckpt.store.store import CheckpointStore
from tests.format_helpers import redescribe

PACKAGE = Path(__file__).resolve().parents[2] / "hpcckpt"
NAME = layout.checkpoint_name(5)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hostile") / "ck"
    CheckpointStore(d, MPI.COMM_SELF).save(
        5, {"u": np.arange(12.0).reshape(3, 4), "g": np.random.default_rng(3), "t": 1}
    )
    return d / NAME


def restore_falls_back(d: Path, crafted: Path) -> str:
    """With a good step 1 beside it, restore takes step 1 and marks ``crafted`` bad."""
    CheckpointStore(d, MPI.COMM_SELF).save(1, {"u": np.zeros((3, 4)), "t": 0})
    state: dict = {"u": np.ones((3, 4)), "t": None}
    result = CheckpointStore(d, MPI.COMM_SELF).restore(state)
    assert result.step == 1 and state["t"] == 0 and not state["u"].any()
    assert layout.read_bad(crafted)
    return layout.read_bad(crafted) or ""


def crafted_copy(good: Path, tmp_path: Path, edit) -> Path:
    d = tmp_path / "ck"
    d.mkdir()
    path = d / NAME
    shutil.copy(good, path)
    with h5py.File(path, "r+") as f:
        edit(f)
    return path


def _retree(f: h5py.File, tree) -> None:
    """Replace rank 0's tree by ``tree`` with a valid checksum."""
    raw = json.dumps(tree).encode()
    del f["meta/rank_tree"]
    d = f["meta"].create_dataset("rank_tree", data=np.frombuffer(raw, dtype=np.uint8))
    d.attrs["offsets"] = np.array([0, len(raw)], dtype=np.int64)
    cs = f["meta/checksums"][...]
    cs[0, -1] = integrity.checksum(raw)
    f["meta/checksums"][...] = cs


CRAFTED = {
    "huge nranks": lambda f: f["meta"].attrs.__setitem__("nranks", 1 << 40),
    "negative rank shape": lambda f: redescribe(f, "u", rank_shapes=[[-3, 4]]),
    "huge rank shape": lambda f: redescribe(f, "u", rank_shapes=[[1 << 50, 4]]),
    "offsets out of range": lambda f: redescribe(f, "u", rank_offsets=[0, 1 << 40]),
    "array name with ..": lambda f: f["meta"].attrs.__setitem__("arrays", '["../../etc/passwd"]'),
    "array name with NUL": lambda f: f["meta"].attrs.__setitem__("arrays", '["u\\u0000x"]'),
    "array name with /": lambda f: f["meta"].attrs.__setitem__("arrays", '["/meta/checksums"]'),
    "object dtype dataset": lambda f: (
        f.__delitem__("state/u"),
        f.create_dataset(
            "state/u", data=np.array(["a", "b"], dtype=object), dtype=h5py.string_dtype()
        ),
    ),
    "compound dtype": lambda f: (
        f.__delitem__("state/u"),
        f.create_dataset("state/u", data=np.zeros(3, dtype=[("a", "f8"), ("b", "i4")])),
    ),
    "compressed (a bomb)": lambda f: (
        f.__delitem__("state/u"),
        f.create_dataset("state/u", data=np.zeros((3, 4)), compression="gzip"),
    ),
    "generator calls np.random.seed": lambda f: _retree(
        f,
        {
            "$t": "dict",
            "v": {
                "u": {"$t": "array", "path": "u"},
                "t": 1,
                "g": {"$t": "generator", "state": {"bit_generator": "seed"}},
            },
        },
    ),
    "unknown node type": lambda f: _retree(
        f, {"$t": "dict", "v": {"u": {"$t": "array", "path": "u"}, "t": {"$t": "pickle"}}}
    ),
    "subarray dtype in scalar": lambda f: _retree(
        f,
        {
            "$t": "dict",
            "v": {
                "u": {"$t": "array", "path": "u"},
                "t": {"$t": "npscalar", "dtype": "(1000000000,)f8", "hex": "00"},
            },
        },
    ),
    "format_version from the future": lambda f: f["meta"].attrs.__setitem__("format_version", 99),
}


@pytest.mark.parametrize("what", sorted(CRAFTED))
def test_crafted_checkpoint_is_refused_clearly(good, tmp_path, what, reliability_log):
    path = crafted_copy(good, tmp_path, CRAFTED[what])
    with pytest.raises(CheckpointError) as err:
        with CheckpointReader(path) as r:
            problems = r.verify()
            for rank in range(r.nranks):
                r.tree(rank)
            if problems:
                raise CorruptCheckpoint("; ".join(problems))
    msg = str(err.value)
    assert NAME in msg or "format version" in msg
    if what.startswith("format_version"):
        assert "upgrade hpcckpt" in msg
    else:
        restore_falls_back(path.parent, path)
    reliability_log.add("hostile", case=what, error=msg[:70], outcome="ok")


@pytest.mark.parametrize(
    "content", [b"", b"not hdf5 at all\n" * 10, b"\x89HDF\r\n\x1a\n" + b"\0" * 100]
)
def test_not_hdf5_named_like_a_checkpoint(tmp_path, content, reliability_log):
    d = tmp_path / "ck"
    d.mkdir()
    (d / NAME).write_bytes(content)
    reason = restore_falls_back(d, d / NAME)
    assert NAME in reason
    reliability_log.add(
        "hostile", case=f"not HDF5 ({len(content)} bytes)", error=reason[:70], outcome="ok"
    )


def test_foreign_hdf5_named_like_a_checkpoint(tmp_path, reliability_log):
    d = tmp_path / "ck"
    d.mkdir()
    with h5py.File(d / NAME, "w") as f:
        f["data"] = np.arange(10)
        f.attrs["creator"] = "someone else"
    reason = restore_falls_back(d, d / NAME)
    assert "not an hpcckpt checkpoint" in reason
    reliability_log.add("hostile", case="foreign HDF5 file", error=reason[:70], outcome="ok")


def test_symlinked_checkpoint_is_not_followed(good, tmp_path, reliability_log):
    d = tmp_path / "ck"
    d.mkdir()
    outside = tmp_path / "outside.h5"
    shutil.copy(good, outside)
    os.symlink(outside, d / NAME)
    reason = restore_falls_back(d, d / NAME)
    assert "symbolic link" in reason
    fifo = d / layout.checkpoint_name(7)
    os.mkfifo(fifo)  # would block a reader forever
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        CheckpointReader(fifo)
    reliability_log.add("hostile", case="ckpt-*.h5 symlink / FIFO", error=reason[:70], outcome="ok")


def test_partial_symlink_cleanup_never_deletes_outside(tmp_path, reliability_log):
    d = tmp_path / "ck"
    d.mkdir()
    victim = tmp_path / "precious.dat"
    victim.write_text("keep me")
    victim_dir = tmp_path / "precious-dir"
    victim_dir.mkdir()
    (victim_dir / "x").write_text("keep")
    os.symlink(victim, d / (layout.checkpoint_name(3) + layout.PARTIAL))
    os.symlink(victim_dir, d / (layout.checkpoint_name(4) + layout.PARTIAL))
    (d / (layout.checkpoint_name(6) + layout.PARTIAL)).mkdir()  # a directory: left alone
    os.symlink(victim, d / (layout.checkpoint_name(9) + layout.BAD + ".tmp"))
    CheckpointStore(d, MPI.COMM_SELF).save(8, {"x": np.zeros(3)})
    assert victim.read_text() == "keep me" and (victim_dir / "x").read_text() == "keep"
    assert not (d / (layout.checkpoint_name(3) + layout.PARTIAL)).exists()
    assert not os.path.lexists(d / (layout.checkpoint_name(4) + layout.PARTIAL))
    # marking bad through a planted .bad.tmp link writes inside the directory only
    (d / layout.checkpoint_name(9)).write_bytes(b"junk")
    layout.mark_bad(d / layout.checkpoint_name(9), "test")
    assert victim.read_text() == "keep me"
    assert layout.read_bad(d / layout.checkpoint_name(9)) == "test"
    reliability_log.add(
        "hostile",
        case=".partial / .bad.tmp symlinks to outside",
        error="links unlinked only",
        outcome="ok",
    )


def test_no_pickle_and_no_shell_in_hpcckpt(reliability_log):
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for pattern in (
            r"^\s*(import|from)\s+(c?pickle|dill|shelve|marshal)\b",
            r"shell\s*=\s*True",
            r"\bos\.system\(",
            r"\bos\.popen\(",
            r"\beval\(",
            r"\bexec\(",
        ):
            for m in re.finditer(pattern, text, flags=re.M):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}: {m.group(0).strip()}")
    assert offenders == []
    reliability_log.add(
        "hostile",
        case="no pickle/eval/exec/shell=True/os.system/os.popen in hpcckpt/",
        error="grep clean",
        outcome="ok",
    )
