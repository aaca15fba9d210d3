"""Rank 0's background copy to the mirror (hpcckpt/store/mirror/worker.py): which
checkpoints go, what the directory must keep meanwhile, a mirror that is down, full or
back, and the mirror's retention after each copy."""

from __future__ import annotations

import logging
import math
import random
import subprocess
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror import index as mirror_index
from hpcckpt.store.mirror.backend import (
    STREAM_CHUNK,
    DirectoryBackend,
    MirrorUnavailable,
    open_backend,
)
from hpcckpt.store.mirror.index import INDEX
from hpcckpt.store.mirror.worker import (
    MIRROR_FAILED,
    MIRRORED,
    MirrorWorker,
    prune_mirror,
    retry_delay,
)
from hpcckpt.store.options import MirrorOptions
from hpcckpt.store.store import CheckpointStore
from tests.mpi_helpers import wait_for

#: Seconds a copy may take: the copying thread runs at nice 19, so a machine busy with
#: other work (the suite's other tests) gives it only the cycles nobody else wants.
COPIED = 180


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


def test_every_nth_commit_is_copied_and_the_newest_on_finish(tmp_path, store, caplog):
    """Every Nth commit goes, the newest at the end; each verified copy logs one line."""
    caplog.set_level(logging.INFO, logger="hpcckpt")
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
        assert worker.wait(COPIED)
        assert worker.submit_newest(store.directory) == 7 and worker.wait(COPIED)
    finally:
        worker.close()
    copied = [f["step"] for f in reports.of(MIRRORED)]
    assert copied[-1] == 7 and set(copied) <= {3, 6, 7}
    lines = [r.getMessage() for r in caplog.records if "verified:" in r.getMessage()]
    assert len(lines) == len(copied)
    assert lines[-1].startswith(f"mirror: step 7 copied to {tmp_path / 'm'} and verified: ")
    assert mirror.newest_good(DirectoryBackend(tmp_path / "m")).step == 7


def test_an_interval_sends_the_first_commit_after_it(tmp_path, store):
    (tmp_path / "m").mkdir()
    # An interval longer than a save on a loaded machine (one took over 0.5 s in a
    # fresh-clone run): step 2 comes within it, step 3 after it.
    interval = 3.0
    options = MirrorOptions(str(tmp_path / "m"), mirror_interval=interval)
    worker = MirrorWorker(DirectoryBackend(tmp_path / "m"), options)
    try:
        first = save(store, 1).path
        t0 = time.monotonic()
        assert worker.committed(1, first)  # the first one goes
        assert not worker.committed(2, save(store, 2).path)
        third = save(store, 3).path
        time.sleep(max(0.0, t0 + interval + 0.1 - time.monotonic()))
        assert worker.committed(3, third)
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
        assert worker.wait(COPIED)
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
        wait_for(lambda: len(reports.of(MIRROR_FAILED)) >= 3, COPIED, "three failed attempts")
        failed = reports.of(MIRROR_FAILED)
        assert "does not exist" in failed[0]["reason"] and failed[0]["retry_in"] is not None
        # one report for the first failure, then one each time their count doubles
        assert [f["count"] for f in failed[:3]] == [1, 2, 4]
        assert [f["tries"] for f in failed[:3]] == [1, 2, 4]
        assert all("attempt" not in f for f in failed)  # the run attempt's field, not ours
        assert len({f["since"] for f in failed}) == 1
        assert not worker.wait(0.3)  # bounded: says it did not arrive
        assert 3 in worker.protected()
        root.mkdir()  # the mirror is back
        assert worker.wait(COPIED)
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
        wait_for(lambda: len(reports.of(MIRROR_FAILED)) >= 3, COPIED, "three failed attempts")
    finally:
        worker.close()
    # reported at the 1st, 2nd and 4th failure: 1 s, 2 s, then 3 s (the cap), each
    # less a random cut of up to half
    retry_in = [f["retry_in"] for f in reports.of(MIRROR_FAILED)[:3]]
    for got, nominal in zip(retry_in, (1.0, 2.0, 3.0), strict=True):
        assert nominal / 2 <= got <= nominal


def test_the_backoff_doubles_to_its_cap_with_jitter_and_never_overflows():
    rng = random.Random(7)
    for failures in (1, 2, 3, 6, 1_000, 10**9):
        nominal = min(60.0, 2.0 ** (failures - 1)) if failures < 100 else 60.0
        delays = [retry_delay(failures, 60.0, rng) for _ in range(200)]
        assert all(nominal / 2 <= d <= nominal for d in delays)
        assert max(delays) - min(delays) > nominal / 4  # jittered, not one value
    assert retry_delay(10**9, 1e300, rng) <= 2.0**40


