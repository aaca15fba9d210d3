"""Crash budget, chain submission, restart files, outcome of apps without the API, lead time.

Slurm's commands are faked (HPCCKPT_SCONTROL, HPCCKPT_SBATCH, HPCCKPT_SQUEUE); the
wrapper runs as a real process (tests.job.test_wrapper.Wrapped).
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from hpcckpt.job import budget, chain, leadtime, slurm
from hpcckpt.job.events import append_event, read_events
from hpcckpt.job.outcome import Outcome, classify_app
from hpcckpt.job.periodic import PeriodicSchedule
from hpcckpt.job.restart_files import RestartFiles
from tests.job.test_wrapper import Wrapped, app, clean_env, fake, kinds, wait_state

# -- budget -------------------------------------------------------------------------------


def ev(kind, restart=0, **fields):
    return {"event": kind, "restart": restart, **fields}


def test_crash_restarts_count_since_the_last_fresh_submission():
    log = [
        ev("wrapper_start", 0),
        ev("requeue", 0, cause="crash"),
        ev("wrapper_start", 1),
        ev("requeue", 1, cause="stop"),
        ev("wrapper_start", 2),
        ev("chain", 2, cause="crash"),
    ]
    assert budget.crash_restarts_used(log) == 2
    assert budget.crash_restarts_used([*log, ev("wrapper_start", 0)]) == 0  # resubmitted


def test_decide_after_crash():
    log = [ev("wrapper_start", 0, attempt="a"), ev("checkpoint", 0, attempt="a", step=40)]
    d = budget.decide_after_crash(log, attempt="a", restart=0, runtime=5, min_progress=60)
    assert d.restart and "checkpoint at step 40" in d.message and "1 of 5" in d.message
    d = budget.decide_after_crash(log, attempt="b", restart=0, runtime=5, min_progress=60)
    assert not d.restart and "before writing any checkpoint" in d.message
    d = budget.decide_after_crash(log, attempt="b", restart=0, runtime=61, min_progress=60)
    assert d.restart and "ran 61 s" in d.message
    spent = [*log, *[ev("requeue", 0, cause="crash")] * 5]
    d = budget.decide_after_crash(spent, attempt="a", restart=5, runtime=999)
    assert not d.restart and "5 restart(s) after crashes already" in d.message
    # an unreadable log counts every earlier restart as a crash
    d = budget.decide_after_crash(None, attempt="a", restart=5, runtime=999)
    assert not d.restart


# -- outcome of apps without the API ------------------------------------------------------


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


# -- chain --------------------------------------------------------------------------------


SHOW = (
    "JobId=77 JobName=sim Restarts=0 TimeLimit=00:30:00 Partition=debug NumNodes=2 "
    "NumTasks=8 Command=/home/u/run.sbatch a b WorkDir=/home/u StdOut=/home/u/o.txt Power="
)


def test_parse_show_job_keeps_command_with_spaces():
    info = slurm.parse_show_job(SHOW)
    assert info["Command"] == "/home/u/run.sbatch a b"
    assert info["WorkDir"] == "/home/u" and info["NumTasks"] == "8"
    assert chain.carried_options(info) == [
        "--job-name=sim", "--time=00:30:00", "--nodes=2", "--ntasks=8", "--partition=debug",
        "--chdir=/home/u",
    ]  # fmt: skip


def test_chain_spec_from_the_environment(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n")
    env = {
        chain.CHAIN_SCRIPT_ENV: str(script),
        chain.CHAIN_ARGS_ENV: "'a b' c",
        chain.SBATCH_ARGS_ENV: "--qos=long --dependency=afterok:1 --time=5",
        "HPCCKPT_CHAIN_COUNT": "3",
        "SLURM_JOB_ID": "77",
        "SLURM_RESTART_COUNT": "1",
        "SLURM_CONF": "/etc/slurm.conf",
        "HPCCKPT_ATTEMPT": "x",
    }
    spec = chain.find_spec("77", env)
    assert spec.script_args == ["a b", "c"] and spec.sbatch_args == ["--qos=long", "--time=5"]
    argv = chain.submit_argv(spec, "77")
    assert argv[0] == "--dependency=afterany:77" and argv[-3:] == [str(script), "a b", "c"]
    nxt = chain.next_environment(env, ckpt_dir="/ck", next_count=4, sbatch_args=spec.sbatch_args)
    assert "SLURM_JOB_ID" not in nxt and "SLURM_RESTART_COUNT" not in nxt
    assert nxt["SLURM_CONF"] == "/etc/slurm.conf" and "HPCCKPT_ATTEMPT" not in nxt
    assert nxt["HPCCKPT_CHAIN_COUNT"] == "4" and nxt["HPCCKPT_DIR"] == "/ck"


def test_chain_without_script_or_scontrol_fails_clearly(tmp_path):
    env = {slurm.SCONTROL_ENV: str(tmp_path / "missing")}
    with pytest.raises(chain.ChainError, match="HPCCKPT_CHAIN_SCRIPT"):
        chain.find_spec("77", env)


def _chain_env(tmp_path: Path, sbatch_body: str) -> tuple[dict[str, str], Path]:
    calls = tmp_path / "sbatch-calls"
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n")
    sbatch = fake(
        tmp_path,
        "sbatch",
        f'printf "%s\\n" "$@" > {calls}; env | grep HPCCKPT_ | sort >> {calls}\n{sbatch_body}',
    )
    env = clean_env(
        SLURM_JOB_ID="500",
        HPCCKPT_SBATCH=sbatch,
        HPCCKPT_SCONTROL=str(tmp_path / "no-scontrol"),
        HPCCKPT_CHAIN_SCRIPT=str(script),
        HPCCKPT_CHAIN_ARGS="--x 'y z'",
        HPCCKPT_CHAIN_COUNT="1",
    )
    return env, calls


def test_stop_in_chain_mode_submits_the_next_job(tmp_path):
    env, calls = _chain_env(tmp_path, "echo 501")
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("stop"), "--chain", env=env)
    wait_state(ckpt, "running")
    w.send(signal.SIGUSR1)
    assert w.wait() == 0, w.stderr
    lines = calls.read_text().splitlines()
    assert lines[:5] == ["--parsable", "--dependency=afterany:500", "--export=ALL",
                         str(tmp_path / "job.sbatch"), "--x"]  # fmt: skip
    assert lines[5] == "y z"
    assert "HPCCKPT_CHAIN_COUNT=2" in lines and f"HPCCKPT_DIR={ckpt}" in lines
    w.wait_line("submitted job 501 (chain link 2)")
    evs = list(read_events(ckpt))
    assert [e["event"] for e in evs][-2:] == ["chain", "chain_submitted"]
    assert evs[-1]["next_job"] == "501" and evs[0]["chain_count"] == 1 and evs[0]["restart"] == 1


def test_chain_with_failing_sbatch(tmp_path):
    env, _ = _chain_env(tmp_path, "echo 'sbatch: error: QOSMaxSubmitJobPerUserLimit' >&2; exit 1")
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("stop"), "--chain", env=env)
    wait_state(ckpt, "running")
    w.send(signal.SIGUSR1)
    assert w.wait() == 3, w.stderr
    assert "QOSMaxSubmitJobPerUserLimit" in w.wait_line("chain failed")
    assert kinds(ckpt)[-1] == "chain_failed"


def test_chain_with_hanging_sbatch_times_out(tmp_path):
    env, _ = _chain_env(tmp_path, "sleep 60")
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("stop"), "--chain", "--requeue-timeout", "1", env=env)
    wait_state(ckpt, "running")
    w.send(signal.SIGUSR1)
    t0 = time.monotonic()
    assert w.wait() == 3, w.stderr
    assert time.monotonic() - t0 < 15
    assert "did not finish within 1 s" in w.wait_line("chain failed")


# -- crash handling with a fake scontrol ---------------------------------------------------


def _fake_slurm(tmp_path: Path, restart: int = 0) -> tuple[dict[str, str], Path]:
    calls = tmp_path / "scontrol-calls"
    scontrol = fake(tmp_path, "scontrol", f'echo "$@" >> {calls}')
    env = clean_env(SLURM_JOB_ID="600", SLURM_RESTART_COUNT=str(restart), HPCCKPT_SCONTROL=scontrol)
    return env, calls


def test_crash_without_progress_gives_up_at_once(tmp_path):
    env, calls = _fake_slurm(tmp_path)
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("crash"), env=env)
    assert w.wait() == 3, w.stderr
    assert not calls.exists()
    w.wait_line("giving up: the attempt crashed before writing any checkpoint")
    w.wait_line("fix the cause, then submit the same batch script again")
    assert kinds(ckpt)[-2:] == ["crashed", "give_up"]


def test_crash_after_progress_requeues(tmp_path):
    env, calls = _fake_slurm(tmp_path)
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("crash"), "--min-progress", "0", env=env)
    assert w.wait() == 0, w.stderr
    assert calls.read_text().split() == ["requeue", "600"]
    evs = list(read_events(ckpt))
    assert evs[-1]["event"] == "requeue" and evs[-1]["cause"] == "crash"


def test_crash_budget_exhausted_from_the_log(tmp_path):
    env, calls = _fake_slurm(tmp_path, restart=2)
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    for n in range(2):
        append_event(ckpt, "wrapper_start", restart=n)
        append_event(ckpt, "requeue", restart=n, cause="crash")
    w = Wrapped(ckpt, app("crash"), "--min-progress", "0", "--max-restarts", "2", env=env)
    assert w.wait() == 3, w.stderr
    assert not calls.exists()
    w.wait_line("giving up: 2 restart(s) after crashes already (--max-restarts 2)")


# -- restart files -------------------------------------------------------------------------


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


def test_periodic_schedule():
    fixed = PeriodicSchedule("30s", start=100.0)
    assert fixed.interval() == 30 and fixed.next_at() == 130 and not fixed.due(129)
    fixed.checkpointed(140.0, 2.0)
    assert fixed.next_at() == 170
    history = [{"event": "restart_set", "seconds": 50.0}]
    auto = PeriodicSchedule("auto", start=0.0, mtbf="12h", history=history)
    assert auto.interval() == pytest.approx((2 * 50 * 43200) ** 0.5)


# -- app mode end to end (outside Slurm) ---------------------------------------------------

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


def test_app_signal_stop_then_resume_then_finish(tmp_path):
    ckpt, work = tmp_path / "ck", tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, "-c", WRITER, str(work), "400"]
    opts = ["--app-signal", "USR2", "--app-ready", "0.5", "--restart-files", str(work / "state"),
            "--settle", "0.3"]  # fmt: skip
    w = Wrapped(ckpt, cmd, *opts)
    w.wait_line("started step")
    w.send(signal.SIGUSR1)  # held for --app-ready, then forwarded as USR2
    assert w.wait() == 0, w.stderr
    w.wait_line("restart files complete")
    w.wait_line("stopped after checkpoint; run again to resume")
    saved = int((work / "state").read_text())
    assert 0 < saved < 400 and not (work / "done").exists()
    evs = list(read_events(ckpt))
    assert [e["outcome"] for e in evs if e["event"] == "step_end"] == ["stopped"]
    sets = [e for e in evs if e["event"] == "restart_set"]
    assert len(sets) == 1 and sets[0]["stop"] and sets[0]["seconds"] is not None
    w2 = Wrapped(ckpt, cmd, *opts)
    assert w2.wait() == 0, w2.stderr
    w2.wait_line("application finished")
    assert (work / "done").read_text() == "400"


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


# -- lead time -----------------------------------------------------------------------------


def test_lead_time_check():
    evs = [{"event": "checkpoint", "seconds": 30.0}, {"event": "checkpoint", "seconds": 10.0}]
    cost = leadtime.measured_cost(evs)
    assert cost == 30.0
    check = leadtime.check_lead(cost, lead=40)
    assert check.too_short and check.needed == 65 and check.suggested == 70
    assert "--signal=B:USR1@70" in leadtime.warning_text(check, "USR1")
    assert not leadtime.check_lead(cost, lead=600).too_short


def test_lead_time_warning_in_the_job_log(tmp_path):
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    append_event(ckpt, "checkpoint", seconds=40.0, step=3)
    end = datetime.fromtimestamp(int(time.time()) + 30).strftime("%Y-%m-%dT%H:%M:%S")
    squeue = fake(tmp_path, "squeue", f"echo {shlex.quote(end)}")
    scontrol = fake(tmp_path, "scontrol", "exit 0")
    env = clean_env(SLURM_JOB_ID="700", HPCCKPT_SQUEUE=squeue, HPCCKPT_SCONTROL=scontrol)
    w = Wrapped(ckpt, app("stop"), env=env)
    wait_state(ckpt, "running")
    w.send(signal.SIGUSR1)
    assert w.wait() == 0, w.stderr
    assert "--signal=B:USR1@80" in w.wait_line("warning: the stop signal came")
    warn = [e for e in read_events(ckpt) if e["event"] == "lead_time_warning"]
    assert warn and warn[0]["suggested_signal"] == "B:USR1@80"
