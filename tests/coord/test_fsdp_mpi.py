"""FSDP2 training through the Checkpointer under real mpirun (tests/coord/apps/fsdp_app.py):
``fully_shard`` on gloo, dropout, a cosine schedule, per-rank RNG and data position.

A run stopped at a checkpoint (cleanly, or by SIGKILL of the whole mpirun) and resumed
makes every loss, and ends with parameters and AdamW moments, bit-identical to an
uninterrupted run, with the model and optimizer saved as objects or as the state dicts
of ``torch.distributed.checkpoint.state_dict.get_state_dict`` (set back with
``set_state_dict``); also when a byte of the newest checkpoint's shards is flipped (its
checksums find it and the one before it is taken). Resumed on another rank count
(2 -> 3, 2 -> 1), the run equals one that starts there from the same checkpoint's
global tensors sharded by torch itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import h5py
import pytest

from hpcckpt.rundir.events import read_events
from tests.mpi_helpers import ROOT, mpi_env, mpirun, mpirun_cmd

pytestmark = [pytest.mark.mpi]

APP = ROOT / "tests" / "coord" / "apps" / "fsdp_app.py"
STEPS = 8


def run(n: int, directory: Path, out: Path, *extra: str, expect: int = 0) -> dict:
    proc = mpirun(n, [APP, directory, "--out", out, "--steps", STEPS, *extra], timeout=240)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Uninterrupted runs of both APIs, and a 2-rank checkpoint of step 3."""
    root = tmp_path_factory.mktemp("fsdp")
    out = {
        api: run(2, root / api, root / f"{api}.json", "--api", api) for api in ("objects", "dcp")
    }
    run(2, root / "stopped", root / "stopped.json", "--stop-at", "3")
    out["stopped"] = root / "stopped"
    return out


@pytest.mark.parametrize("api", ["objects", "dcp"])
def test_stop_and_resume_is_bit_identical(runs, tmp_path, api):
    first = run(2, tmp_path / "d", tmp_path / "a.json", "--api", api, "--stop-at", "3")
    second = run(2, tmp_path / "d", tmp_path / "b.json", "--api", api)
    assert second["restored"] == 3
    assert {**first["losses"], **second["losses"]} == runs[api]["losses"]
    assert sorted(map(int, second["losses"])) == list(range(4, STEPS))
    assert second["local"] == runs[api]["local"]  # each rank's shards and moments
    assert second["full"] == runs[api]["full"]


def test_a_killed_run_resumes_bit_identical(runs, tmp_path):
    """SIGKILL of mpirun and every rank after the checkpoint of step 3."""
    d, log = tmp_path / "d", tmp_path / "losses.jsonl"
    args = [APP, d, "--out", tmp_path / "a.json", "--steps", STEPS, "--hang-at", "3"]
    proc = subprocess.Popen(
        mpirun_cmd(2, [*args, "--log", log]),
        env=mpi_env(),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 180
        while not (d / "saved-3").exists():
            assert proc.poll() is None, "the run ended before it was killed"
            assert time.monotonic() < deadline, "no checkpoint of step 3 within 180 s"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    second = run(2, d, tmp_path / "b.json", "--log", str(log))
    assert second["restored"] == 3
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["step"] for e in logged] == list(range(STEPS))
    assert {str(e["step"]): e["losses"] for e in logged} == runs["objects"]["losses"]
    assert second["local"] == runs["objects"]["local"]
    assert second["full"] == runs["objects"]["full"]


def flip_a_shard_byte(path: Path) -> str:
    """Flip one byte in the middle of the stored shards of a weight; its array path."""
    with h5py.File(path, "r") as f:
        found = []
        f.visititems(lambda name, obj: found.append((name, obj)) if "weight" in name
                     and isinstance(obj, h5py.Dataset) and obj.size else None)  # fmt: skip
        name, ds = found[0]
        at = ds.id.get_offset() + ds.size * ds.dtype.itemsize // 2
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return name


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(runs, tmp_path):
    d = tmp_path / "d"
    run(2, d, tmp_path / "a.json", "--every", "2", "--stop-at", "5")  # saves 1, 3, 5
    assert flip_a_shard_byte(d / "ckpt-0000000005.h5")
    second = run(2, d, tmp_path / "b.json")
    assert second["restored"] == 3 and second["error"] is None
    assert [e["step"] for e in read_events(d) if e["event"] == "skip_bad"] == [5]
    assert second["losses"] == {k: v for k, v in runs["objects"]["losses"].items() if int(k) > 3}
    assert second["local"] == runs["objects"]["local"]
    assert second["full"] == runs["objects"]["full"]


@pytest.mark.parametrize("n", [3, 1])
def test_resume_on_another_rank_count_equals_a_run_there_from_the_same_checkpoint(
    runs, tmp_path, n
):
    keys = ["--only", "model,optim,sched"]
    for name in ("resharded", "reference"):
        shutil.copytree(runs["stopped"], tmp_path / name)
    resharded = run(n, tmp_path / "resharded", tmp_path / "a.json", *keys)
    reference = run(n, tmp_path / "reference", tmp_path / "b.json", *keys, "--reference")
    assert resharded["restored"] == reference["restored"] == 3
    assert sorted(map(int, resharded["losses"])) == list(range(4, STEPS))
    assert all(len(losses) == n for losses in resharded["losses"].values())
    assert resharded["losses"] == reference["losses"]
    assert resharded["full"] == reference["full"]
    assert resharded["local"] == reference["local"]
