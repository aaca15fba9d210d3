"""hpcckpt ls / inspect / verify / prune / export, in one process, on real checkpoints."""

from __future__ import annotations

import json
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner
from mpi4py import MPI

from hpcckpt.cli.store import (
    COMMANDS,
    export_command,
    inspect_command,
    ls_command,
    prune_command,
    verify_command,
)
from hpcckpt.store.file import layout
from hpcckpt.store.store import CheckpointStore
from tests.format_helpers import described
from tests.mpi_helpers import mpirun

APP = Path(__file__).resolve().parents[1] / "store" / "apps" / "reshard_app.py"


def invoke(command, *args):
    return CliRunner().invoke(command, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def ckdir(tmp_path) -> Path:
    """Steps 10, 20, 30 written in-process; 30 holds per-rank-looking data of one rank."""
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, distributed=["u"])
    for step in (10, 20, 30):
        state = {
            "u": np.arange(12.0).reshape(4, 3) * step,
            "s": np.array(step, dtype=np.int16),
            "big": 2**80,
            "name": "run",
            "rng": np.random.default_rng(step),
        }
        store.save(step, state)
    (store.directory / (layout.checkpoint_name(40) + layout.PARTIAL)).write_bytes(b"x")
    return store.directory


def flip(path: Path, dataset: str = "state/u") -> None:
    with h5py.File(path, "r") as f:
        off = f[dataset].id.get_offset()
    raw = bytearray(path.read_bytes())
    raw[off + 3] ^= 0x10
    path.write_bytes(bytes(raw))


def test_all_commands_are_exported_with_teaching_help():
    assert {c.name for c in COMMANDS} == {"ls", "inspect", "verify", "prune", "export"}
    for command in COMMANDS:
        r = invoke(command, "--help")
        assert r.exit_code == 0 and "Example" in r.output and "--json" in r.output


def test_ls_lists_good_bad_and_partial(ckdir):
    layout.mark_bad(ckdir / layout.checkpoint_name(20), "checksum mismatch (test)")
    r = invoke(ls_command, ckdir)
    assert r.exit_code == 0
    lines = r.output.splitlines()
    assert lines[0] == (
        "      STEP  TIME (UTC)             FILE SIZE  RANKS  KIND               BASE   DIRTY  "
        "ARRAYS WRITTEN  STATUS"
    )
    assert "good" in lines[1] and "bad" in lines[2] and "checksum mismatch" in lines[2]
    assert lines[4].split()[0] == "40" and lines[4].endswith("partial")
    rows = json.loads(invoke(ls_command, ckdir, "--json").output)
    assert [(x["step"], x["status"], x["ranks"], x["kind"]) for x in rows] == [
        (10, "good", 1, "full"),
        (20, "bad", 1, "full"),
        (30, "good", 1, "full"),
        (40, "partial", None, None),  # an unfinished save: its kind is not known
    ]
    assert all(x["size"] > 0 for x in rows)


def test_inspect_shows_arrays_scalars_and_meta(ckdir):
    info = json.loads(invoke(inspect_command, ckdir, "20", "--json").output)
    assert info["step"] == 20 and info["nranks"] == 1 and info["format_version"] == 4
    arrays = {a["name"]: a for a in info["arrays"]}
    assert arrays["u"]["shape"] == [4, 3] and arrays["u"]["distributed"]
    assert arrays["u"]["rank_offsets"] == [0, 4] and arrays["s"]["dtype"] == "int16"
    assert arrays["s"]["layout"] == "flat" and arrays["s"]["rank_shapes"] == [[]]
    assert info["scalars"]["big"] == 2**80 and info["scalars"]["name"] == "run"
    assert "Generator" in info["scalars"]["rng"]
    assert info["meta"]["checksum"] == "xxh3_64"
    text = invoke(inspect_command, ckdir).output  # newest by default
    assert "step 30" in text and "u: float64[4, 3]" in text and "0:[0,4)" in text


