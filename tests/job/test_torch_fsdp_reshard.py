"""An FSDP2 checkpoint written by 2 torchrun workers (gloo, CPU, no MPI), restored with
``only=["model", "optim", "sched"]`` by torchrun runs of 1 and of 3 workers: the
parameters and AdamW's moments they hold right after the restore, gathered whole, equal
those the 2 workers held when they saved (tests/job/apps/torch_train.py ``--fsdp``). On 3
workers the first layer's 32 rows split 11/11/10 and the last layer's single row lies on
rank 0 alone, the others' shards empty. The training then goes on on the new world size.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.job.test_torch_launch_slurm import cluster_env_free
from tests.mpi_helpers import ROOT

pytestmark = [pytest.mark.slow]

APP = ROOT / "tests" / "job" / "apps" / "torch_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS, EVERY = 60, 25  # checkpoints of steps 24 and 49; 10 steps after the restore


def torchrun(workers: int, ckpt: Path, out: Path, *extra: str) -> dict:
    if not TORCHRUN.exists():
        pytest.fail(f"{TORCHRUN} not found: install torch (make setup does)")
    r = subprocess.run(
        [str(TORCHRUN), f"--nproc-per-node={workers}", str(APP), "--fsdp", "--steps",
         str(STEPS), "--every", str(EVERY), "--ckpt-dir", str(ckpt), "--out", str(out), *extra],
        env=cluster_env_free(), capture_output=True, text=True, timeout=300, cwd=str(out.parent),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict]:
    """The 2-worker run: its checkpoint directory and its result."""
    root = tmp_path_factory.mktemp("fsdp-2")
    got = torchrun(2, root / "ck", root / "two.json")
    assert sorted(got["saved"], key=int) == ["24", "49"]
    return root / "ck", got


@pytest.mark.parametrize("workers", [1, 3])
def test_fsdp_checkpoint_of_two_torchrun_workers_restored_on_another_world_size(
    written, tmp_path, workers
):
    ckpt, two = written
    shutil.copytree(ckpt, tmp_path / "ck")
    got = torchrun(workers, tmp_path / "ck", tmp_path / "m.json", "--only", "model,optim,sched")
    assert got["world_size"] == workers and got["launched_by"] == "torchrun"
    assert got["resumed_at"] == 49
    assert got["restored"] == two["saved"]["49"]  # parameters and moments, bit for bit
    assert got["restored"] != two["saved"]["24"]
    assert [len(h) for h in got["losses"]] == [STEPS - 50] * workers
    assert all(d["num_replicas"] == workers and d["epoch"] == 0 for d in got["data"])
