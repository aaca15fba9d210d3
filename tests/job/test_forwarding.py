"""What becomes of each stop signal: ``hpcckpt.job.forwarding`` against a stand-in wrapper.

The step is a real child (``sleep``), so a forwarded signal really arrives; the
application's status is what the stand-in says. The wrapper's end-to-end behaviour is in
``test_wrapper.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpcckpt.job import forwarding
from hpcckpt.job.config import WrapperConfig
from hpcckpt.job.forwarding import Forwarding, forward_signal
from hpcckpt.job.stop import StopRequest
from hpcckpt.rundir import events
from hpcckpt.rundir.status import FINISHED, RUNNING, STOPPED, RunStatus
from hpcckpt.slurm.env import SlurmEnv


class StandIn:
    """The part of the wrapper forwarding sees (``ForwardingContext``), outside Slurm."""

    def __init__(self, tmp_path: Path, **config: Any) -> None:
        self.config = WrapperConfig(["sleep", "60"], tmp_path, **config)
        self.environ: dict[str, str] = {}
        self.slurm_env = SlurmEnv.from_environ({})
        self.t0 = time.monotonic()
        self.stop = StopRequest()
        self.app = SimpleNamespace()
        self.own = None
        self.continuing = SimpleNamespace(term_heard=False)
        self.command = list(self.config.command)
        self.child: subprocess.Popen[bytes] | None = None
        self.child_started: float | None = None
        self.status: RunStatus | None = None
        self.lines: list[str] = []
        self.events: list[dict[str, Any]] = []

    def start(self) -> None:
        self.child = subprocess.Popen(self.command)
        self.child_started = time.monotonic()

    def log(self, message: str, level: int = 0) -> None:
        self.lines.append(message)

    def event(self, kind: str, **fields: Any) -> bool:
        self.events.append({"event": kind, **fields})
        return True

    def elapsed(self, t: float | None = None) -> float:
        return (time.monotonic() if t is None else t) - self.t0

    def own_status(self) -> RunStatus | None:
        return self.status


@pytest.fixture
def wrapper(tmp_path):
    w = StandIn(tmp_path)
    yield w
    if w.child is not None and w.child.poll() is None:
        w.child.kill()
        w.child.wait()


def ended_by(w: StandIn) -> int | None:
    assert w.child is not None
    try:
        return w.child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return None


def test_a_request_before_running_is_held_then_forwarded_once(wrapper):
    w, fwd = wrapper, Forwarding(wrapper)
    w.start()
    fwd.handle(signal.SIGUSR1, time.monotonic())
    assert w.stop.held and not w.stop.forwarded
    assert "held: the application has not reported running yet" in w.lines[-1]
    assert w.events[-1]["event"] == events.SIGNAL and w.events[-1]["held"] is True
    fwd.check_held()  # no status yet: still held
    assert w.stop.held and w.child.poll() is None
    w.status = RunStatus(RUNNING, step=4)
    fwd.check_held()
    assert w.stop.forwarded and not w.stop.held
    assert ended_by(w) == -signal.SIGUSR1
    assert "application reported running (step 4)" in w.lines[-1]
    assert "USR1 held for" in w.lines[-1]
    assert w.events[-1]["event"] == events.SIGNAL_FORWARDED
    assert w.events[-1]["as_signal"] == "USR1"


def test_a_request_while_running_goes_at_once_and_a_second_is_a_duplicate(wrapper):
    w, fwd = wrapper, Forwarding(wrapper)
    w.start()
    w.status = RunStatus(RUNNING)
    fwd.handle(signal.SIGUSR2, None)
    assert w.stop.forwarded and w.stop.name == "USR2"
    assert "during start-up (not the configured --signal USR1)" in w.lines[-1]
    assert "forwarded as USR1" in w.lines[-1]
    assert ended_by(w) == -signal.SIGUSR1
    fwd.handle(signal.SIGUSR1, time.monotonic())
    assert "already under way; not forwarding it again" in w.lines[-1]
    assert w.events[-1]["duplicate"] is True and w.events[-1]["forwarded"] is False


@pytest.mark.parametrize("state", [STOPPED, FINISHED])
def test_no_request_reaches_an_application_that_already_stopped(wrapper, state):
    w, fwd = wrapper, Forwarding(wrapper)
    w.start()
    w.status = RunStatus(state)
    fwd.handle(signal.SIGUSR1, time.monotonic())
    assert f"the application already reported {state}; not forwarding" in w.lines[-1]
    assert w.events[-1]["app_state"] == state
    assert w.child.poll() is None


def test_a_held_request_is_dropped_when_the_application_ends_first(wrapper):
    w, fwd = wrapper, Forwarding(wrapper)
    w.start()
    fwd.handle(signal.SIGUSR1, time.monotonic())
    w.status = RunStatus(FINISHED)
    fwd.check_held()
    assert not w.stop.held and not w.stop.forwarded
    assert "reported finished before the held USR1 could be forwarded" in w.lines[-1]


def test_a_request_before_the_step_starts_is_held_until_it_runs(wrapper):
    w, fwd = wrapper, Forwarding(wrapper)
    fwd.handle(signal.SIGTERM, None)
    assert w.stop.held and "held until the step is running" in w.lines[-1]
    assert w.continuing.term_heard  # scancel? asked before the job continues


@pytest.mark.parametrize("interrupts, sig", [(3, signal.SIGTERM), (4, signal.SIGKILL)])
def test_the_third_interrupt_takes_the_step_down(tmp_path, interrupts, sig):
    w = StandIn(tmp_path)
    fwd = Forwarding(w)
    w.start()
    w.stop.interrupts = interrupts - 1
    try:
        fwd.handle(signal.SIGINT, time.monotonic())
        assert ended_by(w) == -sig
    finally:
        if w.child.poll() is None:
            w.child.kill()
    assert f"interrupt #{interrupts}: sending {sig.name[3:]} to the step" in w.lines[-1]
    assert w.events[-1]["killed"] is True and not w.stop.requested


def test_app_mode_waits_for_app_ready_and_sends_the_app_signal(tmp_path):
    w = StandIn(tmp_path, app_signal=signal.SIGUSR2, app_ready=0.2)
    sent: list[str] = []

    def stop(what: str, send: Any) -> None:
        sent.append(what)
        send()

    w.app = SimpleNamespace(stop=stop)
    fwd = Forwarding(w)
    assert fwd.forward_signal == forward_signal(w.config) == signal.SIGUSR2
    w.start()
    try:
        fwd.handle(signal.SIGUSR1, time.monotonic())
        assert w.stop.held and "(--app-ready)" in w.lines[-1]
        time.sleep(0.3)
        fwd.check_held()
        assert sent == ["the application has run 0.2 s"] and w.stop.forwarded
        assert ended_by(w) == -signal.SIGUSR2
    finally:
        if w.child.poll() is None:
            w.child.kill()


#: A rank process as mpirun starts one (OMPI_COMM_WORLD_RANK in its environment) that
#: spends DELAY seconds starting (MPI_Init, reading its restart files) before it installs
#: its TERM handler, or never does (DELAY < 0); the handler writes "caught" and exits 0.
RANK = """
import os, signal, sys, time
out, delay = sys.argv[1], float(sys.argv[2])
if delay >= 0:
    time.sleep(delay)
    def caught(signum, frame):
        open(os.path.join(out, "caught"), "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, caught)
    open(os.path.join(out, "handler"), "w").close()
time.sleep(60)
"""
#: mpirun's part: start one rank, wait for it, exit with its status.
LAUNCHER = """
import os, subprocess, sys
env = dict(os.environ, OMPI_COMM_WORLD_RANK="0")
sys.exit(subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], env=env).returncode)
"""


def mpirun_stand_in(tmp_path: Path, delay: float) -> StandIn:
    """An app-mode wrapper (TERM, no --app-ready wait) over an mpirun step of one rank."""
    w = StandIn(tmp_path, app_signal=signal.SIGTERM, app_ready=0.0)
    w.app = SimpleNamespace(stop=lambda what, send: send())
    w.child = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, str(tmp_path), str(delay)])
    w.child_started = time.monotonic()
    w.command = ["mpirun", "-n", "1", "app"]
    return w


def forward_when_ready(w: StandIn, fwd: Forwarding, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while w.stop.held and time.monotonic() < deadline:
        fwd.check_held()
        time.sleep(0.02)


def test_an_mpirun_rank_still_starting_gets_the_signal_once_it_has_its_handler(tmp_path):
    """TERM to a rank before it installed its handler would kill it, its restart files
    never written: the stop is held past --app-ready until every rank here catches it."""
    w = mpirun_stand_in(tmp_path, delay=1.5)
    fwd = Forwarding(w)
    try:
        fwd.handle(signal.SIGUSR1, time.monotonic())
        assert w.stop.held and "(--app-ready) and its ranks here take it" in w.lines[-1]
        forward_when_ready(w, fwd)
        assert w.stop.forwarded and (tmp_path / "handler").exists()
        assert w.child.wait(timeout=10) == 0 and (tmp_path / "caught").exists()
        assert "forwarded as TERM to the rank processes directly" in w.lines[-1]
    finally:
        if w.child.poll() is None:
            w.child.kill()


def test_a_rank_that_never_takes_the_signal_gets_it_after_the_handler_wait(tmp_path, monkeypatch):
    assert forwarding.HANDLER_WAIT == 30.0  # docs/wrapper.md: "for at most 30 s more"
    monkeypatch.setattr(forwarding, "HANDLER_WAIT", 1.0)
    w = mpirun_stand_in(tmp_path, delay=-1)
    fwd = Forwarding(w)
    try:
        t = time.monotonic()
        fwd.handle(signal.SIGUSR1, t)
        assert w.stop.held
        forward_when_ready(w, fwd)
        assert w.stop.forwarded and time.monotonic() - t >= 1.0
        assert any("have no handler for TERM" in line for line in w.lines), w.lines
        assert w.child.wait(timeout=10) != 0 and not (tmp_path / "caught").exists()
    finally:
        if w.child.poll() is None:
            w.child.kill()
