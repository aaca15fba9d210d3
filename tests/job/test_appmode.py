"""The mode for applications without the Python API (hpcckpt/job/appmode.py), end to end."""

from __future__ import annotations

import signal
import sys

import pytest

from hpcckpt.job.restart_files import RestartFiles
from hpcckpt.rundir.events import read_events
from tests.job.test_wrapper import Wrapped, app, clean_env

WRITER = r"""
import os, signal, sys, time
d = sys.argv[1]; steps = int(sys.argv[2])
got = []
signal.signal(signal.SIGUSR2, lambda *a: got.append(1))
step = int(open(f"{d}/state").read()) if os.path.exists(f"{d}/state") else 0
print("HPCCKPT_RESTART=" + os.environ.get("HPCCKPT_RESTART", "?"), flush=True)
while step < steps:
    time.sleep(0.02); step += 1
    if got:
        got.clear()
        open(f"{d}/state.tmp", "w").write(str(step)); os.replace(f"{d}/state.tmp", f"{d}/state")
open(f"{d}/done", "w").write(str(step))
"""


def test_app_signal_without_restart_files_never_claims_a_checkpoint_it_cannot_see(tmp_path):
    ckpt, work = tmp_path / "ck", tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, "-c", WRITER, str(work), "400"]
    w = Wrapped(ckpt, cmd, "--app-signal", "USR2", "--app-ready", "0.5")
    w.wait_line("started step")
    w.send(signal.SIGUSR1)
    assert w.wait() == 0, w.stderr
    line = w.wait_line("after the application was asked to checkpoint")
    assert "cannot be seen" in line and "--restart-files" in line
    assert "after checkpoint" not in w.stderr


def test_app_signal_stop_then_resume_then_finish(tmp_path):
    ckpt, work = tmp_path / "ck", tmp_path / "work"
    work.mkdir()
    # It checkpoints on USR2 and runs on: the wrapper ends it once the files are complete
    # and the step has not exited within its grace (appmode.STOP_EXIT_GRACE).
    cmd = [sys.executable, "-c", WRITER, str(work), "1500"]
    opts = ["--app-signal", "USR2", "--app-ready", "0.5", "--restart-files", str(work / "state"),
            "--settle", "0.3"]  # fmt: skip
    w = Wrapped(ckpt, cmd, *opts)
    w.wait_line("started step")
    w.send(signal.SIGUSR1)  # held for --app-ready, then forwarded as USR2
    assert w.wait() == 0, w.stderr
    w.wait_line("restart files complete")
    w.wait_line("the step did not exit 10 s after its restart files")
    w.wait_line("stopped after checkpoint; run again to resume")
    saved = int((work / "state").read_text())
    assert 0 < saved < 1500 and not (work / "done").exists()
    evs = list(read_events(ckpt))
    assert [e["outcome"] for e in evs if e["event"] == "step_end"] == ["stopped"]
    sets = [e for e in evs if e["event"] == "restart_set"]
    assert len(sets) == 1 and sets[0]["stop"] and sets[0]["seconds"] is not None
    w2 = Wrapped(ckpt, cmd, *opts)
    assert w2.wait() == 0, w2.stderr
    w2.wait_line("application finished")
    assert (work / "done").read_text() == "1500"


SLOW_WRITER = r"""
import os, signal, sys, time
d = sys.argv[1]
got = []
signal.signal(signal.SIGUSR2, lambda *a: got.append(1))
while not got:
    time.sleep(0.02)
with open(f"{d}/state", "wb") as f:  # in place, in pieces: a kill between them cuts it
    for i in range(12):
        f.write(bytes([i + 1]) * 1000); f.flush(); os.fsync(f.fileno())
        if i < 11:
            time.sleep(1.0)
sys.exit(1)  # as many codes do after a checkpointed stop
"""


def test_a_stop_write_pausing_longer_than_settle_is_not_cut_by_the_exit_grace(tmp_path):
    """The application's pauses between pieces (1 s) exceed --settle (0.4 s) and its
    write (11 s) the exit grace after the files first look complete (10 s): each new
    piece withdraws the completion, so the step is never ended mid-write and the set kept
    is the whole file."""
    ckpt, work = tmp_path / "ck", tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, "-c", SLOW_WRITER, str(work)]
    opts = ["--app-signal", "USR2", "--app-ready", "1", "--restart-files", str(work / "state"),
            "--settle", "0.4"]  # fmt: skip
    w = Wrapped(ckpt, cmd, *opts)
    w.wait_line("started step")
    w.send(signal.SIGUSR1)
    assert w.wait() == 0, w.stderr
    assert "the restart files changed again" in w.stderr and "still being written" in w.stderr
    assert "did not exit" not in w.stderr, w.stderr
    assert (work / "state").read_bytes() == b"".join(bytes([i + 1]) * 1000 for i in range(12))
    evs = list(read_events(ckpt))
    (kept,) = [e for e in evs if e["event"] == "restart_set"]
    assert kept["stop"] and kept["bytes"] == 12000, w.stderr
    assert kept["seconds"] >= 10.0
    assert [e["outcome"] for e in evs if e["event"] == "step_end"] == ["stopped"]


