"""Checkpoints on the mirror (hpcckpt/store/mirror/copy.py) and restore from it
(hpcckpt/store/restore/fallback.py), with a second directory as the mirror, in one process."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror.backend import DirectoryBackend
from hpcckpt.store.store import CheckpointStore

ROOT = Path(__file__).resolve().parents[3]


def state(k: int, n: int = 1_000_000) -> dict:
    u = np.random.default_rng(7).random(n)
    u[: 1000 * k] += k  # a few blocks change from step to step
    return {"u": u, "meta": {"k": k}}


@pytest.fixture
def backend(tmp_path) -> DirectoryBackend:
    (tmp_path / "mirror").mkdir()
    return DirectoryBackend(tmp_path / "mirror")


def saved(tmp_path, steps, **kw) -> CheckpointStore:
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, **kw)
    for s in steps:
        store.save(s, state(s))
    return store


def flip_byte(path: Path, where: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_upload_writes_data_then_a_manifest_with_the_checksum(tmp_path, backend):
    store = saved(tmp_path, [1], incremental=False)
    path = store.directory / layout.checkpoint_name(1)
    up = mirror.upload(backend, path)
    assert up.files == (path.name,) and up.bytes == path.stat().st_size
    manifest = json.loads(backend.get_bytes(path.name + ".manifest.json"))
    assert manifest["checksum"] == mirror.file_checksum(path)
    assert manifest["algorithm"] == "xxh3_64" and manifest["size"] == up.bytes
    (m,) = mirror.list_mirrored(backend)
    assert m.good and m.step == 1 and m.to_dict()["checksum"].startswith("xxh3_64:")
    again = mirror.upload(backend, path)  # the same file is there, good: not sent again
    assert again.files == () and again.already == (path.name,)


def test_an_incremental_checkpoint_is_mirrored_with_its_chain(tmp_path, backend):
    store = saved(tmp_path, [1, 2, 3], max_chain=4)
    newest = store.directory / layout.checkpoint_name(3)
    up = mirror.upload(backend, newest)
    assert up.files == tuple(layout.checkpoint_name(s) for s in (1, 2, 3))
    listing = mirror.list_mirrored(backend)
    assert [m.step for m in listing] == [3, 2, 1] and all(m.good for m in listing)
    assert [c[1] for c in listing[0].chain] == [1, 2]
    # A broken base makes every delta built on it not good.
    mirror.mark_bad(backend, layout.checkpoint_name(1), "test")
    status = {m.step: m.status for m in mirror.list_mirrored(backend)}
    assert status == {1: "bad", 2: "broken chain", 3: "broken chain"}


def test_a_data_object_without_its_manifest_never_counts(tmp_path, backend):
    store = saved(tmp_path, [1, 2], incremental=False)
    mirror.upload(backend, store.directory / layout.checkpoint_name(1))
    backend.put_file(store.directory / layout.checkpoint_name(2), layout.checkpoint_name(2))
    assert [m.step for m in mirror.list_mirrored(backend)] == [1]
    assert mirror.newest_good(backend).step == 1


def test_a_copy_of_another_size_is_incomplete(tmp_path, backend):
    store = saved(tmp_path, [1], incremental=False)
    mirror.upload(backend, store.directory / layout.checkpoint_name(1))
    obj = Path(backend.root) / layout.checkpoint_name(1)
    obj.write_bytes(obj.read_bytes()[:-10])
    (m,) = mirror.list_mirrored(backend)
    assert m.status == "incomplete" and "bytes" in m.reason


def test_verify_reads_the_bytes_back_and_marks_a_flipped_byte_bad(tmp_path, backend):
    store = saved(tmp_path, [1], incremental=False)
    mirror.upload(backend, store.directory / layout.checkpoint_name(1))
    assert mirror.verify_mirrored(backend, "1").good
    flip_byte(Path(backend.root) / layout.checkpoint_name(1))
    assert mirror.list_mirrored(backend)[0].good  # sizes agree: only reading finds it
    v = mirror.verify_mirrored(backend, layout.checkpoint_name(1))
    assert not v.good and v.marked and "checksum" in v.problems[0]
    assert mirror.list_mirrored(backend)[0].status == "bad"
    assert not mirror.verify_mirrored(backend, "9").good  # not there


def test_upload_refuses_a_local_checkpoint_that_fails_its_checks(tmp_path, backend):
    store = saved(tmp_path, [1], incremental=False)
    path = store.directory / layout.checkpoint_name(1)
    flip_byte(path, 0.9)
    with pytest.raises(CheckpointError, match="fails its checks"):
        mirror.upload(backend, path)
    assert mirror.list_mirrored(backend) == []


def test_pull_fetches_the_chain_checked_and_refuses_a_bad_copy(tmp_path, backend):
    store = saved(tmp_path, [1, 2], max_chain=4)
    mirror.upload(backend, store.directory / layout.checkpoint_name(2))
    target = tmp_path / "elsewhere"
    path = mirror.pull(backend, 2, target)
    assert sorted(p.name for p in target.iterdir()) == [layout.checkpoint_name(s) for s in (1, 2)]
    for s in (1, 2):
        name = layout.checkpoint_name(s)
        assert (target / name).read_bytes() == (store.directory / name).read_bytes()
    assert path == target / layout.checkpoint_name(2)
    flip_byte(Path(backend.root) / layout.checkpoint_name(2))
    with pytest.raises(mirror.MirrorCopyBad, match="marked bad"):
        mirror.pull(backend, 2, tmp_path / "third")
    assert not (tmp_path / "third" / layout.checkpoint_name(2)).exists()
    assert mirror.list_mirrored(backend)[0].status == "bad"
    with pytest.raises(CheckpointError, match="bad"):
        mirror.pull(backend, 2, tmp_path / "fourth")


def test_restore_takes_the_mirror_when_the_directory_was_emptied(tmp_path, backend):
    store = saved(tmp_path, [1, 2, 3], max_chain=4)
    mirror.upload(backend, store.directory / layout.checkpoint_name(3))
    for p in store.directory.iterdir():
        p.unlink()
    fresh = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, mirror=str(backend.root))
    got = state(0)
    result = fresh.restore(got)
    assert result.step == 3 and result.source == "mirror"
    assert np.array_equal(got["u"], state(3)["u"]) and got["meta"]["k"] == 3


@pytest.mark.parametrize("share_group, fmode", [(False, 0o600), (True, 0o640)])
def test_a_pulled_checkpoint_gets_the_directorys_file_mode(tmp_path, backend, share_group, fmode):
    store = saved(tmp_path, [1], incremental=False, share_group=share_group)
    name = layout.checkpoint_name(1)
    mirror.upload(backend, store.directory / name)
    (store.directory / name).unlink()
    fresh = CheckpointStore(
        tmp_path / "ck", MPI.COMM_SELF, mirror=str(backend.root), share_group=share_group
    )
    assert fresh.restore(state(0)).source == "mirror"
    assert stat.S_IMODE((store.directory / name).stat().st_mode) == fmode
    assert not [p for p in store.directory.iterdir() if p.name.endswith((mirror.PULLING, ".part"))]
    by_hand = mirror.pull(backend, 1, tmp_path / "by-hand")  # hpcckpt mirror pull
    assert stat.S_IMODE(by_hand.stat().st_mode) == 0o600


def test_the_newest_good_checkpoint_of_either_tier_wins(tmp_path, backend):
    store = saved(tmp_path, [1, 2], incremental=False)
    mirror.upload(backend, store.directory / layout.checkpoint_name(2))
    (store.directory / layout.checkpoint_name(2)).unlink()  # the directory has only 1
    fresh = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, mirror=str(backend.root))
    assert fresh.restore(state(0)).source == "mirror"
    store.save(3, state(3))  # now the directory is newer
    result = fresh.restore(state(0))
    assert (result.step, result.source) == (3, "directory")


def test_a_flipped_byte_on_the_mirror_is_skipped_for_the_next_older(tmp_path, backend):
    store = saved(tmp_path, [1, 2], incremental=False)
    for s in (1, 2):
        mirror.upload(backend, store.directory / layout.checkpoint_name(s))
    flip_byte(Path(backend.root) / layout.checkpoint_name(2))
    empty = tmp_path / "new-scratch"
    fresh = CheckpointStore(empty, MPI.COMM_SELF, mirror=str(backend.root))
    got = state(0)
    result = fresh.restore(got)
    assert result.step == 1 and result.source == "mirror"
    assert result.skipped and result.skipped[0][0] == 2 and "manifest" in result.skipped[0][1]
    assert np.array_equal(got["u"], state(1)["u"])
    assert {m.step: m.status for m in mirror.list_mirrored(backend)} == {2: "bad", 1: "good"}
    assert not (empty / layout.checkpoint_name(2)).exists()


def test_an_unreachable_mirror_leaves_restore_to_the_directory(tmp_path, backend):
    store = saved(tmp_path, [1], incremental=False)
    gone = tmp_path / "unmounted"
    fresh = CheckpointStore(store.directory, MPI.COMM_SELF, mirror=str(gone))
    assert fresh.restore(state(0)).step == 1
    empty = CheckpointStore(tmp_path / "empty", MPI.COMM_SELF, mirror=str(gone))
    assert empty.restore(state(0)) is None


UPLOADER = """
import sys
from pathlib import Path
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror.backend import open_backend
backend = open_backend(sys.argv[1], bandwidth=2e6)
print("start", flush=True)
mirror.upload(backend, Path(sys.argv[2]))
"""


def test_a_kill_during_an_upload_leaves_the_previous_checkpoint_the_newest_good(tmp_path, backend):
    store = saved(tmp_path, [1], incremental=False)
    mirror.upload(backend, store.directory / layout.checkpoint_name(1))
    big = {"u": np.random.default_rng(1).random(2_000_000)}  # 16 MB: 8 s at 2 MB/s
    store2 = CheckpointStore(tmp_path / "ck2", MPI.COMM_SELF)
    store2.save(2, big)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            UPLOADER,
            str(backend.root),
            str(store2.directory / "ckpt-0000000002.h5"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "start"
    deadline = time.monotonic() + 30
    while not any(p.name.endswith(".part") for p in Path(backend.root).iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None, "the upload never began"
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert mirror.newest_good(backend).step == 1
    assert [m.step for m in mirror.list_mirrored(backend)] == [1]
