"""The poisoned-state guard: the finite check, and NaN runs on 2 and 3 ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.coord import validate
from hpcckpt.rundir.events import read_events
from hpcckpt.store import catalog
from tests.job.test_wrapper import Wrapped, clean_env
from tests.mpi_helpers import mpi_env, mpirun, mpirun_cmd

GUARD_APP = Path(__file__).resolve().parents[1] / "job" / "apps" / "guard_app.py"


def test_finite_state_passes():
    state = {
        "u": np.ones((50, 40)),
        "c": np.ones(7, dtype=np.complex64),
        "h": np.ones(3, dtype=np.float16),
        "i": np.arange(5),
        "nested": {"list": [1.5, np.float32(2)], "s": "text", "b": b"x"},
        "t": 0.5,
        "empty": np.zeros(0),
    }
    assert validate.check_finite(state) is None


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (np.array([1.0, np.nan, 3.0]), "1 NaN"),
        (np.array([[1.0, 2.0], [np.inf, -np.inf]]), "2 Inf"),
        (np.array([1 + 1j, complex(0, np.nan)]), "1 NaN"),
        (np.array([1, np.inf], dtype=np.float16), "1 Inf"),
        (np.asfortranarray(np.where(np.eye(5) > 0, np.nan, 1.0)), "5 NaN"),
        (np.arange(20.0).reshape(4, 5)[:, ::2].copy() * np.array([1, np.nan, 1]), "4 NaN"),
    ],
)
def test_nonfinite_arrays_are_named(value, where):
    message = validate.check_finite({"fields": {"u": value}, "ok": np.ones(3)})
    assert message is not None and "'fields/u'" in message and where in message
    assert "'ok'" not in message


def test_noncontiguous_view_and_scalars():
    a = np.ones((10, 10))
    a[3, 4] = np.nan
    assert "first at index [2, 2]" in validate.check_finite({"v": a[1:, ::2]})
    assert validate.check_finite({"v": a[::2, ::2]}) is None  # the NaN is not in the view
    assert "'t'" in validate.check_finite({"t": float("inf")})
    assert "'z'" in validate.check_finite({"z": complex(1, float("nan"))})


def test_large_finite_values_that_overflow_a_block_sum_are_not_rejected():
    big = np.full(1 << 16, np.finfo(np.float64).max / 2)
    with np.errstate(over="ignore"):
        assert np.isinf(big.sum())
    assert validate.array_is_finite(big)
    big[-1] = np.nan
    assert not validate.array_is_finite(big, block_bytes=4096)


def test_custom_validators():
    assert validate.run_validator(lambda s: True, {}) is None
    assert validate.run_validator(lambda s: None, {}) is None
    assert "returned False" in validate.run_validator(lambda s: False, {})
    assert validate.run_validator(lambda s: "energy grew", {}) == "energy grew"

    def broken(state):
        raise KeyError("x")

    assert "raised KeyError" in validate.run_validator(broken, {})
    assert validate.make_validator(None) is None
    assert validate.make_validator("finite") is validate.check_finite
    with pytest.raises(ValueError):
        validate.make_validator("positive")


def test_exception_names():
    import hpcckpt

    assert hpcckpt.PoisonedState is hpcckpt.CheckpointRejected is validate.PoisonedState
    err = validate.PoisonedState(9, {1: "non-finite values in 'u'"})
    assert "step 9 rejected" in str(err) and "rank(s) 1" in str(err)


def _rejected_run(tmp_path: Path, nranks: int, nan_rank: int):
    ckpt = tmp_path / "ckpt"
    args = [GUARD_APP, "--ckpt-dir", ckpt, "--steps", "60", "--every", "10"]
    r = mpirun(nranks, [*args, "--nan-at", "29", "--nan-rank", str(nan_rank)])
    return ckpt, args, r


@pytest.mark.mpi
@pytest.mark.parametrize(("nranks", "nan_rank"), [(2, 1), (3, 2)])
def test_nan_on_one_rank_rejects_the_checkpoint(tmp_path, nranks, nan_rank):
    ckpt, args, r = _rejected_run(tmp_path, nranks, nan_rank)
    assert r.returncode != 0, r.stderr
    assert "PoisonedState" in r.stderr and "checkpoint of step 29 rejected" in r.stderr
    evs = list(read_events(ckpt))
    (rej,) = [e for e in evs if e["event"] == "rejected"]
    assert rej["step"] == 29 and rej["ranks"] == [nan_rank] and rej["arrays"] == ["u"]
    assert "1 NaN" in rej["problems"][str(nan_rank)]
    assert [e["step"] for e in evs if e["event"] == "checkpoint"] == [9, 19]
    # kept aside, never restored; listed by hpcckpt ls
    kept = ckpt / "ckpt-0000000029.h5.rejected"
    assert kept.is_file() and rej["path"] == kept.name
    info = json.loads((ckpt / (kept.name + ".json")).read_text())
    assert info["ranks"] == [nan_rank] and info["arrays"][str(nan_rank)] == ["u"]
    assert not list(ckpt.glob(".rejected-*"))
    assert catalog.find(ckpt, None).name == "ckpt-0000000019.h5"
    rows = catalog.list_directory(ckpt)
    assert [(r["step"], r["status"]) for r in rows][-1] == (29, "rejected")
    described = catalog.describe(kept)
    assert described["step"] == 29 and described["nranks"] == nranks
    # restore gives the previous good checkpoint
    again = mpirun(nranks, [*args, "--steps", "20"])
    assert again.returncode == 0, again.stderr
    restores = [e for e in read_events(ckpt) if e["event"] == "restore"]
    assert restores[-1]["step"] == 19


@pytest.mark.mpi
def test_custom_validate_function_rejects(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = mpirun(2, [GUARD_APP, "--ckpt-dir", ckpt, "--steps", "30", "--every", "10",
                   "--validate", "positive", "--nan-at", "15", "--nan-array", "u"])  # fmt: skip
    # "positive" checks t only: the NaN in u makes t NaN, and NaN >= 0 is False
    assert r.returncode != 0, r.stderr
    (rej,) = [e for e in read_events(ckpt) if e["event"] == "rejected"]
    assert rej["ranks"] == [0, 1] and "t is negative (nan)" in rej["problems"]["0"]


@pytest.mark.mpi
@pytest.mark.slow
def test_wrapper_gives_up_on_a_poisoned_state(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = mpirun_cmd(2, [GUARD_APP, "--steps", "60", "--every", "10", "--nan-at", "29"])
    env = clean_env(**{k: v for k, v in mpi_env().items() if k.startswith("OMPI_")})
    w = Wrapped(ckpt, cmd, "--min-progress", "0", env=env)
    rc = w.wait(timeout=120)
    assert rc != 0, w.stderr
    assert "step stopped on a poisoned state" in w.stderr, w.stderr
    assert "checkpoint of step 29 was rejected: the state of rank(s) 1" in w.stderr, w.stderr
    evs = list(read_events(ckpt))
    end = next(e for e in evs if e["event"] == "step_end")
    assert end["outcome"] == "poisoned"
    give_up = next(e for e in evs if e["event"] == "give_up")
    assert give_up["poisoned"] is True and give_up["wrapper_exit"] == rc
    assert not any(e["event"] in ("requeue", "chain") for e in evs)
    assert sys.executable


def test_the_finite_guard_sees_inside_models_and_bfloat16_tensors():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6))
    assert validate.check_finite({"model": model, "h": torch.ones(2, dtype=torch.bfloat16)}) is None
    with torch.no_grad():
        model[0].weight[1, 2] = float("nan")
    assert "'model/0.weight'" in validate.check_finite({"model": model})
    assert "'h'" in validate.check_finite(
        {"h": torch.tensor([1.0, float("inf")], dtype=torch.bfloat16)}
    )
