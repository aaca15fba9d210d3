"""Rank 0's background copy to the mirror (hpcckpt/store/mirror/worker.py): which
checkpoints go, what the directory must keep meanwhile, a mirror that is down, full or
back, and the mirror's retention after each copy."""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror.backend import DirectoryBackend, open_backend
from hpcckpt.store.mirror.worker import MIRROR_FAILED, MIRRORED, MirrorWorker, prune_mirror
from hpcckpt.store.options import MirrorOptions
from hpcckpt.store.store import CheckpointStore
from tests.mpi_helpers import wait_for


def state(k: int) -> dict:
    u = np.random.default_rng(3).random(1_000_000)
    u[: 1000 * k] += k
    return {"u": u}


class Reports:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def __call__(self, kind: str, fields: dict) -> None:
        self.seen.append((kind, fields))

    def of(self, kind: str) -> list[dict]:
        return [f for k, f in self.seen if k == kind]


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, max_chain=4)


def save(store: CheckpointStore, step: int):
    return store.save(step, state(step))


def test_every_nth_commit_is_copied_and_the_newest_on_finish(tmp_path, store):
    (tmp_path / "m").mkdir()
    reports = Reports()
    worker = MirrorWorker(
        DirectoryBackend(tmp_path / "m"),
        MirrorOptions(str(tmp_path / "m"), mirror_every=3),
        reports,
    )
    try:
        queued = [worker.committed(s, save(store, s).path) for s in range(1, 8)]
        assert queued == [False, False, True, False, False, True, False]
        assert worker.wait(30)
        assert worker.submit_newest(store.directory) == 7 and worker.wait(30)
    finally:
        worker.close()
    copied = [f["step"] for f in reports.of(MIRRORED)]
    assert copied[-1] == 7 and set(copied) <= {3, 6, 7}
    assert mirror.newest_good(DirectoryBackend(tmp_path / "m")).step == 7


def test_an_interval_sends_the_first_commit_after_it(tmp_path, store):
    (tmp_path / "m").mkdir()
    options = MirrorOptions(str(tmp_path / "m"), mirror_interval=0.5)
    worker = MirrorWorker(DirectoryBackend(tmp_path / "m"), options)
    try:
        assert worker.committed(1, save(store, 1).path)  # the first one goes
        assert not worker.committed(2, save(store, 2).path)
        time.sleep(0.6)
        assert worker.committed(3, save(store, 3).path)
    finally:
        worker.close()


def test_the_directory_keeps_what_is_on_its_way_with_its_chain(tmp_path, store):
    (tmp_path / "m").mkdir()
    slow = open_backend(str(tmp_path / "m"), bandwidth=2e6)  # 8 MB: seconds
    worker = MirrorWorker(slow, MirrorOptions(str(tmp_path / "m")))
    try:
        for s in (1, 2):
            save(store, s)
        result = save(store, 3)
        assert result.kind == "incremental"
        worker.committed(3, result.path)
        assert worker.protected() == {1, 2, 3}
        store.prune(keep_last=1, protect=worker.protected())
        assert [e.step for e in layout.scan(store.directory)] == [3, 2, 1]
        assert worker.wait(60)
        assert worker.protected() == set()
    finally:
        worker.close()
    store.prune(keep_last=1, protect=worker.protected())  # the chain stays: 3 needs it
    assert [e.step for e in layout.scan(store.directory)] == [3, 2, 1]


def test_a_mirror_down_then_back_is_retried_and_catches_up(tmp_path, store):
    reports = Reports()
    root = tmp_path / "later"
    options = MirrorOptions(str(root), mirror_retry_max=0.2)
    worker = MirrorWorker(DirectoryBackend(root), options, reports)
    try:
        for s in (1, 2, 3):
            worker.committed(s, save(store, s).path)
        wait_for(lambda: len(reports.of(MIRROR_FAILED)) >= 3, 30, "three failed attempts")
        failed = reports.of(MIRROR_FAILED)
        assert "does not exist" in failed[0]["reason"] and failed[0]["retry_in"] is not None
        assert [f["attempt"] for f in failed[:3]] == [1, 2, 3]
        assert not worker.wait(0.3)  # bounded: says it did not arrive
        assert 3 in worker.protected()
        root.mkdir()  # the mirror is back
        assert worker.wait(30)
    finally:
        worker.close()
    assert reports.of(MIRRORED)[-1]["step"] == 3
    assert mirror.newest_good(DirectoryBackend(root)).step == 3