class StoreAway:
    """A mirror whose store is away: every request fails at once, and its time is kept."""

    url = "s3://away/run"

    def __init__(self) -> None:
        self.tries: list[float] = []

    def _refuse(self, *args, **kwargs):
        self.tries.append(time.monotonic())
        raise MirrorUnavailable("the store at http://127.0.0.1:9 refused the connection")

    put_file = get_file = read_range = put_bytes = get_bytes = list = delete = _refuse


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_thousands_of_failures_cost_little_cpu_few_lines_and_never_kill_the_thread(tmp_path, store):
    away, reports, lines = StoreAway(), Reports(), Lines()
    logging.getLogger("hpcckpt.store").addHandler(lines)
    retry_max = 0.002
    worker = MirrorWorker(away, MirrorOptions(away.url, mirror_retry_max=retry_max), reports)
    stop = threading.Event()

    def waiter() -> None:  # what finish() and a stop do, over and over
        while not stop.is_set():
            worker.wait(0.01)

    waiting = threading.Thread(target=waiter)
    path = store.save(1, {"u": np.arange(10.0)}).path
    try:
        cpu0, t0 = time.process_time(), time.monotonic()
        worker.committed(1, path)
        waiting.start()
        time.sleep(3.0)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
        # A loaded machine starves the thread (nice 19): give it up to a minute more to
        # reach the tries a quiet one makes in a fraction of a second.
        deadline = time.monotonic() + 60
        while len(away.tries) < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = worker._thread is not None and worker._thread.is_alive()
    finally:
        stop.set()
        waiting.join()
        worker.close()
        logging.getLogger("hpcckpt.store").removeHandler(lines)
    tries = len(away.tries)
    assert alive
    # retried all along: about 1,400 in the 3 s on a quiet machine, 368, 138 and 25 in
    # loaded CI runs; a thread that died or stalled makes a handful, ever
    assert tries >= 40, tries
    assert worker.failures == tries
    # the pace follows the backoff: never back to back
    gaps = sorted(b - a for a, b in zip(away.tries, away.tries[1:], strict=False))
    assert gaps[0] >= 0.9 * retry_max / 2
    assert gaps[len(gaps) // 2] >= 0.9 * 0.75 * retry_max
    # one report and one log line per doubling of the count, not one per try
    failed = reports.of(MIRROR_FAILED)
    bound = math.log2(tries) + 2
    assert len(failed) <= bound and len(lines.records) <= bound
    assert failed[-1]["count"] <= tries and failed[-1]["count"] > tries / 2
    assert "refused" in lines.records[-1].getMessage()
    assert f"failed {failed[-1]['count']} times since" in lines.records[-1].getMessage()
    assert cpu < 0.6 * wall, (cpu, wall)  # a spinning thread takes a whole core


def test_a_wait_during_a_backoff_ends_at_its_timeout_without_a_try(tmp_path, store):
    away, reports = StoreAway(), Reports()
    worker = MirrorWorker(away, MirrorOptions(away.url, mirror_retry_max=60), reports)
    try:
        worker.committed(1, save(store, 1).path)
        wait_for(lambda: reports.of(MIRROR_FAILED), COPIED, "a failed try")
        assert reports.of(MIRROR_FAILED)[0]["retry_in"] >= 0.5  # the first backoff
        for _ in range(3):
            t0 = time.monotonic()
            assert not worker.wait(0.1)
            assert time.monotonic() - t0 >= 0.1
        assert len(away.tries) == 1  # no try hurried by the waits
        assert worker._thread is not None and worker._thread.is_alive()
    finally:
        worker.close()


def test_an_error_of_the_workers_own_is_reported_and_the_thread_goes_on(tmp_path, store):
    (tmp_path / "m").mkdir()
    seen: list[tuple[str, dict]] = []

    def report(kind: str, fields: dict) -> None:
        seen.append((kind, fields))
        if kind == MIRRORED and len(seen) == 1:
            raise RuntimeError("the event log is full")

    options = MirrorOptions(str(tmp_path / "m"), mirror_retry_max=0.05)
    worker = MirrorWorker(DirectoryBackend(tmp_path / "m"), options, report)
    try:
        worker.committed(1, save(store, 1).path)
        assert worker.wait(COPIED)
        assert worker._thread is not None and worker._thread.is_alive()
    finally:
        worker.close()
    kinds = [k for k, _ in seen]
    assert kinds[:2] == [MIRRORED, MIRROR_FAILED] and kinds[-1] == MIRRORED
    assert "the event log is full" in seen[1][1]["reason"]


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
            wait_for(lambda: reports.of(MIRROR_FAILED), COPIED, "a failed copy")
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
        assert worker.wait(COPIED)
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
    assert {o.key for o in backend.list()} == {INDEX} | {
        name + suffix for s in (1, 4, 6) for name in [layout.checkpoint_name(s)]
        for suffix in ("", ".manifest.json")
    }  # fmt: skip
    assert [m.step for m in mirror_index.load(backend).listing()] == [6, 4, 1]


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
        assert worker.committed(2, save(store, 2).path, force=True) and worker.wait(COPIED)
    finally:
        worker.close()
    assert mirror.newest_good(DirectoryBackend(tmp_path / "m")).step == 2


@pytest.mark.parametrize("share_group", [False, True])
def test_the_mirrors_files_have_the_directorys_modes(tmp_path, share_group):
    (tmp_path / "m").mkdir()
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, share_group=share_group)
    worker = MirrorWorker(DirectoryBackend(tmp_path / "m"), MirrorOptions(str(tmp_path / "m")))
    try:
        worker.committed(1, save(store, 1).path)
        assert worker.wait(COPIED)
    finally:
        worker.close()
    want = {p.stat().st_mode & 0o777 for p in store.directory.glob("ckpt-*.h5")}
    assert want == {0o640 if share_group else 0o600}
    got = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m").iterdir()}
    name = layout.checkpoint_name(1)
    assert set(got) == {name, name + ".manifest.json", INDEX}
    assert set(got.values()) == want  # the index too


