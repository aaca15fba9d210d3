"""Replicated values under real mpirun: a data-parallel torch training run whose model,
optimizer and schedule are declared replicated (tests/coord/apps/torch_app.py).

Stopped at a checkpoint and resumed, every step's loss on every rank and the final
parameters are bit-identical to an uninterrupted run, with synchronous, incremental,
asynchronous and cache-staged saves; the file holds the replicated arrays once; a copy
that differs between ranks is refused naming the array; the replicated part restores
on another rank count while the per-rank part is refused with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest

from tests.format_helpers import described
from tests.mpi_helpers import ROOT, mpirun

pytestmark = [pytest.mark.mpi]

APP = ROOT / "tests" / "coord" / "apps" / "torch_app.py"


def run(n: int, directory: Path, out: Path, *extra: str, expect: int = 0) -> dict:
    proc = mpirun(n, [APP, directory, "--out", out, *extra], timeout=240)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted runs on 2 and 3 ranks."""
    root = tmp_path_factory.mktemp("straight")
    return {n: run(n, root / f"d{n}", root / f"r{n}.json") for n in (2, 3)}


@pytest.mark.parametrize(
    "n, mode",
    [(2, "sync"), (3, "sync"), (2, "async"), (2, "cache"), (3, "cache-only")],
)
def test_stop_and_resume_is_bit_identical(tmp_path, straight, n, mode):
    extra = ["--mode", mode.removesuffix("-only")]
    if mode.startswith("cache"):
        extra += ["--cache", str(tmp_path / "cache")]
    first = run(n, tmp_path / "d", tmp_path / "a.json", "--stop-at", "9", *extra)
    if mode == "cache-only":  # the node-local copy is then the newest: ranks other than 0
        (tmp_path / "d" / "ckpt-0000000009.h5").unlink()  # get the replicated part from rank 0
    second = run(n, tmp_path / "d", tmp_path / "b.json", *extra)
    assert second["restored"] == 9
    if mode == "cache-only":
        events = [json.loads(line) for line in (tmp_path / "d" / "events.jsonl").open()]
        restores = [e for e in events if e["event"] == "restore"]
        assert restores[-1]["tier"] == "cache"
    losses = {**first["losses"], **second["losses"]}
    assert losses == straight[n]["losses"]
    assert sorted(map(int, losses)) == list(range(20))
    assert second["params"] == straight[n]["params"]
    assert len({tuple(p) for p in second["params"]}) == 1  # replicated: equal on every rank
    if mode == "sync":  # the frozen table does not change: later saves are incremental
        assert "incremental" in [kind for _, kind in first["saves"] + second["saves"]]


def test_replicated_arrays_are_stored_once_from_rank_0(straight, tmp_path):
    run(2, tmp_path / "d", tmp_path / "r.json", "--steps", "4")
    with h5py.File(tmp_path / "d" / "ckpt-0000000003.h5", "r") as f:
        assert f["meta"].attrs["format_version"] == 4
        w, info = f["state/model/0.weight"], described(f, "model/0.weight")
        assert w.shape == (32, 8) and info["replicated"] is True
        assert info["rank_offsets"] == [0, 32, 32]
        assert info["rank_shapes"] == [[32, 8], [0, 8]]
        assert info["torch_dtype"] == "float32"
        step = f["state/optim/state/0/step"]  # AdamW's 0-d step tensor, made by the first step
        assert step[...].tolist() == [4.0]
        assert described(f, "rng/torch")["rank_offsets"] == [0, 5056, 10112]  # per rank


def test_unreplicated_saves_every_rank_copy(tmp_path):
    run(2, tmp_path / "d", tmp_path / "r.json", "--steps", "4", "--no-replicated")
    with h5py.File(tmp_path / "d" / "ckpt-0000000003.h5", "r") as f:
        assert f["meta"].attrs["format_version"] == 4
        w = f["state/model/0.weight"]
        assert w.shape == (64, 8) and "replicated" not in described(f, "model/0.weight")


def test_a_replicated_value_that_differs_is_refused_naming_it(tmp_path):
    result = run(2, tmp_path / "d", tmp_path / "r.json", "--diverge-at", "5", expect=3)
    assert "model/0.weight" in result["error"] and "rank 1" in result["error"]
    assert "replicated" in result["error"]
    steps = sorted(int(p.name[5:15]) for p in (tmp_path / "d").glob("ckpt-*.h5"))
    assert steps == [3]  # the save of step 7 was refused; nothing was committed


def test_replicated_part_restores_on_one_rank_per_rank_part_is_refused(straight, tmp_path):
    run(2, tmp_path / "d", tmp_path / "a.json")
    part = run(1, tmp_path / "d", tmp_path / "b.json", "--only", "model,optim,sched")
    assert part["restored"] == 19
    assert part["params"][0] == straight[2]["params"][0]
    whole = run(1, tmp_path / "d", tmp_path / "c.json", "--stop-at", "99", expect=3)
    assert "differs between rank 0 and rank 1" in whole["error"]
    assert "rng" in whole["error"] or "data" in whole["error"]


def test_replicated_part_restores_on_more_ranks(straight, tmp_path):
    run(2, tmp_path / "d", tmp_path / "a.json")
    part = run(3, tmp_path / "d", tmp_path / "b.json", "--only", "model,optim")
    assert [p for p in part["params"]] == [straight[2]["params"][0]] * 3
