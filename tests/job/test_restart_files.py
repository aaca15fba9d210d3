"""Restart files of applications without the API (hpcckpt/job/restart_files.py)."""

from __future__ import annotations

import json
import time

from hpcckpt.job.restart_files import RestartFiles


def test_restart_files_complete_register_and_restore(tmp_path):
    live = tmp_path / "run"
    live.mkdir()
    rf = RestartFiles(["run/r.*"], tmp_path / "ck", settle=0.2, cwd=tmp_path)
    pending = rf.begin(stop=False)
    assert not rf.poll(pending)  # nothing yet
    (live / "r.0").write_bytes(b"zero" * 100)
    (live / "r.1").write_bytes(b"one" * 100)
    deadline = time.monotonic() + 5
    while not rf.poll(pending):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first = rf.register(attempt="a", seconds=rf.cost(pending))
    manifest = json.loads((first.path / "manifest.json").read_text())
    assert [f["size"] for f in manifest["files"]] == [400, 300]
    assert rf.ensure_good() == (1, [])
    # a second set, then the application dies while rewriting r.1
    (live / "r.1").write_bytes(b"ONE" * 100)
    rf.register(attempt="b", seconds=1.0)
    (live / "r.1").write_bytes(b"ON")
    number, problems = rf.ensure_good()
    assert number == 2 and "has 2 bytes, not 300" in problems[0]
    assert (live / "r.1").read_bytes() == b"ONE" * 100
    # a third set prunes the first (keep 2); a damaged stored copy falls back to the older
    rf.register(attempt="c", seconds=1.0)
    assert [n for n, _, _ in rf.sets()] == [2, 3]
    (rf.sets_dir / "3" / "0001-r.1").write_bytes(b"x")
    (live / "r.0").unlink()
    number, problems = rf.ensure_good()
    assert number == 2 and "set 3 is damaged" in problems[0]
    assert (live / "r.0").read_bytes() == b"zero" * 100


def test_restart_files_not_rewritten_are_not_complete(tmp_path):
    (tmp_path / "r.0").write_text("old")
    (tmp_path / "r.1").write_text("old")
    time.sleep(0.1)
    rf = RestartFiles(["r.*"], tmp_path / "ck", settle=0.1, cwd=tmp_path)
    pending = rf.begin(stop=True)
    (tmp_path / "r.0").write_text("new")
    for _ in range(10):
        assert not rf.poll(pending)
        time.sleep(0.05)
