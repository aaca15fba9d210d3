"""Taking the step down (hpcckpt/job/step.py): all of it, no orphans."""

from __future__ import annotations

import subprocess
import sys
import time

from hpcckpt import procfs
from hpcckpt.job import step


def test_kill_step_leaves_no_orphans(tmp_path):
    """A launcher that ignores TERM and has a child that ignores TERM: both gone."""
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "time.sleep(600)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script])
    time.sleep(1.0)
    below = procfs.descendants(child.pid)
    assert len(below) == 1
    taken = step.take_down(child, grace=1.0)
    assert taken["killed_launcher"] and taken["leftovers_killed"] == sorted(below)
    assert not procfs.alive(below)
