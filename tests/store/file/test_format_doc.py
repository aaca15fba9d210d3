"""docs/format.md is the contract: its h5py snippet reads a real checkpoint without hpcckpt."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt.store.file import layout
from hpcckpt.store.store import CheckpointStore

DOC = Path(__file__).resolve().parents[3] / "docs" / "format.md"


def snippet() -> str:
    text = DOC.read_text()
    match = re.search(r"<!-- snippet: read-with-h5py -->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/format.md lost its h5py snippet"
    return match.group(1)


def test_doc_snippet_reads_a_checkpoint_with_plain_h5py(tmp_path):
    store = CheckpointStore(tmp_path / "ckpt", MPI.COMM_SELF, distributed=["u"])
    u = np.arange(12.0).reshape(4, 3)
    s = np.array(2.5)  # 0-d: flat layout
    store.save(100, {"u": u, "s": s, "t": 0.75})
    code = snippet()
    path = tmp_path / "ckpt" / layout.checkpoint_name(100)
    assert 'path = "ckpt/ckpt-0000000100.h5"' in code
    code = code.replace('"ckpt/ckpt-0000000100.h5"', repr(str(path)))
    scope: dict = {}
    exec(compile(code, "docs/format.md", "exec"), scope)  # noqa: S102 - our own doc
    assert scope["nranks"] == 1 and scope["step"] == 100
    assert np.array_equal(scope["u"], u)
    assert scope["s_of_rank_0"] == 2.5 and scope["t_value"] == 0.75


def test_doc_states_the_format_version_and_the_file_names():
    text = DOC.read_text()
    for needle in ["format_version", ".partial", ".bad", "hpcckpt-status.json", "events.jsonl"]:
        assert needle in text
