"""Continuing a job (hpcckpt/job/continuation.py) end to end: chains, requeues after a
crash, the restart budget, with real wrapper processes and fake Slurm commands."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from hpcckpt.rundir.events import append_event, read_events
from tests.job.test_wrapper import Wrapped, app, clean_env, fake, kinds, wait_state


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


#: What a wrapper that continues by requeue asks Slurm first: may the job be requeued at all?
START_CHECK = "show job -o 600"


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
    assert calls.read_text().splitlines() == [START_CHECK]
    w.wait_line("giving up: the attempt crashed before writing any checkpoint")
    w.wait_line("fix the cause, then submit the same batch script again")
    assert kinds(ckpt)[-2:] == ["crashed", "give_up"]


def test_crash_after_progress_requeues(tmp_path):
    env, calls = _fake_slurm(tmp_path)
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("crash"), "--min-progress", "0", env=env)
    assert w.wait() == 0, w.stderr
    assert calls.read_text().splitlines() == [START_CHECK, "requeue 600"]
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
    assert calls.read_text().splitlines() == [START_CHECK]
    w.wait_line("giving up: 2 restart(s) after crashes already (--max-restarts 2)")


def _job_state_slurm(
    tmp_path: Path, state: str, reason: str = "None"
) -> tuple[dict[str, str], Path]:
    """A scontrol that records its calls and reports the job in ``state`` for ``reason``
    (as Slurm 22.05 shows a job whose processes are being killed: COMPLETING, with
    Reason=None after scancel and Reason=TimeLimit at the time limit)."""
    calls = tmp_path / "scontrol-calls"
    body = (
        f'echo "$@" >> {calls}\n'
        'if [ "$1" = show ]; then echo '
        f'"JobId=600 JobName=x JobState={state} Reason={reason} Restarts=0"; fi'
    )
    env = clean_env(SLURM_JOB_ID="600", HPCCKPT_SCONTROL=fake(tmp_path, "scontrol", body))
    return env, calls


def test_term_of_a_cancelled_job_does_not_requeue_after_a_stop(tmp_path):
    env, calls = _job_state_slurm(tmp_path, "COMPLETING")
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("stop"), env=env)
    wait_state(ckpt, "running")
    w.send(signal.SIGTERM)  # what scancel sends the batch shell
    assert w.wait() == 0, w.stderr
    assert calls.read_text().splitlines() == [START_CHECK, "show job -o 600"]
    w.wait_line("job 600 was cancelled (scancel): not continuing it")
    assert kinds(ckpt)[-2:] == ["step_end", "cancelled"]


def test_term_of_a_cancelled_job_does_not_requeue_after_a_crash(tmp_path):
    env, calls = _job_state_slurm(tmp_path, "CANCELLED")
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("ignore"), "--min-progress", "0", env=env)
    wait_state(ckpt, "running")
    w.send(signal.SIGTERM)
    for _ in range(3):  # the third interrupt takes the step down: a crash
        time.sleep(0.2)
        w.send(signal.SIGINT)
    assert w.wait() != 0, w.stderr
    assert "requeue" not in calls.read_text()
    assert "giving up" not in w.stderr
    assert kinds(ckpt)[-2:] == ["crashed", "cancelled"]


@pytest.mark.parametrize(("state", "reason"), [("COMPLETING", "TimeLimit"), ("RUNNING", "None")])
def test_term_at_the_time_limit_still_requeues(tmp_path, state, reason):
    env, calls = _job_state_slurm(tmp_path, state, reason)
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("stop"), env=env)
    wait_state(ckpt, "running")
    w.send(signal.SIGTERM)  # Slurm's TERM at the time limit, or a preemption
    assert w.wait() == 0, w.stderr
    assert calls.read_text().splitlines() == [START_CHECK, "show job -o 600", "requeue 600"]


# -- can this job continue at all? Said at the start, not at the first stop ------------------
def _requeue_flag_slurm(tmp_path: Path, flag: str) -> tuple[dict[str, str], Path]:
    """A scontrol that records its calls and shows the job with ``Requeue=<flag>``."""
    calls = tmp_path / "scontrol-calls"
    body = (
        f'echo "$@" >> {calls}\n'
        'if [ "$1" = show ]; then echo '
        f'"JobId=600 JobName=x JobState=RUNNING Reason=None Requeue={flag} Restarts=0"; fi'
    )
    env = clean_env(SLURM_JOB_ID="600", HPCCKPT_SCONTROL=fake(tmp_path, "scontrol", body))
    return env, calls


def test_a_job_slurm_will_not_requeue_is_told_so_at_the_start(tmp_path):
    env, calls = _requeue_flag_slurm(tmp_path, "0")
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("finish"), env=env)
    assert w.wait() == 0, w.stderr
    assert calls.read_text().splitlines() == [START_CHECK]
    lines = w.stderr.splitlines()
    assert lines[0].endswith("; continue by requeue"), lines
    assert lines[1:3] == [
        "hpcckpt: warning: job 600 cannot be requeued: Slurm shows it with Requeue=0 "
        "(submitted with --no-requeue, or without --requeue where the site sets "
        "JobRequeue=0), so a stop would end it after its checkpoint instead of continuing",
        "hpcckpt: fix: add `#SBATCH --requeue` to the batch script, or continue by new jobs "
        "instead: hpcckpt srun --chain (or hpcckpt run --chain)",
    ], lines
    assert "started step" in lines[3], lines


def test_a_requeueable_job_is_checked_once_and_silently(tmp_path):
    env, calls = _requeue_flag_slurm(tmp_path, "1")
    w = Wrapped(tmp_path / "ck", app("finish"), env=env)
    assert w.wait() == 0, w.stderr
    assert calls.read_text().splitlines() == [START_CHECK]
    assert "warning" not in w.stderr and "Requeue" not in w.stderr, w.stderr


def test_how_a_job_continues_is_said_in_words_at_the_start(tmp_path):
    outside = Wrapped(tmp_path / "a", app("finish"))
    assert outside.wait() == 0, outside.stderr
    assert outside.lines[0].endswith(
        "stop signal USR1; no requeue outside Slurm: run the command again to resume"
    ), outside.lines
    env, calls = _requeue_flag_slurm(tmp_path, "1")
    disabled = Wrapped(tmp_path / "b", app("finish"), "--no-requeue", env=env)
    assert disabled.wait() == 0, disabled.stderr
    assert disabled.lines[0].endswith(
        "stop signal USR1; no requeue (--no-requeue): submit the batch script again to resume"
    ), disabled.lines
    assert not calls.exists()  # not continuing by requeue: nothing to check
