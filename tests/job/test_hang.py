"""Hang detection: the pure decision, progress files, and a real hung mpirun."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hpcckpt.job import hang
from hpcckpt.rundir.events import checkpoint_costs, read_events
from hpcckpt.rundir.heartbeat import Heartbeat
from tests.job.test_wrapper import Wrapped, clean_env
from tests.mpi_helpers import mpi_env, mpirun_cmd

GUARD_APP = Path(__file__).resolve().parent / "apps" / "guard_app.py"
T0 = 1_000_000.0


def decide(beats, now, **kw):
    kw.setdefault("started", T0)
    kw.setdefault("timeout", 10.0)
    kw.setdefault("save_timeout", 60.0)
    return hang.decide({b.rank: b for b in beats}, now=now, **kw)


def test_fresh_heartbeats_are_not_a_hang():
    beats = [Heartbeat(0, 5, T0 + 20), Heartbeat(1, 5, T0 + 25)]
    assert not decide(beats, T0 + 29, nranks=2).hung


def test_one_silent_rank_is_named_with_its_step_and_age():
    beats = [Heartbeat(0, 40, T0 + 50), Heartbeat(1, 12, T0 + 20)]
    v = decide(beats, T0 + 52, nranks=2)
    assert v.hung and [s.rank for s in v.silent] == [1]
    s = v.silent[0]
    assert s.step == 12 and s.seconds == pytest.approx(32) and s.limit == 10
    assert "rank 1 silent for 32 s" in v.message() and "step 12" in v.message()
    fields = v.event_fields()
    assert fields["ranks"] == [1] and fields["last_steps"] == [12]
    assert fields["seconds_silent"] == [32.0]


@pytest.mark.parametrize("phase", ["save", "restore"])
def test_a_rank_in_a_save_gets_the_longer_allowance(phase):
    beats = [Heartbeat(0, 9, T0 + 10, phase), Heartbeat(1, 9, T0 + 10, phase)]
    assert not decide(beats, T0 + 65, nranks=2).hung
    v = decide(beats, T0 + 75, nranks=2)
    assert v.hung and {s.limit for s in v.silent} == {60.0}


def test_a_rank_that_never_wrote_is_silent_after_the_io_allowance_from_the_start():
    """Start-up (imports, the launch, MPI's start) gets the save allowance, not the
    compute timeout: a rank slow to start on a loaded node is not a hang."""
    beats = [Heartbeat(0, 3, T0 + 55)]
    assert not decide(beats, T0 + 12, nranks=3).hung, "past the timeout, starting up"
    assert not decide(beats, T0 + 59.5, nranks=3).hung
    v = decide(beats, T0 + 62, nranks=3)
    assert [s.rank for s in v.silent] == [1, 2]
    assert all(s.phase is None and s.since == T0 and s.limit == 60.0 for s in v.silent)
    assert "no heartbeat since the step started" in v.message()


def test_no_heartbeat_at_all_with_unknown_rank_count():
    assert not decide([], T0 + 59).hung
    v = decide([], T0 + 61)
    assert v.hung and v.silent[0].rank == 0 and v.heard == 0


def test_ranks_in_different_calls_are_named_with_their_places():
    # Rank 0 in save() at step 5, rank 1 in finish(): the message says where each is.
    beats = [Heartbeat(0, 5, T0 + 2, "save"), Heartbeat(1, 4, T0 + 1, "finish")]
    v = decide(beats, T0 + 80, nranks=3)
    assert v.hung
    assert v.message().endswith(
        "; where the ranks are: rank 0 in save (step 5), rank 1 in finish, rank 2 no heartbeat"
    ), v.message()
    assert v.event_fields()["places"] == {
        "0": "in save (step 5)",
        "1": "in finish",
        "2": "no heartbeat",
    }


def test_ranks_in_the_same_place_are_not_listed_again():
    beats = [Heartbeat(0, 12, T0 + 20), Heartbeat(1, 12, T0 + 20)]
    v = decide(beats, T0 + 40, nranks=2)
    assert v.hung and "where the ranks are" not in v.message()


def test_stale_heartbeats_of_an_earlier_attempt_count_as_missing():
    v = decide([Heartbeat(0, 100, T0 - 500)], T0 + 61, nranks=1)
    assert v.hung and v.silent[0].phase is None


def test_default_save_timeout_follows_the_measured_cost():
    assert hang.default_save_timeout(30) == 120
    assert hang.default_save_timeout(30, [2.0, 50.0]) == 180
    events = [{"event": "checkpoint", "seconds": 4.5}, {"event": "restart_set", "seconds": 7}]
    assert checkpoint_costs(events) == [4.5, 7.0]


def test_timeouts_are_checked():
    with pytest.raises(ValueError, match="heartbeat period"):
        hang.check_timeouts(5, None)
    with pytest.raises(ValueError, match="at least"):
        hang.check_timeouts(20, 10)


def test_progress_decision():
    assert not hang.decide_progress(T0 + 5, now=T0 + 14, started=T0, timeout=10, changed=True).hung
    v = hang.decide_progress(T0 + 5, now=T0 + 16, started=T0, timeout=10, changed=True)
    assert v.hung and v.silent[0].rank is None and "progress-file change" in v.message()
    v = hang.decide_progress(T0 - 99, now=T0 + 11, started=T0, timeout=10, changed=False)
    assert v.hung and v.silent[0].seconds == pytest.approx(11)


def test_progress_files_see_growth(tmp_path):
    log = tmp_path / "app.log"
    log.write_text("a\n")
    watch = hang.ProgressFiles([str(tmp_path / "*.log")])
    first = watch.poll(T0)
    assert not watch.changed
    with log.open("a") as f:
        f.write("b\n")
    assert watch.poll(T0 + 3) == T0 + 3 and watch.changed
    assert watch.poll(T0 + 6) == T0 + 3
    assert first != T0 + 3


def _leftovers(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and b"python" in cmd and state != "Z":
            pids.append(int(entry))
    return pids


@pytest.mark.mpi
@pytest.mark.slow
def test_wrapper_kills_a_hung_mpirun_after_the_timeout(tmp_path):
    """Rank 1 sleeps forever after the first checkpoint: killed after the timeout, no
    orphan, event written, and the crash path runs (outside Slurm: not continued)."""
    ckpt = tmp_path / "ckpt"
    tag = str(tmp_path / f"hang-test-{os.getpid()}-{time.monotonic_ns()}.npy")
    cmd = mpirun_cmd(2, [GUARD_APP, "--steps", "100", "--every", "5", "--sleep", "0.05",
                         "--hang-at", "12", "--out", tag])  # fmt: skip
    env = clean_env(**{k: v for k, v in mpi_env().items() if k.startswith("OMPI_")})
    w = Wrapped(ckpt, cmd, "--hang-timeout", "8", env=env)
    w.wait_line("hangs at step 12", timeout=60)
    hung_at = time.monotonic()
    rc = w.wait(timeout=60)
    took = time.monotonic() - hung_at
    assert rc != 0, w.stderr
    assert 8 <= took < 8 + 5 + 10, (took, w.stderr)
    line = w.wait_line("hang: ")
    assert "rank 1 silent for" in line and "limit 8 s" in line, line
    evs = list(read_events(ckpt))
    (hung,) = [e for e in evs if e["event"] == "hang"]
    assert 1 in hung["ranks"] and all(s >= 8 for s in hung["seconds_silent"])
    assert hung["last_steps"][hung["ranks"].index(1)] in (None, *range(13))
    assert [e["event"] for e in evs if e["event"] in ("hang_killed", "crashed")] == [
        "hang_killed",
        "crashed",
    ]
    crashed = next(e for e in evs if e["event"] == "crashed")
    assert crashed["reason"].startswith("hang: ")
    assert any(e["event"] == "checkpoint" for e in evs)
    time.sleep(0.5)
    assert _leftovers(tag) == [], "processes of the hung app survived"
