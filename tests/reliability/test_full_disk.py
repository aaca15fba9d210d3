"""A full disk: saving into a small tmpfs fails clearly; the previous checkpoint survives.

Needs ``mount -t tmpfs`` (root); skipped, with the reason, where mounting is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt import Checkpointer
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.store import CheckpointStore


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs at tmp_path/fs, unmounted afterwards."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def state_of(nbytes: int, step: int) -> dict:
    return {"u": np.full(nbytes // 8, float(step)), "step": step}


def test_store_save_on_a_full_disk(small_fs, reliability_log):
    d = small_fs / "ck"
    store = CheckpointStore(d, MPI.COMM_SELF)
    store.save(1, state_of(1 << 20, 1))  # 1 MiB fits
    with pytest.raises(CheckpointError) as err:
        store.save(2, state_of(6 << 20, 2))  # 6 MiB does not
    msg = str(err.value)
    assert "ENOSPC" in msg and str(d) in msg, msg
    assert layout.partials(d) == [], "no partial file is left behind"
    assert [e.step for e in layout.scan(d)] == [1]
    state = {"u": None, "step": None}
    assert store.restore(state).step == 1 and state["step"] == 1
    assert np.array_equal(state["u"], np.full((1 << 20) // 8, 1.0))
    # space freed: the next save works again
    store.save(3, state_of(1 << 20, 3))
    assert [e.step for e in layout.scan(d)] == [3, 1]
    reliability_log.add(
        "disk", case="store.save, 6 MiB into 4 MiB", error=msg[:60] + "...", outcome="ok"
    )


@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_checkpointer_raises_or_warns(small_fs, mode, reliability_log):
    d = small_fs / "ck"
    ck = Checkpointer(d, comm=MPI.COMM_SELF, every_steps=1, on_save_error=mode, keep_last=None)
    try:
        ck.save(1, state_of(1 << 20, 1))
        big = state_of(6 << 20, 2)
        if mode == "raise":
            with pytest.raises(CheckpointError, match="ENOSPC"):
                ck.save(2, big)
        else:
            assert ck.save(2, big) is None
            assert not ck.stop_requested
        assert layout.partials(d) == [] and [e.step for e in layout.scan(d)] == [1]
        events = (d / "events.jsonl").read_text()
        assert '"checkpoint_failed"' in events and "ENOSPC" in events
        ck.save(3, state_of(1 << 20, 3))  # the application goes on
    finally:
        ck.finish()
    assert [e.step for e in layout.scan(d)] == [3, 1]
    reliability_log.add(
        "disk",
        case=f"Checkpointer(on_save_error={mode!r})",
        error="CheckpointError raised" if mode == "raise" else "warning, save() -> None",
        outcome="ok",
    )


def test_no_space_message_names_enospc_without_a_mount(tmp_path):
    """The diagnosis itself: an error with a full file system becomes ENOSPC."""
    from hpcckpt.store.io import safety

    err = OSError("Can't write data (file write failed)")
    out = safety.explain_write_error(err, tmp_path, needed=1 << 62)
    assert isinstance(out, OSError) and "ENOSPC" in str(out) and str(tmp_path) in str(out)
    assert safety.explain_write_error(err, tmp_path, needed=1) is err
    assert safety.explain_write_error(None, tmp_path, needed=1) is None
    assert os.path.isdir(Path(tmp_path))


FILE_SIZE_LIMIT_APP = r"""
import gc, resource, signal, sys
import numpy as np
from mpi4py import MPI
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.store import CheckpointStore

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so that a too large write fails with EFBIG
store = CheckpointStore(sys.argv[1], MPI.COMM_SELF)
state = {"u": np.ones(1 << 20)}  # 8 MiB
store.save(1, state)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))  # ulimit -f 1024
state["u"][:] = 2.0  # every block changed: a full file of 8 MiB
try:
    store.save(2, state)
except CheckpointError as exc:
    print("ERROR", exc)
gc.collect()  # HDF5 crashed here when it had been left a file it could not finish
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
print("SAVED", store.save(3, state).step)
"""


def test_a_file_size_limit_fails_the_save_clearly_and_the_process_goes_on(tmp_path):
    d = tmp_path / "ck"
    proc = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMIT_APP, str(d)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "file size limit, ulimit -f" in proc.stdout, proc.stdout
    assert "SAVED 3" in proc.stdout, proc.stdout
    assert [e.step for e in layout.scan(d)] == [3, 1] and layout.partials(d) == []
