"""Calls made on only some ranks: named, never a silent hang.

Under real ``mpirun -n 2``: rank 0 in ``save()`` while rank 1 is in ``finish()`` or goes
on with ``due()``, and a rank stuck in the application while the other waits in
``finish()`` with ``HPCCKPT_CALL_TIMEOUT``. Each run must end (the test's timeout is
the guard) with a message naming both ranks and where they are.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpcckpt.coord import calls
from hpcckpt.rundir.heartbeat import Heartbeat, HeartbeatWriter, read_heartbeats
from hpcckpt.store.agreement import Call
from hpcckpt.store.errors import CallMismatch, CallTimeout
from tests.mpi_helpers import mpi_env, mpirun_cmd

APP = Path(__file__).parent / "apps" / "calls_app.py"
GUARD = 60.0  # seconds: the run hangs if it takes this long


def run_app(tmp: Path, mode: str, env: dict[str, str] | None = None) -> tuple[int, str, str, float]:
    """The app under ``mpirun -n 2``: exit status, stdout, stderr, seconds; fails on a hang."""
    proc = subprocess.Popen(
        mpirun_cmd(2, [APP, tmp / "ck", mode]),
        env=mpi_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the ranks too: killed together if it hangs
    )
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=GUARD)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{mode}: the run hung ({GUARD:.0f} s); stderr:\n{err[-3000:]}")
    return proc.returncode, out, err, time.monotonic() - t0


@pytest.mark.mpi
def test_save_on_one_rank_finish_on_the_other_is_named(tmp_path):
    rc, out, err, _ = run_app(tmp_path, "save_finish")
    assert rc != 0
    assert (
        "CallMismatch: ranks disagree on the collective call: rank 0 is in save(step=5), "
        "rank 1 is in finish(); every rank must call the Checkpointer's methods in the "
        "same order, with the same step"
    ) in err, err
    assert "no error" not in out


@pytest.mark.mpi
def test_save_on_one_rank_due_on_the_other_is_named(tmp_path):
    rc, out, err, _ = run_app(tmp_path, "save_due")
    assert rc != 0
    assert (
        "CallMismatch: ranks disagree on the collective call: rank 0 is in save(step=5), "
        "rank 1 is in due(step=5); every rank must call"
    ) in err, err
    assert "no error" not in out


@pytest.mark.mpi
def test_a_rank_stuck_in_the_application_is_named_after_the_call_timeout(tmp_path):
    rc, _, err, seconds = run_app(tmp_path, "stuck", env={"HPCCKPT_CALL_TIMEOUT": "3"})
    assert rc != 0 and seconds < 40, (seconds, err)
    assert "CallTimeout: rank 0 waited 3 s in finish() for rank 1: rank 1 is not in a " in err
    assert "Checkpointer call (computing, last heartbeat" in err, err


# -- the watch of a slow wait, in one process ------------------------------------------------
NOW = 1_000_000.0


def test_the_missing_ranks_are_named_from_their_heartbeats():
    beats = {
        0: Heartbeat(0, 12, NOW - 1, "due"),
        1: Heartbeat(1, 11, NOW - 64, "compute"),
        2: Heartbeat(2, 12, NOW - 2, "due"),
        3: Heartbeat(3, 5, NOW - 30, "save"),
    }
    text = calls.missing_text(
        "rank 0 waited 60 s in due(step=12)", Call("due", 12), beats, 0, 5, NOW
    )
    assert text == (
        "rank 0 waited 60 s in due(step=12) for ranks 1, 3, 4: rank 1 is not in a "
        "Checkpointer call (computing, step 11, last heartbeat 64 s ago); rank 3 is in save "
        "(step 5) (last heartbeat 30 s ago); rank 4 has written no heartbeat; " + calls.TAIL
    )


def test_without_a_missing_rank_the_heartbeats_are_shown():
    beats = {1: Heartbeat(1, None, NOW, "finish")}
    text = calls.missing_text("rank 0 waited 3 s in finish()", Call("finish"), beats, 0, 2, NOW)
    assert text.startswith(
        "rank 0 waited 3 s in finish() for the other ranks; their heartbeats: rank 1 in finish;"
    )


def test_a_slow_wait_writes_the_call_into_the_heartbeat_then_gives_up(tmp_path):
    writer = HeartbeatWriter(tmp_path, 0)
    watch = calls.Patience(writer, 2, timeout=3.0, last_step=lambda: 4)
    watch.waiting(Call("due", 5), 0.2)
    assert writer.flush(10) and read_heartbeats(tmp_path) == {}  # not slow yet
    watch.waiting(Call("due", 5), 0.6)
    assert writer.flush(10)  # the heartbeat's thread writes it
    assert (read_heartbeats(tmp_path)[0].phase, read_heartbeats(tmp_path)[0].step) == ("due", 5)
    with pytest.raises(
        CallTimeout,
        match=r"rank 0 waited 3 s in due\(step=5\) for rank 1: rank 1 has written no heartbeat",
    ):
        watch.waiting(Call("due", 5), 3.0)


def test_a_due_wait_that_ends_goes_back_to_compute(tmp_path):
    writer = HeartbeatWriter(tmp_path, 0)
    watch = calls.Patience(writer, 2, timeout=None, last_step=lambda: 4)
    watch.waiting(Call("due", 5), 1.0)
    watch.done(Call("due", 5))
    assert writer.flush(10)
    assert read_heartbeats(tmp_path)[0].phase == "compute"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_long_wait_warns_once_and_goes_on(tmp_path):
    writer = HeartbeatWriter(tmp_path, 1)
    watch = calls.Patience(writer, 2, timeout=None, last_step=lambda: 4)
    lines = Lines()  # on the logger itself: a Checkpointer made earlier stops propagation
    calls.log.addHandler(lines)
    try:
        watch.waiting(Call("finish"), calls.WARN_AFTER)
        watch.waiting(Call("finish"), calls.WARN_AFTER + 1)
    finally:
        calls.log.removeHandler(lines)
    warnings = lines.lines
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        "rank 1 waited 60 s in finish() for rank 0: rank 0 has written no heartbeat"
    )
    assert warnings[0].endswith(
        "still waiting (call_timeout=None, HPCCKPT_CALL_TIMEOUT gives up after a time)"
    )


def test_ranks_past_the_readers_say_less_and_give_up_later(tmp_path):
    writer = HeartbeatWriter(tmp_path, calls.READERS)
    watch = calls.Patience(writer, 64, timeout=3.0, last_step=lambda: None)
    watch.waiting(Call("finish"), 3.0)  # not yet: the readers speak first
    with pytest.raises(CallTimeout, match="for the other ranks \\(ranks 0-3 name them\\)"):
        watch.waiting(Call("finish"), 3.0 + calls.LATER)


class Agreeing:
    """In place of a CallAgreement in one process: ``complete`` raises the mismatch it
    was given, once; ``enter`` completes, then records the call."""

    def __init__(self, mismatch: CallMismatch | None = None) -> None:
        self.mismatch = mismatch
        self.entered: list[tuple[str, int | None]] = []

    def complete(self) -> list[int] | None:
        if self.mismatch is not None:
            mismatch, self.mismatch = self.mismatch, None
            raise mismatch
        return None

    def enter(self, name: str, step: int | None = None) -> None:
        self.complete()
        self.entered.append((name, step))


def test_calls_that_agree_go_on():
    agreement = Agreeing()
    sequence = calls.Calls(agreement)
    sequence.enter("save", 5)
    assert sequence.drain() is None and sequence.broken is None
    assert agreement.entered == [("save", 5)]


def test_once_the_ranks_fell_apart_every_later_call_says_so_at_once():
    agreement = Agreeing(CallMismatch("rank 0 is in save(step=5), rank 1 is in finish()"))
    sequence = calls.Calls(agreement)
    with pytest.raises(CallMismatch, match=r"^rank 0 is in save\(step=5\)"):
        sequence.enter("finish")
    earlier = r"^the ranks fell apart earlier: rank 0 is in save\(step=5\)"
    with pytest.raises(CallMismatch, match=earlier):
        sequence.drain()
    with pytest.raises(CallMismatch, match=earlier):
        sequence.enter("close")
    assert agreement.entered == [], "no call was agreed after the mismatch"
