"""Fixtures the wrapper's Slurm tests share."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.mpi_helpers import EXAMPLES


@pytest.fixture(scope="module")
def stopapp(tmp_path_factory) -> Path:
    """examples/c/stopapp, built with mpicc (a compiled MPI code that writes restart files)."""
    out = tmp_path_factory.mktemp("stopapp")
    build = subprocess.run(["make", "-C", str(EXAMPLES / "c"), f"OUT={out}", f"{out}/stopapp"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert build.returncode == 0, build.stderr
    return out / "stopapp"
