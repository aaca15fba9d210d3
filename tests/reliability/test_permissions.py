"""Modes: checkpoints 0600 in a 0700 directory by default; 0640/0750 with share_group."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt import Checkpointer
from hpcckpt.store.file import layout
from hpcckpt.store.io.lock import LOCK_NAME
from tests.mpi_helpers import mpirun
from tests.permission_helpers import as_a_user, immutable, set_immutable, who

ROOT = Path(__file__).resolve().parents[2]
APPS = Path(__file__).resolve().parent / "apps"


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize(
    "share_group, fmode, dmode, umask",
    [
        (False, 0o600, 0o700, 0o022),
        (False, 0o600, 0o700, 0o000),
        (False, 0o600, 0o700, 0o077),
        (True, 0o640, 0o750, 0o022),
        (True, 0o640, 0o750, 0o000),
    ],
)
def test_modes_whatever_the_umask(tmp_path, share_group, fmode, dmode, umask, reliability_log):
    d = tmp_path / "a" / "ck"
    old = os.umask(umask)
    try:
        ck = Checkpointer(d, comm=MPI.COMM_SELF, every_steps=1, share_group=share_group)
        try:
            assert mode(d / LOCK_NAME) == fmode
            ck.save(1, {"u": np.zeros(10)})
        finally:
            ck.finish()
    finally:
        os.umask(old)
    assert mode(d) == dmode
    ckpt = d / layout.checkpoint_name(1)
    assert mode(ckpt) == fmode, oct(mode(ckpt))
    reliability_log.add(
        "permissions",
        case=f"share_group={share_group}, umask {umask:03o}",
        directory=oct(mode(d)),
        checkpoint=oct(mode(ckpt)),
        outcome="ok",
    )


def test_an_existing_directory_keeps_its_mode(tmp_path):
    d = tmp_path / "ck"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with Checkpointer(d, comm=MPI.COMM_SELF, every_steps=1) as ck:
        ck.save(1, {"u": np.zeros(10)})
    assert mode(d) == 0o755  # the owner's choice
    assert mode(d / layout.checkpoint_name(1)) == 0o600


# -- a directory that is not one, or that this user cannot write ------------------------------
def test_a_checkpoint_directory_that_is_a_file(tmp_path, reliability_log):
    d = tmp_path / "ck"
    d.write_text("not a directory\n")
    with pytest.raises(OSError) as err:
        Checkpointer(d, comm=MPI.COMM_SELF, every_steps=1)
    assert str(err.value) == (
        f"the checkpoint directory {d} exists and is not a directory (it is a regular file): "
        "choose another checkpoint directory, or move the file away"
    )
    reliability_log.add("permissions", case="the directory is a file", outcome="ok")


OPEN = """
import sys
from mpi4py import MPI
from hpcckpt import Checkpointer
Checkpointer(sys.argv[1], comm=MPI.COMM_SELF, every_steps=1)
"""


def test_a_checkpoint_directory_this_user_cannot_write(tmp_path, reliability_log):
    """Another user's directory (mode 0755): root without CAP_DAC_OVERRIDE is refused as a
    user is. The error names the directory, who may not write it, its mode and owner, the
    fix: not the lock file the first write happened to try."""
    d = tmp_path / "ck"
    d.mkdir(mode=0o755)
    os.chown(d, 1000, 1000)
    r = subprocess.run(
        [*as_a_user(), sys.executable, "-c", OPEN, str(d)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last == (
        f"OSError: the checkpoint directory {d} exists but cannot be written by user "
        f"{who(os.geteuid())}: Permission denied (mode 0755, owner {who(1000)}, group "
        f"{who(1000, 'gid')}). Choose a writable checkpoint directory, or fix its permissions "
        f"(as its owner: chmod u+rwx {d})"
    ), r.stderr
    assert "hpcckpt.lock" not in r.stderr
    reliability_log.add("permissions", case="another user's directory", outcome="ok")


def test_an_immutable_checkpoint_directory(tmp_path, reliability_log):
    d = tmp_path / "ck"
    d.mkdir()
    with immutable(d), pytest.raises(OSError) as err:
        Checkpointer(d, comm=MPI.COMM_SELF, every_steps=1)
    msg = str(err.value)
    assert msg.startswith(f"the checkpoint directory {d} exists but cannot be written by "), msg
    assert f"lsattr -d {d} shows an i" in msg and "hpcckpt.lock" not in msg, msg
    reliability_log.add("permissions", case="an immutable directory", outcome="ok")


@pytest.mark.mpi
def test_a_directory_unwritable_in_mid_run_says_so_once(tmp_path, reliability_log):
    """4 ranks: the failed save's error names rank 0's PermissionError once (the other
    ranks only echo it), and the lock that cannot be removed any more makes no noise at exit."""
    d = tmp_path / "ck"
    try:
        r = mpirun(4, [APPS / "unwritable_app.py", d], timeout=180)
    finally:
        if d.exists():
            set_immutable(d, on=False)
    assert r.returncode != 0
    failed = [ln for ln in r.stderr.splitlines() if "writing checkpoint of step 2 failed" in ln]
    assert failed, r.stderr
    for line in failed:
        assert line.count("PermissionError") == 1, line
        assert "(rank 0: PermissionError: " in line and "rank 1" not in line, line
    assert "Exception ignored in atexit" not in r.stderr, r.stderr
    reliability_log.add("permissions", case="unwritable in mid-run, 4 ranks", outcome="ok")
