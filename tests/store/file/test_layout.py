"""Names in a checkpoint directory (hpcckpt/store/file/layout.py): a ``.bad`` mark belongs to
the file it judged, and a new file of that step is not bad because the old one was."""

from __future__ import annotations

import json
import os

from hpcckpt.store.file import layout


def committed(directory, step: int, data: bytes = b"checkpoint bytes"):
    """A file of ``step`` put in place as a commit does (a new file renamed over the name)."""
    path = directory / layout.checkpoint_name(step)
    tmp = path.with_name(path.name + layout.PARTIAL)
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def test_a_mark_records_the_file_it_judged(tmp_path):
    path = committed(tmp_path, 2)
    layout.mark_bad(path, "rank 0's state tree fails its checksum")
    record = json.loads(path.with_name(path.name + layout.BAD).read_text())
    st = os.stat(path)
    assert record["file"] == {"inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    assert layout.read_bad(path) == "rank 0's state tree fails its checksum"
    assert layout.scan(tmp_path)[0].bad_reason == "rank 0's state tree fails its checksum"


def test_a_mark_does_not_hold_for_a_new_file_of_that_step(tmp_path):
    old = committed(tmp_path, 2)
    layout.mark_bad(old, "fails its checksum")
    committed(tmp_path, 2, b"another checkpoint of step 2")  # the mark is left behind
    assert layout.read_bad(old) is None
    [entry] = layout.scan(tmp_path)
    assert entry.good_candidate and entry.bad_reason is None


def test_a_mark_does_not_hold_once_its_file_changed_in_place(tmp_path):
    path = committed(tmp_path, 2)
    layout.mark_bad(path, "fails its checksum")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # written again since
    assert layout.read_bad(path) is None


def test_a_mark_without_a_record_of_its_file_holds_until_the_file_is_newer(tmp_path):
    """Marks of an older hpcckpt say when they were written, not which file they
    judged: one holds while its file is older than the mark."""
    path = committed(tmp_path, 2)
    mtime = os.stat(path).st_mtime
    sidecar = path.with_name(path.name + layout.BAD)
    sidecar.write_text(json.dumps({"reason": "an old verdict", "time": mtime + 5}) + "\n")
    assert layout.read_bad(path) == "an old verdict"
    os.utime(path, (mtime + 10, mtime + 10))  # a file written after the verdict
    assert layout.read_bad(path) is None
    assert layout.scan(tmp_path)[0].good_candidate


def test_a_mark_made_by_hand_holds(tmp_path):
    """An empty or free-form ``.bad`` file (``touch ckpt-...h5.bad``) keeps a checkpoint
    out of restores until a new file of its step is committed."""
    path = committed(tmp_path, 2)
    sidecar = path.with_name(path.name + layout.BAD)
    for text in ("", "do not use: diverged\n", "[1, 2]"):
        sidecar.write_text(text)
        assert layout.read_bad(path) == "marked bad"
        assert not layout.scan(tmp_path)[0].good_candidate


def test_clearing_the_marks_of_a_new_file_says_what_the_mark_said(tmp_path):
    path = committed(tmp_path, 2)
    layout.mark_bad(path, "fails its checksum")
    path.with_name(path.name + layout.READING).write_text("4242\n")
    committed(tmp_path, 2, b"the new file")
    assert layout.clear_marks(path) == "fails its checksum"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert layout.clear_marks(path) is None  # nothing left to clear
