"""The suite's lanes and order under ``make test`` (tests/conftest.py): every directory,
module and test they name exists, so that a rename never silently drops a test from the
place it was given."""

from __future__ import annotations

import ast

from tests.conftest import LANES, SLURM_FIRST, SLURM_LONGEST
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