def test_retries_wait_one_second_doubling_up_to_mirror_retry_max(tmp_path, store):
    reports = Reports()
    options = MirrorOptions(str(tmp_path / "absent"), mirror_retry_max=3)
    worker = MirrorWorker(DirectoryBackend(tmp_path / "absent"), options, reports)
    try:
        worker.committed(1, save(store, 1).path)
        wait_for(lambda: len(reports.of(MIRROR_FAILED)) >= 3, 30, "three failed attempts")
    finally:
        worker.close()
    assert [f["retry_in"] for f in reports.of(MIRROR_FAILED)[:3]] == [1.0, 2.0, 3.0]


def test_a_full_mirror_is_reported_and_nothing_counts_there(tmp_path, store):
    root = tmp_path / "small"
    root.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(root)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a small tmpfs is not permitted here: {mounted.stderr!r}")
    try:
        reports = Reports()
        options = MirrorOptions(str(root), mirror_retry_max=0.2)
        worker = MirrorWorker(DirectoryBackend(root), options, reports)
        try:
            worker.committed(1, save(store, 1).path)  # 8 MB into 4 MB
            wait_for(lambda: reports.of(MIRROR_FAILED), 30, "a failed copy")
            assert "No space left" in reports.of(MIRROR_FAILED)[0]["reason"]
            assert not worker.wait(0.2)
        finally:
            worker.close()
        assert mirror.list_mirrored(DirectoryBackend(root)) == []
        assert [p.name for p in root.iterdir() if not p.name.endswith(".part")] == []
    finally:
        subprocess.run(["umount", str(root)], check=True)


def test_a_local_checkpoint_that_fails_its_checks_is_not_copied_nor_retried(tmp_path, store):
    (tmp_path / "m").mkdir()
    reports = Reports()
    worker = MirrorWorker(
        DirectoryBackend(tmp_path / "m"), MirrorOptions(str(tmp_path / "m")), reports
    )
    try:
        path = save(store, 1).path
        data = bytearray(path.read_bytes())
        data[int(len(data) * 0.9)] ^= 0xFF
        path.write_bytes(bytes(data))
        worker.committed(1, path)
        assert worker.wait(30)
    finally:
        worker.close()
    (failed,) = reports.of(MIRROR_FAILED)
    assert failed["retry_in"] is None and "fails its checks" in failed["reason"]
    assert mirror.list_mirrored(DirectoryBackend(tmp_path / "m")) == []


def test_the_mirror_keeps_its_last_n_and_milestones(tmp_path):
    backend = DirectoryBackend(tmp_path / "m")
    (tmp_path / "m").mkdir()
    full = CheckpointStore(tmp_path / "full", MPI.COMM_SELF, incremental=False)
    for s in range(1, 7):
        mirror.upload(backend, save(full, s).path)
    options = MirrorOptions(str(tmp_path / "m"), mirror_keep_last=1, mirror_keep_every=4)
    deleted = prune_mirror(backend, options, time.time())
    assert deleted == [layout.checkpoint_name(s) for s in (5, 3, 2)]  # newest first
    assert [m.step for m in mirror.list_mirrored(backend)] == [6, 4, 1]
    assert {o.key for o in backend.list()} == {
        name + suffix for s in (1, 4, 6) for name in [layout.checkpoint_name(s)]
        for suffix in ("", ".manifest.json")
    }  # fmt: skip


def test_the_mirror_keeps_what_a_kept_delta_is_built_on(tmp_path, store):
    backend = DirectoryBackend(tmp_path / "m")
    (tmp_path / "m").mkdir()
    for s in range(1, 4):
        mirror.upload(backend, save(store, s).path)
    assert prune_mirror(backend, MirrorOptions(str(tmp_path / "m"), mirror_keep_last=1), 0.0) == []
    assert [m.step for m in mirror.list_mirrored(backend)] == [3, 2, 1]


def test_a_stops_checkpoint_is_copied_whatever_mirror_every_says(tmp_path, store):
    (tmp_path / "m").mkdir()
    worker = MirrorWorker(
        DirectoryBackend(tmp_path / "m"), MirrorOptions(str(tmp_path / "m"), mirror_every=5)
    )
    try:
        assert not worker.committed(1, save(store, 1).path)
        assert worker.committed(2, save(store, 2).path, force=True) and worker.wait(30)
    finally:
        worker.close()
    assert mirror.newest_good(DirectoryBackend(tmp_path / "m")).step == 2