def test_times_are_iso_8601_utc_and_json_keeps_the_number(ckdir):
    (row,) = [r for r in json.loads(invoke(ls_command, ckdir, "--json").output) if r["step"] == 30]
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(row["time"]))
    assert f"        30  {when}  " in invoke(ls_command, ckdir).output
    info = json.loads(invoke(inspect_command, ckdir, "--json").output)
    assert isinstance(info["meta"]["time"], float) and info["meta"]["time"] == row["time"]
    text = invoke(inspect_command, ckdir).output
    assert f"  time = {when}\n" in text and f", written {when} by 1 ranks" in text


def test_ls_says_what_its_sizes_measure():
    text = invoke(ls_command, "--help").output
    assert "FILE SIZE (the file on disk" in text and "ARRAYS" in text
    assert "WRITTEN (the bytes of array data the save wrote, all ranks" in " ".join(text.split())


def test_inspect_missing_step_is_a_clear_error(ckdir):
    r = invoke(inspect_command, ckdir, "99")
    assert r.exit_code != 0 and "no checkpoint of step 99" in r.output


def test_verify_exit_status(ckdir):
    assert invoke(verify_command, ckdir).exit_code == 0
    assert invoke(verify_command, ckdir, "--all").exit_code == 0
    flip(ckdir / layout.checkpoint_name(10))
    r = invoke(verify_command, ckdir, "--all", "--json")
    assert r.exit_code == 1
    report = json.loads(r.output)
    assert not report["good"]
    bad = [c for c in report["checkpoints"] if not c["good"]]
    assert [c["step"] for c in bad] == [10] and "checksum" in bad[0]["problems"][0]
    assert invoke(verify_command, ckdir, "30").exit_code == 0
    r = invoke(verify_command, ckdir, "10")
    assert r.exit_code == 1 and "BAD" in r.output
    assert invoke(verify_command, ckdir, "10", "--all").exit_code == 2  # usage error


def test_verify_counts_marked_checkpoints_as_bad(ckdir):
    layout.mark_bad(ckdir / layout.checkpoint_name(30), "earlier failure")
    r = invoke(verify_command, ckdir, "30")
    assert r.exit_code == 1 and "earlier failure" in r.output


def test_verify_clear_mark_readmits_only_what_checks(ckdir):
    """A false alarm (a sound file marked bad) is cleared after every byte checked, and
    restore takes that checkpoint again; a damaged one keeps its mark."""
    good, damaged = ckdir / layout.checkpoint_name(30), ckdir / layout.checkpoint_name(20)
    layout.mark_bad(good, "HDF5 global heap at 2048 is damaged (object header)")
    flip(damaged)  # before its mark: a mark judges the file as it was then
    layout.mark_bad(damaged, "earlier failure")
    r = invoke(verify_command, ckdir, "--all", "--clear-mark", "--json")
    assert r.exit_code == 1  # step 20 is still bad
    report = {c["step"]: c for c in json.loads(r.output)["checkpoints"]}
    assert report[30]["good"] and "global heap" in report[30]["cleared_mark"]
    assert not report[20]["good"] and report[20]["cleared_mark"] is None
    assert layout.read_bad(damaged) == "earlier failure" and layout.read_bad(good) is None
    assert not good.with_name(good.name + layout.BAD).exists()
    restored = CheckpointStore(ckdir, MPI.COMM_SELF).restore({})
    assert restored is not None and restored.step == 30
    r = invoke(verify_command, ckdir, "30", "--clear-mark")
    assert r.exit_code == 0 and "bad mark removed" not in r.output  # nothing left to clear


def test_verify_clear_mark_says_so(ckdir):
    layout.mark_bad(ckdir / layout.checkpoint_name(30), "a false alarm")
    r = invoke(verify_command, ckdir, "30", "--clear-mark")
    assert r.exit_code == 0
    assert "bad mark removed: every byte checks (it said: a false alarm)" in r.output