def test_the_backoff_doubles_across_failures_of_changing_causes(tmp_path, store):
    class Flapping(StoreAway):
        def _refuse(self, *args, **kwargs):
            self.tries.append(time.monotonic())
            cause = ("refused the connection", "did not answer in time")[len(self.tries) % 2]
            raise MirrorUnavailable(f"the store {cause}")

        put_file = get_file = read_range = put_bytes = get_bytes = list = delete = _refuse

    away, reports = Flapping(), Reports()
    worker = MirrorWorker(away, MirrorOptions(away.url, mirror_retry_max=3), reports)
    try:
        worker.committed(1, save(store, 1).path)
        wait_for(lambda: len(reports.of(MIRROR_FAILED)) >= 3, COPIED, "three failed attempts")
    finally:
        worker.close()
    failed = reports.of(MIRROR_FAILED)[:3]
    assert [f["count"] for f in failed] == [1, 1, 1]  # each a new cause: each reported
    for f, nominal in zip(failed, (1.0, 2.0, 3.0), strict=True):
        assert nominal / 2 <= f["retry_in"] <= nominal


# -- the copy steps aside while a checkpoint is written --------------------------------------
class SlowKernelCopy(DirectoryBackend):
    """The real directory backend whose kernel copy goes 256 KiB per call with a pause
    after each, so that a copy of a few MB is still under way when the test acts."""

    PIECE = 256 << 10

    def copy_range(self, src: int, dst: int, offset: int, count: int) -> int:
        time.sleep(0.02)
        return super().copy_range(src, dst, offset, min(count, self.PIECE))


def _part_bytes(root) -> int:
    """The bytes of the copy under way in a directory mirror (its ``.part`` file)."""
    return sum(p.stat().st_size for p in root.glob("*.part"))


@pytest.mark.parametrize("how", ["metered stream", "kernel copy"])
def test_a_held_gate_pauses_the_copy_which_finishes_bit_exact_once_released(tmp_path, store, how):
    """A copy under way (a capped stream, or the kernel's copy with its check) makes no
    progress while a save holds the gate, is not failed by the pause, and ends bit-exact
    once released; the ``mirrored`` event says how long it was paused, its rate left out."""
    root = tmp_path / "m"
    root.mkdir()
    if how == "metered stream":
        backend, piece = open_backend(str(root), bandwidth=4e6), STREAM_CHUNK
        assert backend.read_chunk == piece
    else:
        backend, piece = SlowKernelCopy(root), SlowKernelCopy.PIECE
        assert backend.kernel_copy
    reports = Reports()
    worker = MirrorWorker(backend, MirrorOptions(str(root)), reports)
    big = np.random.default_rng(7).random(2_000_000)  # 16 MB: about 4 s at either pace
    path = store.save(1, {"u": big}).path
    try:
        worker.committed(1, path, force=True)
        wait_for(lambda: _part_bytes(root) > 1 << 20, COPIED, "the copy under way")
        with worker.steps_aside():
            assert worker.gate.held
            at_hold = _part_bytes(root)
            time.sleep(2.5)  # unpaused: about 10 MB more
            grew = _part_bytes(root) - at_hold
            # the one piece already past the gate when it closed may land (late, under load)
            assert grew <= piece, f"the copy went on while the gate was held: {grew} bytes"
            assert worker.busy() and not reports.of(MIRRORED) and not reports.of(MIRROR_FAILED)
            assert at_hold + grew < path.stat().st_size
        assert not worker.gate.held
        assert worker.wait(COPIED)
    finally:
        worker.close()
    (event,) = reports.of(MIRRORED)
    assert not reports.of(MIRROR_FAILED) and event["attempts"] == 1
    assert 1.0 <= event["paused"] <= event["seconds"]  # most of the 2.5 s held
    assert event["rate"] == pytest.approx(event["bytes"] / (event["seconds"] - event["paused"]))
    assert (root / path.name).read_bytes() == path.read_bytes()
    assert mirror.verify_mirrored(backend, path.name).good


