"""A Checkpointer over torch.distributed (gloo) with no MPI: two ranks started by
torch.multiprocessing, ``Checkpointer(directory)`` given no communicator, save and
restore of numpy arrays, a torch model and its AdamW, bit for bit; the node-local tier's
partner and XOR redundancy rebuild a lost node's copy over gloo's point-to-point and
reductions. mpi4py is never loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401 (fails, never skips, without torch)

from hpcckpt.rundir.events import read_events
from hpcckpt.store.comm import MPI_LAUNCHER_ENV
from hpcckpt.store.file import layout

APP = Path(__file__).parent / "apps" / "torch_ckpt_app.py"
ROOT = Path(__file__).resolve().parents[3]


def run(work: Path, mode: str, steps: list[int], **ck) -> list[dict]:
    out = work / f"{mode}-{len(list(work.glob('*.out')))}.out"
    spec = {"mode": mode, "n": 2, "dir": str(work / "ck"), "steps": steps, "out": str(out)}
    spec["ck"] = ck
    path = out.with_suffix(".json")
    path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in MPI_LAUNCHER_ENV}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(APP), str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert [r["error"] for r in results] == [None, None], results
    assert [(r["comm"], r["mpi_loaded"]) for r in results] == [("TorchComm", False)] * 2
    return results


@pytest.mark.parametrize("async_save", [False, True])
def test_save_and_restore_numpy_and_a_torch_model_over_gloo(tmp_path, async_save):
    saved = run(tmp_path, "save", [0, 1, 2], async_save=async_save)
    assert [r["saved"] for r in saved] == [2, 2]
    assert [e.step for e in layout.scan(tmp_path / "ck")] == [2, 1, 0]
    results = run(tmp_path, "restore", [], async_save=async_save)
    assert [(r["step"], r["same_arrays"], r["same_model"]) for r in results] == [
        (2, True, True)
    ] * 2


@pytest.mark.parametrize("scheme", ["partner", "xor"])
def test_the_node_local_tier_rebuilds_a_lost_node_over_gloo(tmp_path, scheme):
    tier = {"cache": str(tmp_path / "cache" / "%n"), "redundancy": scheme}
    tier.update(redundancy_set=2, drain_every=5)
    run(tmp_path, "save", list(range(7)), nodes=["a", "b"], **tier)
    assert [e.step for e in layout.scan(tmp_path / "ck")] == [4]  # 5, 6: node-local only
    shutil.rmtree(tmp_path / "cache" / "b")  # node b lost; rank 1 restarts on node c
    results = run(tmp_path, "restore", [], nodes=["a", "c"], **tier)
    assert [(r["step"], r["same_arrays"], r["same_model"]) for r in results] == [
        (6, True, True)
    ] * 2
    (ev,) = [e for e in read_events(tmp_path / "ck") if e["event"] == "restore"]
    assert (ev["tier"], ev["rebuilt"], ev["rebuilt_from"]) == ("cache", [1], scheme), ev
