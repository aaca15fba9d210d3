"""The writer's choice of direct or buffered writes under real mpirun: the ranks agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcckpt.store.io import filesystem
from tests.mpi_helpers import mpirun

pytestmark = pytest.mark.mpi

APP = Path(__file__).parents[1] / "apps" / "path_app.py"


def run(tmp_path: Path, *args: str) -> list[dict]:
    proc = mpirun(2, [APP, tmp_path / "ck", *args], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = next(json.loads(x) for x in proc.stdout.splitlines() if x.startswith("["))
    assert len(out) == 2, proc.stdout
    assert all(r["restored"] for r in out)
    return out


def test_the_ranks_probe_both_paths_and_agree_on_the_faster(tmp_path: Path) -> None:
    assert filesystem.detect(tmp_path).name in filesystem.DIRECT_IO_NAMES, "needs ext4/xfs here"
    ranks = run(tmp_path, "--saves", "6", "--mib", "16")
    paths = ranks[0]["paths"]
    assert paths[:4] == ["direct", "buffered", "direct", "buffered"]
    decisions = ranks[0]["decisions"]
    assert [d["step"] for d in decisions] == [3]
    assert decisions[0]["direct_mb_s"] > 0 and decisions[0]["buffered_mb_s"] > 0
    assert paths[4:] == [decisions[0]["path"]] * 2
    assert ranks[1]["paths"] == paths and ranks[1]["decisions"] == decisions  # one decision


def test_a_forced_path_is_never_measured(tmp_path: Path) -> None:
    ranks = run(tmp_path, "--saves", "5", "--mib", "16", "--direct-io", "no")
    assert all(r["paths"] == ["buffered"] * 5 and r["decisions"] == [] for r in ranks)
