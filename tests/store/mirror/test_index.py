"""The mirror's index (hpcckpt/store/mirror/index.py): a copy and a prune cost the same
requests with 10 and with 1,000 checkpoints on the mirror (a real S3 server, and a
directory mirror's calls), and the index is rebuilt or repaired when it is missing,
unreadable or stale, so that two writers (a job and a command-line prune) lose no entry."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import xxhash
from mpi4py import MPI

from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror import index as mirror_index
from hpcckpt.store.mirror.backend import DirectoryBackend
from hpcckpt.store.mirror.index import INDEX
from hpcckpt.store.mirror.worker import prune_mirror
from hpcckpt.store.options import MirrorOptions
from hpcckpt.store.store import CheckpointStore

#: The fabricated checkpoints' steps are multiples of this; the copies measured fall in
#: the window of the newest, so that ``mirror_keep_every`` keeps every fabricated one.
SPACING = 10


class CountingDirectory(DirectoryBackend):
    """A directory mirror that counts the calls made to it, by method."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.calls: Counter[str] = Counter()

    def __getattribute__(self, name: str):
        attr = super().__getattribute__(name)
        if name.startswith("_") or name == "calls" or not callable(attr):
            return attr
        calls = super().__getattribute__("calls")

        def counted(*args, **kwargs):
            calls[name] += 1
            return attr(*args, **kwargs)

        return counted


def s3_requests(backend) -> Counter[str]:
    """The S3 requests ``backend``'s client sends from now on, by operation (boto3's
    event system: one ``before-send`` per HTTP request, retries included)."""
    seen: Counter[str] = Counter()

    def count(event_name: str, **_kwargs) -> None:
        seen[event_name.rsplit(".", 1)[-1]] += 1

    backend.client.meta.events.register("before-send.s3.*", count)
    return seen


def fabricate(root: Path, steps: list[int]) -> None:
    """Checkpoints ``steps`` on a mirror, as their objects on disk (a directory mirror,
    or the folder an S3 server serves): small data and a manifest that matches it."""
    root.mkdir(parents=True, exist_ok=True)
    for step in steps:
        name = layout.checkpoint_name(step)
        data = step.to_bytes(8, "little") * 64
        (root / name).write_bytes(data)
        manifest = {
            "version": mirror.MANIFEST_VERSION, "step": step, "file": name,
            "size": len(data), "checksum": xxhash.xxh3_64_hexdigest(data),
            "algorithm": mirror.ALGORITHM, "uid": f"uid-{step}", "chain": [],
            "time": 1e9 + step, "mirrored_at": 1e9 + step,
        }  # fmt: skip
        (root / mirror.manifest_key(name)).write_text(json.dumps(manifest) + "\n")


def state(k: int, n: int = 200_000) -> dict:
    u = np.random.default_rng(5).random(n)
    u[: 1000 * k] += k
    return {"u": u}


def one_copy(backend, path: Path, options: MirrorOptions) -> list[str]:
    """What the mirror worker does for one checkpoint: the copy, then the retention."""
    copied = mirror_index.upload(backend, path)
    assert copied.uploaded.files == (path.name,)
    return prune_mirror(backend, options, time.time(), index=copied.index)


def copy_costs(backend, root: Path, tmp_path: Path, count, n: int) -> Counter[str]:
    """The requests of the copy of one checkpoint (and its retention, which deletes one)
    onto a mirror holding ``n`` checkpoints, once its index was built."""
    fabricate(root, [SPACING * (i + 1) for i in range(n)])
    newest = SPACING * n
    # once, from every manifest (through the folder itself: the test S3 server, rclone
    # over a folder without a listing cache, reads the folder at each request)
    assert mirror_index.load(DirectoryBackend(root)).source == "rebuilt"
    assert mirror_index.load(backend).source == "read"
    store = CheckpointStore(tmp_path / f"ck{n}", MPI.COMM_SELF, incremental=False)
    options = MirrorOptions(str(root), mirror_keep_last=1, mirror_keep_every=SPACING)
    first = store.save(newest + 1, state(1)).path
    second = store.save(newest + 2, state(2)).path
    assert one_copy(backend, first, options) == []  # the newest: kept
    seen = count()
    assert one_copy(backend, second, options) == [first.name]  # the one deleted
    measured = Counter(seen)
    listing = mirror_index.load(backend).listing()
    assert [m.step for m in listing[:2]] == [newest + 2, newest] and len(listing) == n + 1
    truth = mirror.list_mirrored(DirectoryBackend(root))  # every manifest, read from disk
    assert {m.name for m in listing} == {m.name for m in truth}
    return measured


