"""What a Checkpointer leaves behind (hpcckpt/coord/teardown.py): after ``finish()`` or
``close()`` no hpcckpt thread runs, no staging buffer is held and nothing of the state is
referenced; a process that never calls either still exits 0 with the lock given back.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcckpt import Checkpointer
from hpcckpt.coord import teardown
from tests.mpi_helpers import ROOT, mpi_env


def run_and_end(tmp_path, end: str, **kwargs):
    """Three async saves of a tensor and an array, then ``end`` ("finish" or "close");
    weak references to the state's values and the threads hpcckpt started meanwhile."""
    before = set(teardown.hpcckpt_threads())
    (tmp_path / "mirror").mkdir()
    t = torch.arange(300_000, dtype=torch.float32)
    a = np.ones(200_000)
    model = torch.nn.Linear(64, 64)
    state = {"t": t, "a": a, "model": model, "step": 0}
    refs = [weakref.ref(t), weakref.ref(a), weakref.ref(model)]
    ck = Checkpointer(tmp_path / "ck", comm=MPI.COMM_SELF, every_steps=1, async_save=True,
                      mirror=str(tmp_path / "mirror"), **kwargs)  # fmt: skip
    started = set()
    for step in range(3):
        t.add_(1.0)
        a += 1.0
        state["step"] = step
        assert ck.due(step)
        ck.save(step, state)
        started |= set(teardown.hpcckpt_threads()) - before
    assert ck.buffers is not None and ck.buffers.nbytes > 0  # staged in host buffers
    getattr(ck, end)()
    del t, a, model, state
    gc.collect()
    return ck, refs, started, before


@pytest.mark.parametrize("end", ["finish", "close"])
def test_after_the_end_no_thread_buffer_or_reference_is_left(tmp_path, end):
    ck, refs, started, before = run_and_end(tmp_path, end)
    assert started, "the saves started no thread: nothing was checked"
    assert set(teardown.hpcckpt_threads()) - before == set()
    assert not any(t.is_alive() for t in started)
    assert ck.buffers is not None and ck.buffers.nbytes == 0
    assert ck._pending is None
    assert ck.store.mirroring is None and ck.store.saver.changes.tracker is None
    assert [r() for r in refs] == [None] * 3, "hpcckpt still references the state"
    assert not (tmp_path / "ck" / "hpcckpt.lock").exists()


def test_the_exit_hook_releases_what_was_never_finished(tmp_path):
    """No finish() nor close(): the process exits 0, the lock is given back and the exit
    hook found no hpcckpt thread it could not join (it would say so on stderr)."""
    (tmp_path / "mirror").mkdir()
    script = textwrap.dedent(
        f"""
        import numpy as np
        from mpi4py import MPI
        from hpcckpt import Checkpointer
        ck = Checkpointer({str(tmp_path / "ck")!r}, comm=MPI.COMM_SELF, every_steps=1,
                          async_save=True, mirror={str(tmp_path / "mirror")!r})
        state = {{"a": np.ones(100_000)}}
        for step in range(2):
            ck.due(step)
            ck.save(step, state)
        print("left without finish", flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=mpi_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "left without finish" in proc.stdout
    assert "still running at exit" not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "ck" / "hpcckpt.lock").exists()


def test_gloo_settles_only_where_gloo_runs():
    """Without torch.distributed's gloo workers the exit waits for nothing."""
    assert teardown.gloo_workers() == 0
    assert teardown.settle_gloo() is False


def test_gloo_workers_are_given_the_grace_before_finalization():
    """With a gloo group's workers running, the exit's settle step waits GLOO_GRACE with
    the GIL released (a subprocess: a 1-rank gloo group of its own)."""
    script = textwrap.dedent(
        """
        import socket, time
        import torch.distributed as dist
        from hpcckpt.coord import teardown
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        deadline = time.monotonic() + 30  # a new thread names itself once it runs
        while not teardown.gloo_workers() and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        waited = teardown.settle_gloo()
        print(teardown.gloo_workers(), waited, time.monotonic() - t0)
        dist.destroy_process_group()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=mpi_env(), cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    workers, waited, seconds = proc.stdout.split()
    assert int(workers) >= 1 and waited == "True"
    assert float(seconds) >= teardown.GLOO_GRACE
