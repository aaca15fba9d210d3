"""How a step ended (hpcckpt/job/outcome.py): from the status file, and for applications
without the API."""

from __future__ import annotations

from hpcckpt.job import outcome
from hpcckpt.job.outcome import Outcome, classify_app
from hpcckpt.rundir.status import FINISHED, RUNNING, STOPPED, RunStatus


def test_classify_app_table():
    def out(rc, **kw):
        args = {"stop_sent": False, "watching_files": False, "set_after_stop": False}
        return classify_app(rc, **{**args, **kw}).outcome

    assert out(0) is Outcome.FINISHED
    assert out(1) is Outcome.CRASHED
    assert out(0, stop_sent=True) is Outcome.STOPPED
    assert out(2, stop_sent=True) is Outcome.CRASHED
    assert out(-15, stop_sent=True, watching_files=True, set_after_stop=True) is Outcome.STOPPED
    assert out(0, stop_sent=True, watching_files=True) is Outcome.CRASHED
    # killed by the stop's signal before any restart file was written: nothing new kept
    stopped = out(143, stop_sent=True, watching_files=True, killed_before_writing=True)
    assert stopped is Outcome.STOPPED
    # exited 0 after the stop without writing one (it finished as the stop came)
    assert out(0, stop_sent=True, watching_files=True, killed_before_writing=True) is (
        Outcome.STOPPED
    )


def test_classify():
    mine = "job.0.abc"

    def st(state, attempt=mine):
        return RunStatus(state=state, attempt=attempt, step=7)

    O = outcome.Outcome
    assert outcome.classify(0, st(FINISHED), mine).outcome is O.FINISHED
    assert outcome.classify(0, st(STOPPED), mine).outcome is O.STOPPED
    # the status file is authoritative once the application reported
    assert outcome.classify(-9, st(STOPPED), mine).outcome is O.STOPPED
    assert outcome.classify(1, st(FINISHED), mine).outcome is O.FINISHED
    # stale (another attempt's token), absent or still running: crashed
    for status in (st(FINISHED, "old"), None, st(RUNNING)):
        result = outcome.classify(0, status, mine)
        assert result.outcome is O.CRASHED
        assert "finish()" in result.reason
    assert outcome.classify(-11, None, mine).reason.startswith("killed by signal SIGSEGV")
    assert [outcome.crash_exit_code(rc) for rc in (3, -9, -15, 0)] == [3, 137, 143, 1]


def test_describe_returncode_names_the_launchers_take_down():
    assert outcome.describe_returncode(-9) == "killed by signal SIGKILL"
    assert "the launcher ending the step after one task failed" in (
        outcome.describe_returncode(143)
    )
    assert outcome.describe_returncode(138) == "exit status 138 (a task killed by SIGUSR1?)"
    assert outcome.describe_returncode(3) == "exit status 3"