@pytest.mark.parametrize("n", [10, 1000])
def test_the_index_is_built_from_every_manifest_once(tmp_path, n):
    backend = CountingDirectory(tmp_path / "m")
    fabricate(tmp_path / "m", list(range(1, n + 1)))
    assert mirror_index.load(backend).source == "rebuilt"
    assert backend.calls["get_bytes"] == 1 + n  # the index (absent), then each manifest
    backend.calls.clear()
    again = mirror_index.load(backend)
    assert again.source == "read" and len(again.entries) == n
    assert dict(backend.calls) == {"get_bytes": 1, "list_after": 1}


def test_a_copy_to_s3_costs_the_same_requests_with_10_and_1000_checkpoints_there(
    s3_server, s3_mirror, tmp_path
):
    from hpcckpt.store.mirror.s3 import S3Backend
    from tests.conftest import S3Mirror

    costs = {}
    for n in (10, 1000):
        where = S3Mirror(s3_server, f"{s3_mirror.bucket}-{n}")
        backend = S3Backend(where.url)
        costs[n] = copy_costs(
            backend, where.prefix_path, tmp_path, lambda b=backend: s3_requests(b), n
        )
    print("S3 requests per copy:", {n: dict(c) for n, c in costs.items()})
    assert costs[10] == costs[1000]
    assert costs[10]["ListObjectsV2"] <= 3  # the cheap check and the copy's own names
    assert costs[10]["GetObject"] < 10 and sum(costs[10].values()) < 30


def test_a_copy_to_a_directory_makes_the_same_calls_with_10_and_1000_checkpoints_there(
    tmp_path,
):
    costs = {}
    for n in (10, 1000):
        backend = CountingDirectory(tmp_path / f"m{n}")

        def count(b=backend) -> Counter[str]:
            b.calls.clear()
            return b.calls

        costs[n] = copy_costs(backend, tmp_path / f"m{n}", tmp_path, count, n)
    print("directory mirror calls per copy:", {n: dict(c) for n, c in costs.items()})
    assert costs[10] == costs[1000]
    assert "list" not in costs[10]  # never the whole mirror
    assert costs[10]["get_bytes"] < 10


def entries(backend) -> set[str]:
    return {m.name for m in mirror_index.load(backend).listing()}


def test_a_missing_or_unreadable_index_is_rebuilt(tmp_path):
    backend = DirectoryBackend(tmp_path / "m")
    fabricate(tmp_path / "m", [1, 2, 3])
    assert mirror_index.load(backend).source == "rebuilt"
    assert (tmp_path / "m" / INDEX).exists()
    (tmp_path / "m" / INDEX).write_bytes(b'{"format": "hpcckpt mirror index", "vers')
    again = mirror_index.load(backend)
    assert again.source == "rebuilt" and set(again.entries) == {
        layout.checkpoint_name(s) for s in (1, 2, 3)
    }
    (tmp_path / "m" / INDEX).unlink()
    assert mirror_index.load(backend).source == "rebuilt"
    assert mirror_index.load(backend).source == "read"


def test_a_manifest_newer_than_the_index_is_added(tmp_path):
    backend = DirectoryBackend(tmp_path / "m")
    fabricate(tmp_path / "m", [1, 2])
    mirror_index.load(backend)
    fabricate(tmp_path / "m", [3, 4])  # copies whose index write never happened
    index = mirror_index.load(backend)
    assert index.source == "repaired" and [m.step for m in index.listing()] == [4, 3, 2, 1]
    assert mirror_index.load(backend).source == "read"  # and it was written


