"""Modes: checkpoints 0600 in a 0700 directory by default; 0640/0750 with share_group."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt import Checkpointer
from hpcckpt.store import layout
from hpcckpt.store.lock import LOCK_NAME


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
