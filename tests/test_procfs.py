"""What /proc says about processes (hpcckpt/procfs.py), against real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from hpcckpt import procfs


def test_a_process_tree_is_seen_and_its_end_too():
    script = "import subprocess, sys, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 10
        while not procfs.descendants(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        below = procfs.descendants(child.pid)
        assert len(below) == 1
        (grandchild,) = below
        assert procfs.cmdline(grandchild) == ["sleep", "30"]
        assert procfs.parent_of(grandchild) == child.pid
        assert procfs.pid_alive(child.pid) and procfs.alive(below) == below
        assert procfs.descends_from(grandchild, {os.getpid()}, procfs.parent_map())
        assert os.getpid() in procfs.self_and_ancestors()
    finally:
        child.kill()
        child.wait()
        for pid in below:
            os.kill(pid, 9)
    time.sleep(0.2)
    assert not procfs.pid_alive(child.pid)
    assert procfs.stat_fields(child.pid) is None and procfs.cmdline(child.pid) == []


def test_start_ticks_tell_a_reused_pid_and_our_own_start():
    me = procfs.start_ticks(os.getpid())
    assert me is not None and procfs.alive({os.getpid(): me + 1}) == {}
    assert "PATH" in procfs.environ(os.getpid())
    started = procfs.process_start_monotonic()
    assert started <= time.monotonic()


def test_environs_with_and_topmost():
    """A process whose environment has the key is found with it; of a shell and the
    process it started, only the shell is topmost."""
    key = f"HPCCKPT_PROCFS_TEST_{os.getpid()}"
    env = dict(os.environ, **{key: "1"})
    shell = subprocess.Popen(["sh", "-c", "sleep 30; true"], env=env)
    try:
        deadline = time.monotonic() + 10
        while len(procfs.environs_with(key)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = procfs.environs_with(key)
        assert shell.pid in found and found[shell.pid][key] == "1" and len(found) == 2
        assert procfs.topmost(set(found)) == [shell.pid]
    finally:
        for pid in procfs.descendants(shell.pid):
            os.kill(pid, 9)
        shell.kill()
        shell.wait()