def test_a_newest_checkpoint_gone_sends_the_index_to_the_listing(tmp_path):
    backend = DirectoryBackend(tmp_path / "m")
    fabricate(tmp_path / "m", [1, 2, 3])
    mirror_index.load(backend)
    mirror.delete_mirrored(backend, layout.checkpoint_name(3))  # by hand, index untouched
    index = mirror_index.load(backend)
    assert index.source == "repaired" and [m.step for m in index.listing()] == [2, 1]


def test_a_mark_reaches_the_index_and_the_retention_keeps_the_newest_good(tmp_path):
    backend = DirectoryBackend(tmp_path / "m")
    fabricate(tmp_path / "m", [1, 2, 3])
    mirror_index.load(backend)
    mirror.mark_bad(backend, layout.checkpoint_name(3), "a test found it damaged")
    status = {m.step: m.status for m in mirror_index.load(backend).listing()}
    assert status == {3: "bad", 2: "good", 1: "good"}
    options = MirrorOptions(str(tmp_path / "m"), mirror_keep_last=1)
    assert prune_mirror(backend, options, time.time()) == [layout.checkpoint_name(1)]
    assert {m.step: m.status for m in mirror.list_mirrored(backend)} == {3: "bad", 2: "good"}


def test_a_job_and_a_command_line_prune_lose_no_entry(tmp_path):
    """The worst interleaving of two writers without a conditional write: each writes
    an index read before the other's write landed. The manifests decide."""
    root = tmp_path / "m"
    backend = DirectoryBackend(root)
    fabricate(root, [10, 20, 30, 40])
    before = mirror_index.load(backend)  # what the prune read
    stale = mirror_index.Index(dict(before.entries))
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, incremental=False)
    job = mirror_index.upload(backend, store.save(41, state(1)).path)  # the job's copy
    assert layout.checkpoint_name(41) in job.index.entries
    # the prune deletes step 20 and writes the index it read, less 20, over the job's
    mirror.delete_mirrored(backend, layout.checkpoint_name(20))
    stale.entries.pop(layout.checkpoint_name(20))
    backend.put_bytes(INDEX, stale.to_bytes())
    assert entries(backend) == {layout.checkpoint_name(s) for s in (10, 30, 40, 41)}
    # the other way round: the job's index, read before the prune, lands last
    job_view = mirror_index.load(backend)
    mirror.delete_mirrored(backend, layout.checkpoint_name(30))
    mirror_index.commit(backend, job_view, remove=[layout.checkpoint_name(30)])
    backend.put_bytes(INDEX, job_view.to_bytes())  # names 30, which is gone
    truth = {m.name for m in mirror.list_mirrored(backend)}
    assert truth == {layout.checkpoint_name(s) for s in (10, 40, 41)}
    # what a copy, a verify or a pull acts on is confirmed from its own objects
    assert mirror_index.confirm(backend, [layout.checkpoint_name(30)]) == {}
    # and the listing of 'mirror ls' and a command-line prune is the truth again
    assert {m.name for m in mirror_index.reconcile(backend).listing()} == truth
    assert entries(backend) == truth


def test_confirm_reads_the_chain_of_a_delta_from_its_own_objects(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    backend = DirectoryBackend(root)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, max_chain=4)
    for s in (1, 2, 3):
        mirror_index.upload(backend, store.save(s, state(s, 1_000_000)).path)
    got = mirror_index.confirm(backend, [layout.checkpoint_name(3)])
    assert sorted(m.step for m in got.values()) == [1, 2, 3]
    assert all(m.good for m in got.values())
    mirror.mark_bad(backend, layout.checkpoint_name(1), "damaged")
    got = mirror_index.confirm(backend, [layout.checkpoint_name(3)])
    assert got[layout.checkpoint_name(3)].status == "broken chain"
    assert mirror_index.load(backend).listing()[0].status == "broken chain"


