"""The suite's lanes and order under ``make test`` (tests/conftest.py): every directory,
module and test they name exists, so that a rename never silently drops a test from the
place it was given."""

from __future__ import annotations

import ast

from tests.conftest import LANES, SLURM_FIRST, SLURM_LONGEST, handout_key
from tests.mpi_helpers import ROOT


def functions(module: str) -> set[str]:
    tree = ast.parse((ROOT / module).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_the_lanes_and_the_first_modules_exist():
    assert all((ROOT / directory).is_dir() for directory in LANES)
    assert all((ROOT / module).is_file() for module in SLURM_FIRST)


def test_each_of_the_longest_slurm_tests_names_a_test_once():
    assert len(set(SLURM_LONGEST)) == len(SLURM_LONGEST)
    for entry in SLURM_LONGEST:
        module, name = entry.split("::")
        assert "slurm" in module and name.startswith("test_"), entry
        assert name in functions(module), f"{entry}: no such test"


def test_the_longest_slurm_tests_go_first_longest_first_then_the_first_modules():
    """A worker's order: the listed longest tests in their order, then the other Slurm
    tests of SLURM_FIRST's modules (in that order), then everything else as collected."""
    collected = [
        ("tests/job/test_wrapper_slurm.py", "test_chain_mode_through_two_links", True),
        ("tests/store/mirror/test_index.py", "test_a_mark_reaches_the_index", False),
        (SLURM_FIRST[1], "test_another", True),
        (SLURM_FIRST[0], "test_another", True),
        *((*entry.split("::"), True) for entry in reversed(SLURM_LONGEST)),
    ]
    order = sorted(collected, key=lambda t: handout_key(*t))
    assert [f"{m}::{f}" for m, f, _ in order[: len(SLURM_LONGEST)]] == list(SLURM_LONGEST)
    assert order[len(SLURM_LONGEST) :] == [collected[3], collected[2], *collected[:2]]