def test_a_new_file_of_a_step_found_bad_is_listed_verified_and_restored_good(tmp_path):
    """Step 2 of 2 saves fails its checksum: a restore marks it and takes step 1; the run
    saves a new step 2, which ls and verify show good and the next restore takes."""
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    store.save(1, {"u": np.arange(12.0)})
    store.save(2, {"u": np.arange(12.0) * 2})
    second = store.directory / layout.checkpoint_name(2)
    flip(second)
    state = {"u": np.zeros(12)}
    assert store.restore(state).step == 1
    rows = json.loads(invoke(ls_command, store.directory, "--json").output)
    assert [(x["step"], x["status"]) for x in rows] == [(1, "good"), (2, "bad")]
    assert "fails its checksum" in rows[1]["reason"]
    store.save(2, {"u": np.arange(12.0) * 3})
    rows = json.loads(invoke(ls_command, store.directory, "--json").output)
    assert [(x["step"], x["status"], x["reason"]) for x in rows] == [
        (1, "good", None),
        (2, "good", None),
    ]
    r = invoke(verify_command, store.directory, "--all")
    assert r.exit_code == 0 and "step 2: good" in r.output, r.output
    state = {"u": np.zeros(12)}
    assert CheckpointStore(store.directory, MPI.COMM_SELF).restore(state).step == 2
    assert np.array_equal(state["u"], np.arange(12.0) * 3)


def test_prune_dry_run_then_real(ckdir):
    r = invoke(prune_command, ckdir, "--keep-last", "1", "--dry-run", "--json")
    assert json.loads(r.output)["deleted"] == [layout.checkpoint_name(s) for s in (10, 20)]
    assert len(layout.scan(ckdir)) == 3
    r = invoke(prune_command, ckdir, "--keep-last", "1", "--keep-every", "25")
    assert r.exit_code == 0 and "deleted 1 checkpoint" in r.output
    assert [e.step for e in layout.scan(ckdir)] == [30, 10]
    assert invoke(prune_command, ckdir).exit_code == 2  # a rule is required
    assert invoke(prune_command, ckdir, "--keep-last", "0").exit_code == 2


def test_export_in_process_checkpoint(ckdir, tmp_path):
    out = tmp_path / "flat.h5"
    r = invoke(export_command, ckdir, "20", out, "--json")
    assert r.exit_code == 0 and json.loads(r.output)["step"] == 20
    with h5py.File(out, "r") as f:
        assert f.attrs["format"] == "hpcckpt-export" and f.attrs["step"] == 20
        assert np.array_equal(f["arrays/u"][...], np.arange(12.0).reshape(4, 3) * 20)
        assert f["arrays/s/rank0"][()] == 20
        assert f["scalars"].attrs["name"] == "run"
        assert json.loads(f["scalars"].attrs["big"]) == 2**80
        tree = json.loads(f["trees"][0])
        assert tree["v"]["big"] == 2**80


def test_export_refuses_a_corrupt_checkpoint_and_leaves_nothing(ckdir, tmp_path):
    flip(ckdir / layout.checkpoint_name(20))
    out = tmp_path / "flat.h5"
    r = invoke(export_command, ckdir, "20", out)
    assert r.exit_code == 1 and "checksum" in r.output
    assert not out.exists() and not list(tmp_path.glob("flat.h5*"))