def test_mirror_prune_deletes_what_the_rules_do_not_keep_and_the_index_follows(tmp_path):
    from click.testing import CliRunner

    from hpcckpt.cli.main import cli

    root = tmp_path / "m"
    fabricate(root, [10, 20, 30, 40, 50])
    backend = DirectoryBackend(root)
    mirror_index.load(backend)

    def prune(*extra: str):
        args = ["mirror", "prune", str(root), "--keep-last", "2", *extra]
        return CliRunner().invoke(cli, args, catch_exceptions=False)

    dry = prune("--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    doomed = [layout.checkpoint_name(s) for s in (30, 20, 10)]  # newest first
    assert json.loads(dry.output)["deleted"] == doomed
    assert len(mirror.list_mirrored(backend)) == 5  # nothing deleted
    done = prune()
    assert done.exit_code == 0 and "deleted 3 checkpoint(s)" in done.output
    assert [m.step for m in mirror.list_mirrored(backend)] == [50, 40]
    assert [m.step for m in mirror_index.load(backend).listing()] == [50, 40]
    no_rule = CliRunner().invoke(cli, ["mirror", "prune", str(root)])
    assert no_rule.exit_code == 2 and "--keep-last" in no_rule.output


#: The command-line side: 'hpcckpt mirror prune' run again and again in a process of its
#: own (its click command called in a loop: 40 interpreter start-ups would cost 20 s of
#: CPU, and their first prunes would come after the job's copies were done), at least
#: ``PRUNES`` times and until the file ``argv[2]`` exists; a line on stdout per prune.
PRUNER = """
import contextlib, io, sys
from pathlib import Path
from hpcckpt.cli.main import cli
root, done, least = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
count = 0
while count < least or not done.exists():
    with contextlib.redirect_stdout(io.StringIO()):
        cli(["mirror", "prune", root, "--keep-last", "3"], prog_name="hpcckpt",
            standalone_mode=False)
    count += 1
    print(count, flush=True)
"""
PRUNES = 40


def test_a_job_copying_beside_command_line_prunes_loses_no_entry(tmp_path, monkeypatch):
    """Two processes write the index at once: the job's mirror worker copying one
    checkpoint after another, and 'hpcckpt mirror prune' run again and again, from
    before the first copy until after the last."""
    import os
    import subprocess
    import sys

    from hpcckpt.store.mirror import priority
    from hpcckpt.store.mirror.worker import MirrorWorker

    # The copying thread at the test's own priority: at nice 19 it got 0.35 s of CPU in
    # 92 s beside five busy processes, and the suite's load made this test last 7 min.
    # What is checked here is the index's two writers (the priority has its own test).
    monkeypatch.setattr(priority, "NICE", os.getpriority(os.PRIO_PROCESS, 0))
    root = tmp_path / "m"
    root.mkdir()
    backend = DirectoryBackend(root)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, incremental=False)
    done = tmp_path / "copies-done"
    pruner = subprocess.Popen(
        [sys.executable, "-c", PRUNER, str(root), str(done), str(PRUNES)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert pruner.stdout is not None
    worker = MirrorWorker(backend, MirrorOptions(str(root)))
    try:
        assert pruner.stdout.readline().strip() == "1"  # pruning before the first copy
        for step in range(1, 25):
            worker.submit(step, store.save(step, state(step)).path)
            assert worker.wait(180)
            assert pruner.poll() is None, "the pruner ended before the job's copies did"
    finally:
        done.touch()
        worker.close()
        prunes = ["1", *pruner.stdout.read().split()]
        assert pruner.wait(300) == 0
    assert int(prunes[-1]) >= PRUNES
    truth = {m.name for m in mirror.list_mirrored(backend)}
    assert layout.checkpoint_name(24) in truth
    index = mirror_index.load(backend)
    assert truth <= set(index.entries)  # every checkpoint there is in the index
    assert set(mirror_index.reconcile(backend).entries) == truth