def test_holds_nest_and_a_pause_ends_with_the_last_one_or_at_close():
    """Two saves at once (a synchronous one beside a background write): the copy waits
    until both released; a worker closing opens the gate for good."""
    worker = MirrorWorker(DirectoryBackend("/nonexistent"), MirrorOptions("/nonexistent"))
    gate = worker.gate
    gate.wait_open()  # open: returns at once
    passed = threading.Event()

    def copy() -> None:
        gate.wait_open()
        passed.set()

    first, second = worker.steps_aside(), worker.steps_aside()
    thread = threading.Thread(target=copy)
    thread.start()
    first.release()
    first.release()  # a second release of one hold is nothing
    assert not passed.wait(0.3) and gate.held
    with second:
        pass
    assert passed.wait(5) and not gate.held and gate.paused >= 0.3
    thread.join()
    done = threading.Event()
    with worker.steps_aside() as aside:
        aside.until(done.is_set)  # a background write: held until it ends
    assert gate.held
    before = set(threading.enumerate())
    waiter = threading.Thread(target=gate.wait_open)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # the copy waits for the write
    assert set(threading.enumerate()) - before == {waiter}  # no thread watches the write
    done.set()
    waiter.join(5)
    assert not waiter.is_alive() and not gate.held
    with worker.steps_aside():
        worker.close()
        gate.wait_open()  # returns: closed, the gate holds nothing any more


def test_a_paused_s3_upload_completes_afterwards(s3_mirror, tmp_path, store):
    """The real S3 server: a multipart upload under way waits between its parts while a
    save holds the gate (no part sent meanwhile, the upload left open), then completes;
    the object is the checkpoint's bytes."""
    import boto3

    from hpcckpt.store.mirror.backend import Throttle
    from hpcckpt.store.mirror.s3 import S3Backend

    backend = S3Backend(s3_mirror.url, Throttle(5e6), part_size=5 << 20, concurrency=1)
    reports = Reports()
    worker = MirrorWorker(backend, MirrorOptions(s3_mirror.url), reports)
    big = np.random.default_rng(8).random(3_000_000)  # 24 MB: 5 parts, about 5 s
    path = store.save(1, {"u": big}).path
    client = boto3.client("s3")

    def uploads() -> list:
        try:
            return client.list_multipart_uploads(Bucket=s3_mirror.bucket).get("Uploads", [])
        except client.exceptions.NoSuchUpload:  # rclone's answer when none is open
            return []

    def parts() -> int:
        # the checkpoint's upload (the backend's probe of the store's checksums makes and
        # ends one of its own, which may end between the listing and its parts)
        mine = [u for u in uploads() if u["Key"].endswith(path.name)]
        if not mine:
            return 0
        up = mine[0]
        try:
            got = client.list_parts(Bucket=s3_mirror.bucket, Key=up["Key"], UploadId=up["UploadId"])
        except client.exceptions.NoSuchUpload:  # completed meanwhile
            return 0
        return len(got.get("Parts", []))

    try:
        worker.committed(1, path, force=True)
        wait_for(lambda: parts() >= 1, COPIED, "the multipart upload under way")
        with worker.steps_aside():
            time.sleep(2.0)  # the part in flight lands
            before = parts()
            time.sleep(3.0)
            assert parts() == before < 5, "a part was sent while the gate was held"
            assert not reports.of(MIRRORED) and not reports.of(MIRROR_FAILED)
            # the copy reaches the gate once its part in flight is sent and the next part
            # is read through the throttle (a second per part; 3.1 s into the hold in one
            # loaded CI run): it waits there for the rest of the hold
            waited = worker.gate.paused
        assert worker.wait(COPIED)
    finally:
        worker.close()
    (event,) = reports.of(MIRRORED)
    assert waited >= 1.0, f"the copy waited {waited:.2f} s of the 5 s hold"
    assert not reports.of(MIRROR_FAILED) and event["paused"] >= waited
    assert (s3_mirror.prefix_path / path.name).read_bytes() == path.read_bytes()
    assert uploads() == []
    assert mirror.verify_mirrored(backend, path.name).good