def test_export_safetensors_writes_the_model_weights(tmp_path):
    import torch
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 20), torch.nn.Linear(20, 4))
    model[1].to(torch.bfloat16)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    store.save(3, {"model": model, "optim": torch.optim.AdamW(model.parameters()), "step": 3})
    out = tmp_path / "weights"
    r = invoke(export_command, "--format", "safetensors", store.directory, "3", out, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert (doc["format"], doc["key"], doc["files"], doc["index"]) == (
        "safetensors",
        "model",
        ["model.safetensors"],
        None,
    )
    loaded = load_file(out / "model.safetensors")
    for name, value in model.state_dict().items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
    r = invoke(
        export_command,
        "--format=safetensors",
        "--max-shard-size",
        "1KB",
        "--key",
        "model",
        store.directory,
        "3",
        out,
    )
    assert r.exit_code == 0 and "4 tensors of 'model'" in r.output, r.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(model.state_dict())
    assert not (out / "model.safetensors").exists()  # the previous single file replaced


def test_export_safetensors_refuses_bad_options_by_name(ckdir, tmp_path):
    r = invoke(
        export_command,
        "--format",
        "safetensors",
        "--max-shard-size",
        "big",
        ckdir,
        "20",
        tmp_path / "o",
    )
    assert r.exit_code == 2 and "--max-shard-size" in r.output and "'5GB'" in r.output
    r = invoke(
        export_command, "--format", "safetensors", "--key", "nope", ckdir, "20", tmp_path / "o"
    )
    assert r.exit_code == 1 and "no key 'nope'" in r.output and "--key" in r.output
    assert invoke(export_command, ckdir, "20", tmp_path).exit_code == 2  # HDF5 needs a file
    text = invoke(export_command, "--help").output
    assert "--format [hdf5|safetensors]" in text and "default: hdf5" in text
    assert "--key" in text and "by default 'model'" in text and "index.json" in text


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_commands_on_checkpoints_written_by_mpirun(tmp_path, n):
    d = tmp_path / "ck"
    r = mpirun(n, [APP, "save", d, 17])
    assert r.returncode == 0, r.stderr
    rows = json.loads(invoke(ls_command, d, "--json").output)
    assert [(x["step"], x["ranks"], x["status"]) for x in rows] == [(7, n, "good")]
    info = json.loads(invoke(inspect_command, d, "7", "--json").output)
    u = next(a for a in info["arrays"] if a["name"] == "fields/u")
    assert u["shape"] == [17, 5] and len(u["rank_shapes"]) == n and u["distributed"]
    assert u["rank_offsets"][0] == 0 and u["rank_offsets"][-1] == 17
    assert info["scalars"]["t"] == 1.25
    assert invoke(verify_command, d, "--all").exit_code == 0
    out = tmp_path / "flat.h5"
    assert invoke(export_command, d, "7", out).exit_code == 0
    expected = (np.arange(17 * 5, dtype=np.float64).reshape(17, 5) * 1.000001) ** 1.5
    with h5py.File(out, "r") as f:
        assert f["arrays/fields/u"][...].tobytes() == expected.tobytes()
        assert f.attrs["nranks"] == n and len(f["trees"]) == n
        assert np.array_equal(f["arrays/params"][...], np.tile([0.5, 2.0], n))
    # damage the slice of the last writing rank: verify names that rank
    path = d / layout.checkpoint_name(7)
    with h5py.File(path, "r") as f:
        off = f["state/fields/u"].id.get_offset()
        last = described(f, "fields/u")["rank_offsets"][-2]
    raw = bytearray(path.read_bytes())
    raw[off + last * 5 * 8 + 1] ^= 0x01
    path.write_bytes(bytes(raw))
    r = invoke(verify_command, d, "7")
    assert r.exit_code == 1 and f"rank {n - 1}" in r.output


def test_inspect_and_export_show_huge_ints_without_decimal_text(tmp_path):
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    store.save(1, {"f": 3**30000})
    info = json.loads(invoke(inspect_command, store.directory, "--json").output)
    assert info["scalars"]["f"].startswith("<int of 47549 bits")
    assert invoke(export_command, store.directory, "1", tmp_path / "x.h5").exit_code == 0


def test_inspect_shows_tensors_and_replicated_arrays(tmp_path):
    import torch

    store = CheckpointStore(tmp_path / "ck", MPI.COMM_WORLD, replicated=["m"])
    store.save(1, {"m": {"w": torch.ones(2, 3, dtype=torch.bfloat16)}, "u": np.zeros(4)})
    out = invoke(inspect_command, tmp_path / "ck").output
    assert "m/w: torch.bfloat16[2, 3] (rows, replicated: rank 0's copy" in out
    assert "u: float64[4] (rows, 32 B)" in out
    doc = json.loads(invoke(inspect_command, "--json", tmp_path / "ck").output)
    arrays = {a["name"]: a for a in doc["arrays"]}
    assert arrays["m/w"]["replicated"] and arrays["m/w"]["torch_dtype"] == "bfloat16"
    assert not arrays["u"]["replicated"] and arrays["u"]["torch_dtype"] is None
