"""File-system detection from statfs magic numbers, and the exact tuning produced for each."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.io import filesystem as fs
from hpcckpt.store.store import CheckpointStore

MiB, GiB = 1 << 20, 1 << 30


@pytest.mark.parametrize(
    "magic, kind",
    [
        (0x0BD00BD0, "lustre"),
        (0x47504653, "gpfs"),
        (0x6969, "nfs"),
        (0x19830326, "beegfs"),
        (0xEF53, "local"),
        (0x58465342, "local"),
        (0x01021994, "local"),
        (0x794C7630, "local"),
        (0x12345678, "unknown"),
        (-0x1 & 0xFFFFFFFF, "unknown"),
    ],
)
def test_kind_of_magic(magic, kind):
    assert fs.kind_of_magic(magic)[0] == kind


def test_detect_here_is_local_through_statfs(tmp_path):
    found = fs.detect(tmp_path / "not" / "yet" / "created")
    assert found.kind == "local" and found.magic is not None and found.block_size > 0
    assert fs.statfs_magic(tmp_path) == found.magic


def test_detect_falls_back_to_mountinfo(monkeypatch, tmp_path):
    monkeypatch.setattr(fs, "statfs_magic", lambda path: None)
    found = fs.detect(tmp_path)
    assert found.magic is None and found.kind in ("local", "unknown")


MOUNTINFO = """\
22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
40 22 0:40 / /lustre/scratch rw - lustre 10.0.0.1@o2ib:/scratch rw,flock
41 22 0:41 / /gpfs/fs1 rw - gpfs fs1 rw
42 22 0:42 / /home rw - nfs4 server:/home rw
43 22 0:43 / /lustre/scratch/a\\040b rw - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    "path, fstype",
    [
        ("/lustre/scratch/u/run1", "lustre"),
        ("/gpfs/fs1/x", "gpfs"),
        ("/home/me", "nfs4"),
        ("/tmp", "ext4"),
        ("/lustre/scratch/a b/c", "tmpfs"),
        ("/lustre/scratchy", "ext4"),
    ],
)
def test_mountinfo_longest_prefix(path, fstype):
    assert fs.mountinfo_type(path, MOUNTINFO) == fstype


def test_lustre_plan_gives_the_exact_command_and_alignment():
    lustre = fs.FileSystem("lustre", "lustre", 0x0BD00BD0, 4096)
    t = fs.plan("/lustre/scratch/ck", lustre, nranks=64, total_bytes=10 * GiB)
    assert t.setstripe_argv == [
        "lfs", "setstripe", "-c", "10", "-S", str(MiB), "/lustre/scratch/ck",
    ]  # fmt: skip
    assert t.alignment == (MiB // 2, MiB)
    assert t.direct_io is True


def test_lustre_defaults_scale_with_size_and_ranks():
    assert fs.default_stripe_count(100 * MiB, 8) == 1
    assert fs.default_stripe_count(1000 * GiB, 8) == 8
    assert fs.default_stripe_count(1000 * GiB, 4096) == 64
    assert fs.default_stripe_size(10 * MiB, 4) == MiB
    assert fs.default_stripe_size(8 * GiB, 4) == 4 * MiB
    assert fs.default_stripe_size(64 * GiB, 2) == 16 * MiB


def test_lustre_options_override_the_defaults():
    lustre = fs.FileSystem("lustre", "lustre", 0x0BD00BD0, 4096)
    opts = fs.TuningOptions(stripe_count=-1, stripe_size=8 * MiB)
    t = fs.plan("/l/ck", lustre, nranks=16, total_bytes=GiB, options=opts)
    assert t.setstripe_argv == ["lfs", "setstripe", "-c", "-1", "-S", str(8 * MiB), "/l/ck"]
    assert t.alignment == (4 * MiB, 8 * MiB)
    no_stripe = fs.TuningOptions(stripe_count=-1, stripe_size=8 * MiB, setstripe=False)
    assert fs.plan("/l/ck", lustre, 16, GiB, no_stripe).setstripe_argv is None


def test_mpi_io_hints_are_refused_with_the_reason():
    """The store opens no file through MPI-IO: hints would be silently ignored."""
    with pytest.raises(ValueError, match=r"hints=.*no effect.*stripe_count="):
        fs.TuningOptions(hints={"cb_nodes": "4"})


@pytest.mark.parametrize("count, size", [(0, MiB), (-2, MiB), (1, 1000), (1, 0)])
def test_bad_stripe_settings_are_rejected(count, size):
    with pytest.raises(ValueError, match="stripe"):
        fs.setstripe_argv("/d", count, size)


def test_gpfs_plan_uses_the_block_size():
    gpfs = fs.FileSystem("gpfs", "gpfs", 0x47504653, 16 * MiB)
    t = fs.plan("/gpfs/ck", gpfs, nranks=32, total_bytes=GiB)
    assert t.setstripe_argv is None
    assert t.alignment == (8 * MiB, 16 * MiB)


@pytest.mark.parametrize("kind", ["local", "nfs", "beegfs", "unknown"])
def test_other_file_systems_get_no_tuning(kind):
    t = fs.plan("/d", fs.FileSystem(kind, kind, None, 4096), nranks=4, total_bytes=GiB)
    assert t == fs.Tuning(kind, None, None)


def test_missing_lfs_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert "not found" in fs.apply_setstripe(["lfs", "setstripe", "-c", "1", "-S", "65536", "/"])


def test_stripe_and_alignment_reach_the_file_and_it_still_reads(tmp_path, monkeypatch):
    """Force the Lustre plan on a local disk (without lfs): HDF5 takes the alignment."""
    ran = []
    monkeypatch.setattr(fs, "apply_setstripe", lambda argv: ran.append(argv) or None)
    opts = fs.TuningOptions(kind="lustre", stripe_size=MiB)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, fs_tuning=opts)
    u = np.arange(300_000.0)
    store.save(1, {"u": u, "v": np.ones(10)})
    assert ran == [["lfs", "setstripe", "-c", "1", "-S", str(MiB), str(store.directory)]]
    with h5py.File(store.directory / "ckpt-0000000001.h5", "r") as f:
        assert f["state/u"].id.get_offset() % MiB == 0, "datasets are aligned to the stripe"
    out: dict = {}
    store.restore(out)
    assert np.array_equal(out["u"], u)
