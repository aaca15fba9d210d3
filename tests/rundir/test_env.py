"""The HPCCKPT_* names (hpcckpt/rundir/env.py): each defined once, each a distinct variable."""

from __future__ import annotations

import re
from pathlib import Path

from hpcckpt.rundir import env

ROOT = Path(__file__).resolve().parents[2]


def test_names_are_distinct_and_spelled_as_documented():
    names = {k: v for k, v in vars(env).items() if k.endswith("_ENV")}
    assert len(set(names.values())) == len(names)
    assert all(re.fullmatch(r"HPCCKPT_[A-Z_]+", v) for v in names.values())


def test_no_other_module_defines_an_hpcckpt_variable():
    """One home: a string literal "HPCCKPT_X" assigned anywhere else is a second definition."""
    defined = re.compile(r'^\s*[A-Z_]+\s*=\s*"HPCCKPT_[A-Z_]+"', re.M)
    others = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "hpcckpt").rglob("*.py")
        if p.name != "env.py" and p.name != "faults.py" and defined.search(p.read_text())
    ]
    assert others == []


def test_chain_count():
    assert env.chain_count({}) == 0
    assert env.chain_count({env.CHAIN_COUNT_ENV: " 3 "}) == 3
    assert env.chain_count({env.CHAIN_COUNT_ENV: "x"}) == 0
