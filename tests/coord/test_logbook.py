"""What the Checkpointer writes down (coord/logbook.py): each line and event, from a result."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from hpcckpt.coord import logbook
from hpcckpt.store.results import RestoreResult, SaveResult
from hpcckpt.store.store import MirrorWait

MIB = 1 << 20


def result(**changes) -> SaveResult:
    base = {
        "step": 7,
        "path": Path("/ck/ckpt-0000000007.h5"),
        "bytes_written": 10 * MIB,
        "seconds": 0.5,
    }
    return SaveResult(**{**base, **changes})


def line(res: SaveResult, reason="interval", **kw) -> str:
    given = {
        "stop": None,
        "interval": 300.0,
        "every_steps": None,
        "cost_estimate": 0.5,
        "redundancy": None,
        "incremental": True,
    }
    return logbook.committed(res, reason, **{**given, **kw}).line


def test_a_full_synchronous_save():
    assert line(result()) == (
        "checkpoint step 7: full, 10.0 MiB in 0.50 s (21 MB/s), interval; next in 5 min"
    )


def test_the_tail_says_what_comes_next():
    assert line(result(), every_steps=10, interval=None).endswith("; next in 10 steps")
    assert line(result(), "signal", stop="signal").endswith(", signal; stopping")
    assert logbook.upcoming(None, 90.0, None) == "next in 1.5 min"


def test_a_zero_second_save_has_an_infinite_rate():
    assert "(inf MB/s)" in line(result(seconds=0.0))


def test_the_kind_says_why_a_full_save_is_not_a_delta_only_with_deltas_on():
    full = result(full_reason="max_chain=8 reached")
    assert "step 7: full (max_chain=8 reached), " in line(full)
    assert "step 7: full, " in line(full, incremental=False)
    delta = result(kind="incremental", dirty_blocks=1, total_blocks=8)
    assert "step 7: incremental (12.5 % of blocks), " in line(delta)


def test_how_it_was_written():
    background = line(result(blocked_seconds=0.123))
    assert "(21 MB/s) in the background (blocked 0.12 s), interval" in background
    local = result(tier="cache", blocked_seconds=0.1)
    assert "(21 MB/s) on the node-local tier, " in line(local)
    assert " on the node-local tier with xor redundancy, " in line(local, redundancy="xor")
    kernel = result(write_path="direct", change_detection="kernel", pages_written=1,
                    bytes_hashed=MIB // 2)  # fmt: skip
    assert "(kernel: 1 page written, 0.5 MiB hashed)" in line(kernel)
    pages = result(write_path="direct", change_detection="kernel", pages_written=3)
    assert "(kernel: 3 pages written, 0.0 MiB hashed)" in line(pages)
    hashes = result(write_path="buffered", bytes_hashed=32 * MIB)
    assert "(hashes, 32.0 MiB hashed)" in line(hashes)


def test_the_event_fields():
    record = logbook.committed(
        result(kind="incremental", dirty_blocks=1, total_blocks=3, peak_rss=5),
        "steps",
        stop=None,
        interval=None,
        every_steps=2,
        cost_estimate=1.23456789,
        redundancy=None,
        incremental=True,
    )
    assert record.fields == {
        "step": 7,
        "seconds": 0.5,
        "bytes": 10 * MIB,
        "save_kind": "incremental",
        "full_reason": None,
        "dirty": 0.333333,
        "reason": "steps",
        "path": "ckpt-0000000007.h5",
        "next_interval": None,
        "cost_estimate": 1.234568,
        "peak_rss": 5,
    }
    assert record.warning is None


def test_the_optional_fields_and_the_audit_warning():
    res = result(
        blocked_seconds=0.25,
        staging="pieces",
        staging_bytes=64,
        write_path="direct",
        change_detection="kernel",
        pages_written=2,
        bytes_hashed=4096,
        tracking_audit="block 3 changed unseen",
        tier="cache",
    )
    record = logbook.committed(
        res, "interval", stop=None, interval=1.0, every_steps=None, cost_estimate=0.0,
        redundancy=None, incremental=True,
    )  # fmt: skip
    extra = {k: record.fields[k] for k in list(record.fields)[11:]}
    assert extra == {
        "blocked_seconds": 0.25,
        "staging_mode": "pieces",
        "staging_bytes": 64,
        "write_path": "direct",
        "change_detection": "kernel",
        "pages_written": 2,
        "bytes_hashed": 4096,
        "tracking_audit": "block 3 changed unseen",
        "tier": "cache",
    }
    assert record.warning == (
        "write tracking is off for the rest of this run: block 3 changed unseen"
    )


def test_the_writer_s_decision():
    decision = {
        "path": "direct",
        "size_group_bytes": 256 * MIB,
        "direct_mb_s": 1500.4,
        "buffered_mb_s": 900.6,
    }
    assert logbook.writer_line(decision) == (
        "writer: direct writes for 256 MiB per rank (direct 1500 MB/s, buffered 901 MB/s)"
    )


def test_a_staged_save():
    pending = SimpleNamespace(
        step=4, bytes_total=MIB, written=SimpleNamespace(kind="full"), staging="copy"
    )
    text, fields = logbook.staged(pending, 0.0123, None)
    assert text == "checkpoint step 4 staged in memory in 0.012 s; writing in the background"
    assert fields == {
        "step": 4,
        "blocked_seconds": 0.0123,
        "bytes": MIB,
        "save_kind": "full",
        "staging": "memory",
        "staging_mode": "copy",
    }
    text, fields = logbook.staged(pending, 1.0, Path("/dev/shm/x"))
    assert " staged in /dev/shm/x in 1.000 s;" in text and fields["staging"] == "cache"


def test_a_restore():
    directory = Path("/ck")
    text, events = logbook.restored(None, [(9, "n2", "f.h5", "bad")], None, directory)
    assert text == "no checkpoint in /ck: starting from the beginning"
    assert events == [
        ("local_set_aside", {"step": 9, "node": "n2", "file": "f.h5", "reason": "bad"}),
        ("restore", {"step": None}),
    ]
    res = RestoreResult(
        step=5, path=Path("/ck/ckpt-5.h5"), skipped=[(6, "torn")], source="cache",
        rebuilt=(1, 3), rebuilt_from="xor", moved=(2,), local_skipped=((8, "gone"),),
    )  # fmt: skip
    text, events = logbook.restored(res, [], "xor", directory)
    assert text == "restored step 5 from node-local copy ckpt-5.h5 (rank 1, 3 rebuilt from xor)"
    assert events == [
        ("skip_bad", {"step": 6, "reason": "torn"}),
        ("local_skipped", {"step": 8, "reason": "gone"}),
        (
            "restore",
            {"step": 5, "path": "ckpt-5.h5", "tier": "cache", "rebuilt": [1, 3],
             "rebuilt_from": "xor", "moved": [2]},
        ),
    ]  # fmt: skip
    plain = RestoreResult(step=5, path=Path("/ck/ckpt-5.h5"), skipped=[])
    text, events = logbook.restored(plain, [], None, directory)
    assert text == "restored step 5 from ckpt-5.h5"
    assert events == [("restore", {"step": 5, "path": "ckpt-5.h5", "tier": "directory"})]


def test_why_the_run_stops():
    assert logbook.stop_reason("signal", "USR1") == "signal USR1"
    assert logbook.stop_reason("signal", None) == "signal"
    assert logbook.stop_reason("deadline", "USR1") == "deadline"


def test_the_wait_for_the_mirror():
    arrived = MirrorWait(step=59, done=True, seconds=1.26, newest_mirrored=59, error=None)
    text, fields = logbook.mirror_waited(arrived, "finish")
    assert text == "mirror: step 59 is on the mirror (finish, waited 1.3 s)"
    assert fields == {
        "step": 59,
        "done": True,
        "seconds": 1.26,
        "reason": "finish",
        "newest_mirrored": 59,
        "error": None,
    }
    late = MirrorWait(step=59, done=False, seconds=300.2, newest_mirrored=None, error="full")
    text, fields = logbook.mirror_waited(late, "stop")
    assert text == (
        "mirror: step 59 did not reach the mirror within 300 s (stop); the mirror holds "
        "nothing yet from this run; last failure: full; the checkpoint directory keeps it"
    )
    assert (fields["done"], fields["newest_mirrored"], fields["error"]) == (False, None, "full")
    behind = MirrorWait(step=59, done=False, seconds=2.0, newest_mirrored=49, error=None)
    text, _ = logbook.mirror_waited(behind, "stop")
    assert "the mirror holds step 49 from this run; the checkpoint directory" in text


def test_a_wait_cut_for_the_jobs_end_says_so_in_the_users_numbers():
    cut = logbook.MirrorCut(wait=300.0, bound=33.0, job_end=1_800_000_045.0, left=45.0)
    late = MirrorWait(step=59, done=False, seconds=33.0, newest_mirrored=None, error="refused")
    text, fields = logbook.mirror_waited(late, "stop", "/scratch/run", cut)
    assert text == (
        "mirror: step 59 did not reach the mirror within 33 s (stop; mirror_wait 300 s cut for "
        "the time limit: the job ends in 45 s and the wrapper needs 12 s after the ranks to "
        "take the step down and requeue the job); the mirror holds nothing yet from this run; "
        "last failure: refused; the checkpoint directory keeps it (/scratch/run) and the next "
        "run copies it"
    )
    assert (fields["cut_to"], fields["job_end"], fields["done"]) == (33.0, 1_800_000_045.0, False)
    text, _ = logbook.mirror_waited(late, "finish", "/scratch/run", cut)
    assert "the ranks to end the job);" in text
    assert text.endswith(
        "keeps it (/scratch/run) and a run started on it with this mirror copies it"
    )
    arrived = MirrorWait(step=59, done=True, seconds=0.8, newest_mirrored=59, error=None)
    text, fields = logbook.mirror_waited(arrived, "stop", "/scratch/run", cut)
    assert text == "mirror: step 59 is on the mirror (stop, waited 0.8 s)"
    assert fields["cut_to"] == 33.0
