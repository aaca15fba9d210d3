"""Slurm's hostlist form (hpcckpt/slurm/hostlist.py)."""

from __future__ import annotations

import pytest

from hpcckpt import slurm as nodes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[1,3]", ["n1", "n3"]),
        ("n1", ["n1"]),
        ("gpu[08-10],cpu1", ["gpu08", "gpu09", "gpu10", "cpu1"]),
        ("n[1-2,5],m[1-2]", ["n1", "n2", "n5", "m1", "m2"]),
        ("(null)", []),
        ("", []),
    ],
)
def test_expand_hostlist(text, expected):
    assert nodes.expand_hostlist(text) == expected