def test_app_signal_periodic_checkpoints(tmp_path):
    ckpt, work = tmp_path / "ck", tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, "-c", WRITER, str(work), "150"]
    w = Wrapped(ckpt, cmd, "--app-signal", "USR2", "--app-ready", "0", "--restart-files",
                str(work / "state"), "--settle", "0.2", "--ckpt-every", "1")  # fmt: skip
    assert w.wait() == 0, w.stderr
    evs = list(read_events(ckpt))
    assert len([e for e in evs if e["event"] == "checkpoint_request"]) >= 1
    assert any(e["event"] == "restart_set" and not e["stop"] for e in evs), w.stderr
    assert evs[-1]["event"] == "finished"


def test_app_options_need_app_signal(tmp_path):
    w = Wrapped(tmp_path / "ck", app("finish"), "--restart-files", "x.*", "--ckpt-every", "60")
    assert w.wait() == 2
    assert "add --app-signal" in w.stderr


@pytest.mark.parametrize(
    ("app", "said"),
    [
        # no handler for USR2 yet (a rank still starting): its default action kills it
        ("import time; time.sleep(60)", "before writing any restart file (a rank with no"),
        # done computing as the stop comes: it ignores the signal and exits 0
        (
            "import signal, time; signal.signal(signal.SIGUSR2, signal.SIG_IGN); time.sleep(1.5)",
            "exited 0 after the stop signal without writing a restart file",
        ),
    ],
    ids=["killed-before-its-handler", "exited-0-finishing"],
)
def test_a_stop_after_which_the_app_wrote_nothing_is_a_stop_that_kept_nothing(tmp_path, app, said):
    """The stop request reached the application, which ended without a restart file
    since: killed before its handler, or finished as the stop came (exit 0). Not a crash
    given up at once (a fresh-clone run's chain link was, for the second) but a stop that
    kept nothing new: the newest kept set stands, the next run goes on from it, and
    job/stalled.py gives up on a streak of them."""
    ckpt, work = tmp_path / "ck", tmp_path / "work"
    work.mkdir()
    (work / "state").write_text("7")  # an earlier run's restart file
    opts = ["--app-signal", "USR2", "--app-ready", "0.5", "--restart-files", str(work / "state"),
            "--settle", "0.3"]  # fmt: skip
    w = Wrapped(ckpt, [sys.executable, "-c", app], *opts)
    w.wait_line("started step")
    w.send(signal.SIGUSR1)
    w.wait()
    w.wait_line(said)
    w.wait_line("nothing new was kept")
    assert "may be cut" not in w.stderr and "step crashed" not in w.stderr, w.stderr
    assert "giving up" not in w.stderr, w.stderr
    evs = list(read_events(ckpt))
    assert [e["outcome"] for e in evs if e["event"] == "step_end"] == ["stopped"]
    assert (work / "state").read_text() == "7"


def test_a_restart_with_no_set_ever_kept_starts_afresh(tmp_path):
    """HPCCKPT_RESTART=1 tells the application to resume from its restart files; after
    runs that kept none (stopped or crashed before their first write) it gets 0."""
    ckpt, work = tmp_path / "ck", tmp_path / "work"
    work.mkdir()
    told = work / "told"
    code = f"import os; open({str(told)!r}, 'w').write(os.environ['HPCCKPT_RESTART'])"
    tell = [sys.executable, "-c", code]
    opts = ["--app-signal", "USR2", "--restart-files", str(work / "state")]

    def run(chain: str) -> str:
        w = Wrapped(ckpt, tell, *opts, env=clean_env(HPCCKPT_CHAIN_COUNT=chain))
        assert w.wait() == 0, w.stderr
        return told.read_text()

    assert run("0") == "0" and run("1") == "0"
    (work / "state").write_text("7")
    RestartFiles([str(work / "state")], ckpt).register(attempt="earlier", seconds=None)
    assert run("2") == "1"  # a kept set: a restart resumes
